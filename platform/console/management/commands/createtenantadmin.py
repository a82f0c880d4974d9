"""manage.py createtenantadmin TENANT USERNAME: a console login that sees only TENANT."""

import getpass
import os

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from console.services import tenant_admin_create
from tenants.models import Tenant


class Command(BaseCommand):
    help = "Create a tenant administrator (a console login scoped to one tenant)."

    def add_arguments(self, parser):
        parser.add_argument("tenant")
        parser.add_argument("username")
        parser.add_argument("--email", default="")
        parser.add_argument(
            "--password-env",
            default="TENANT_ADMIN_PASSWORD",
            help="Environment variable holding the password (default TENANT_ADMIN_PASSWORD); prompted when unset.",
        )

    def handle(self, *args, tenant, username, email, password_env, **options):
        found = Tenant.objects.filter(name=tenant).first()
        if found is None:
            raise CommandError(f"no tenant named {tenant!r}")
        password = os.environ.get(password_env) or getpass.getpass(f"Password for {username}: ")
        try:
            tenant_admin_create(tenant=found, username=username, password=password, email=email)
        except ValidationError as exc:
            raise CommandError("; ".join(exc.messages)) from exc
        self.stdout.write(f"{username} administers tenant {found.name}: sign in at /console/login/")
