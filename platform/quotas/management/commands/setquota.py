"""setquota TENANT [--plan NAME] [--rpm N] [--input-tpm N] [--output-tpm N] [--concurrency N] [--budget-tokens N]

Sets the tenant's plan and per-tenant overrides (or, with --key PREFIX, limits of that key of its own).
A value of `none` removes an override so the plan's value applies again. Prints the effective limits.
"""

import json

from django.core.management.base import BaseCommand, CommandError

from quotas.limits import limits_for
from quotas.models import Plan
from quotas.services import CLEAR, key_quota_set, tenant_quota_set
from tenants.models import ApiKey, Tenant

_OPTIONS = {"rpm": "rpm", "input_tpm": "input-tpm", "output_tpm": "output-tpm", "concurrency": "concurrency",
            "budget_tokens": "budget-tokens"}  # fmt: skip


def _limit_value(raw: str):
    if raw.lower() in {"none", "unlimited"}:
        return CLEAR
    try:
        value = int(raw)
    except ValueError:
        raise CommandError(f"expected a non-negative integer or 'none', got {raw!r}") from None
    if value < 0:
        raise CommandError(f"expected a non-negative integer or 'none', got {raw!r}")
    return value


class Command(BaseCommand):
    help = "Set a tenant's plan and quota overrides (or a key's own limits with --key)."

    def add_arguments(self, parser):
        parser.add_argument("tenant")
        parser.add_argument("--plan", help="plan name, or 'none'")
        parser.add_argument("--key", help="prefix of one of the tenant's keys: set that key's own limits")
        for name, flag in _OPTIONS.items():
            parser.add_argument(f"--{flag}", dest=name, type=_limit_value, metavar="N")

    def handle(self, *args, **options):
        tenant = Tenant.objects.filter(name=options["tenant"]).first()
        if tenant is None:
            raise CommandError(f"no tenant named {options['tenant']!r}")
        limits = {name: options[name] for name in _OPTIONS if options[name] is not None}
        if options["key"]:
            api_key = ApiKey.objects.filter(tenant=tenant, prefix=options["key"]).first()
            if api_key is None:
                raise CommandError(f"tenant {tenant.name} has no key with prefix {options['key']!r}")
            if options["plan"]:
                raise CommandError("--plan applies to a tenant, not to a key")
            key_quota_set(api_key=api_key, **limits)
            key_id = api_key.id
        else:
            plan = None
            if options["plan"]:
                plan = CLEAR if options["plan"].lower() == "none" else Plan.objects.filter(name=options["plan"]).first()
                if plan is None:
                    raise CommandError(f"no plan named {options['plan']!r}")
            tenant_quota_set(tenant=tenant, plan=plan, **limits)
            key_id = 0
        effective = limits_for(tenant_id=tenant.id, key_id=key_id)
        self.stdout.write(json.dumps({"tenant": tenant.name, "limits": effective.tenant, "key_limits": effective.key}))
