from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from tenants.models import Tenant
from tenants.services import tenant_create


class Command(BaseCommand):
    help = "Create a tenant."

    def add_arguments(self, parser):
        parser.add_argument("name", help="Slug that names the tenant, e.g. acme")
        parser.add_argument("--display-name", default="")
        parser.add_argument("--if-not-exists", action="store_true", help="Succeed quietly if it exists")

    def handle(self, *args, name, display_name, if_not_exists, **options):
        if Tenant.objects.filter(name=name).exists():
            if if_not_exists:
                self.stdout.write(f"tenant {name} already exists")
                return
            raise CommandError(f"tenant {name!r} already exists")
        try:
            tenant = tenant_create(name=name, display_name=display_name)
        except ValidationError as exc:
            raise CommandError("; ".join(f"{k}: {' '.join(v)}" for k, v in exc.message_dict.items())) from exc
        self.stdout.write(f"created tenant {tenant.name} (id {tenant.id})")
