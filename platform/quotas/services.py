"""Business rules for plans and quotas. Every change drops the cached limits of the tenants it touches."""

from django.db import transaction
from django.dispatch import receiver

from core.errors import InvalidRequest
from quotas.limits import limits_forget
from quotas.models import KeyQuota, LimitFields, Plan, TenantQuota
from tenants import services as tenant_services
from tenants.models import ApiKey, Tenant

# A value passed as CLEAR removes an override (the plan's value applies again).
CLEAR = object()


def _forget_after_commit(tenant_ids) -> None:
    ids = list(tenant_ids)

    def forget() -> None:
        for tenant_id in ids:
            limits_forget(tenant_id=tenant_id)

    transaction.on_commit(forget)


def _apply(obj, limits: dict) -> None:
    for name, value in limits.items():
        if name not in LimitFields.LIMITS:
            raise InvalidRequest(f"Unknown limit {name!r}.", param=name, code="unknown_limit")
        setattr(obj, name, None if value is CLEAR else value)


def plan_create(*, name: str, **fields) -> Plan:
    plan = Plan(name=name, **fields)
    plan.full_clean()
    plan.save()
    return plan


@transaction.atomic
def plan_update(*, plan: Plan, **fields) -> Plan:
    for name, value in fields.items():
        setattr(plan, name, value)
    plan.full_clean()
    plan.save()
    _forget_after_commit(plan.tenant_quotas.values_list("tenant_id", flat=True))
    return plan


def tenant_quota_get(*, tenant: Tenant) -> TenantQuota:
    quota, _ = TenantQuota.objects.select_related("plan").get_or_create(tenant=tenant)
    return quota


@transaction.atomic
def tenant_quota_set(*, tenant: Tenant, plan: Plan | None | object = None, **limits) -> TenantQuota:
    """Set the tenant's plan (plan=CLEAR for none) and/or per-tenant overrides (value CLEAR removes one)."""
    quota, _ = TenantQuota.objects.select_for_update().get_or_create(tenant=tenant)
    if plan is CLEAR:
        quota.plan = None
    elif plan is not None:
        quota.plan = plan
    _apply(quota, limits)
    quota.full_clean()
    quota.save()
    _forget_after_commit([tenant.id])
    return quota


@transaction.atomic
def key_quota_set(*, api_key: ApiKey, **limits) -> KeyQuota:
    """Limits of one key of its own (enforced on top of the tenant's: the stricter wins)."""
    quota, _ = KeyQuota.objects.select_for_update().get_or_create(api_key=api_key)
    _apply(quota, limits)
    quota.full_clean()
    quota.save()
    _forget_after_commit([api_key.tenant_id])
    return quota


@receiver(tenant_services.rotated)
def _key_quota_follows_rotation(sender, old: ApiKey, new: ApiKey, **kwargs) -> None:
    quota = KeyQuota.objects.filter(api_key=old).first()
    if quota is not None:
        KeyQuota.objects.create(api_key=new, **quota.limits())
        _forget_after_commit([new.tenant_id])
