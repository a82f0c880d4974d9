from django.apps import AppConfig


class QuotasConfig(AppConfig):
    name = "quotas"

    def ready(self) -> None:
        from quotas import services, settlement  # noqa: F401  (connect the key-rotation and ledger-flush receivers)
