import datetime as dt

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from tenants.models import Tenant
from tenants.services import apikey_create


class Command(BaseCommand):
    help = "Create an API key for a tenant. The key is printed once, as the last line of output."

    def add_arguments(self, parser):
        parser.add_argument("tenant", help="Tenant name")
        parser.add_argument("--name", default="", help="Label for the key")
        parser.add_argument("--expires-in-days", type=int, default=None)
        parser.add_argument("--models", default="", help="Comma-separated allowlist of model ids")
        parser.add_argument("--admin", action="store_true", help="May manage its tenant through /api/v1/")

    def handle(self, *args, tenant, name, expires_in_days, models, admin=False, **options):
        try:
            owner = Tenant.objects.get(name=tenant)
        except Tenant.DoesNotExist:
            raise CommandError(f"no tenant named {tenant!r}") from None
        if expires_in_days is not None and expires_in_days <= 0:
            raise CommandError("--expires-in-days must be positive")
        expires_at = timezone.now() + dt.timedelta(days=expires_in_days) if expires_in_days else None
        allowed = [m.strip() for m in models.split(",") if m.strip()]
        api_key, plaintext = apikey_create(
            tenant=owner, name=name, expires_at=expires_at, allowed_models=allowed, is_admin=admin
        )
        self.stdout.write(f"created key {api_key.prefix} for tenant {owner.name}; it is shown only once:")
        self.stdout.write(plaintext)
