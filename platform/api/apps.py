from django.apps import AppConfig


class ApiConfig(AppConfig):
    name = "api"
    verbose_name = "Management API"

    def ready(self) -> None:
        from api import schema  # noqa: F401  (registers the OpenAPI auth extensions)
