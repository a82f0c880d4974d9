from django.apps import AppConfig


class ManagementConfig(AppConfig):
    name = "management"
    # The label names the app's table (api_stafftoken), its applied migrations (django_migrations,
    # app "api") and its content types in every database already deployed: changing it would need a
    # migration of each.
    label = "api"
    verbose_name = "Management API"

    def ready(self) -> None:
        from management import schema  # noqa: F401  (registers the OpenAPI auth extensions)
