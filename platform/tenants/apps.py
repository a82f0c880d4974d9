from django.apps import AppConfig


class TenantsConfig(AppConfig):
    name = "tenants"

    def ready(self):
        from tenants import signals  # noqa: F401  (connects the auth cache hooks)
