from django.apps import AppConfig


class AdaptersConfig(AppConfig):
    name = "adapters"
    verbose_name = "LoRA adapters"
