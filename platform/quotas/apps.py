from django.apps import AppConfig


class QuotasConfig(AppConfig):
    name = "quotas"

    def ready(self) -> None:
        from quotas import services  # noqa: F401  (connects the key-rotation receiver)
