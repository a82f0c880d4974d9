from django.core.management.base import BaseCommand, CommandError

from tenants.models import ApiKey
from tenants.services import apikey_find, apikey_revoke


class Command(BaseCommand):
    help = "Revoke an API key now (also one in a rotation's grace period), given the key or its prefix."

    def add_arguments(self, parser):
        parser.add_argument("key_or_prefix")

    def handle(self, *args, key_or_prefix, **options):
        try:
            api_key = apikey_find(key_or_prefix=key_or_prefix)
        except ApiKey.DoesNotExist:
            raise CommandError("no such key") from None
        if not apikey_revoke(api_key=api_key):
            self.stdout.write(f"key {api_key.prefix} was already revoked at {api_key.revoked_at:%Y-%m-%d %H:%M:%S}")
            return
        self.stdout.write(f"revoked key {api_key.prefix} of tenant {api_key.tenant.name}")
