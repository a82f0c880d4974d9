"""The limits that apply to a caller, resolved from plan and overrides and cached in Redis.

Admission runs on every request, so the resolved limits of a tenant (and of its keys that have
limits of their own) are kept in Redis for LIMITS_CACHE_SECONDS and dropped whenever a plan or
quota changes (services call `limits_forget`), so every web process sees a change at once.
"""

import json
from dataclasses import dataclass

from django.db.models import F, Sum

from config.database import read_with_fallback
from config.redis_client import get_redis
from core.periods import Period
from ledger.models import UsageRecord
from quotas.models import KeyQuota, LimitFields, TenantQuota

LIMITS_CACHE_SECONDS = 30
_CACHE = "quota:lim:{tenant_id}"
# The last limits read from PostgreSQL, served while it is unreachable (config/database.py).
_LAST_KNOWN = "quota:lim:last:{tenant_id}"
LAST_KNOWN_SECONDS = 7 * 86400


@dataclass(frozen=True)
class Limits:
    """What admission enforces for one request: the tenant's limits and the key's own, if any."""

    tenant: dict[str, int | None]
    key: dict[str, int | None] | None
    # The plan's models (empty: all); catalog.selectors.model_access_allowed applies it.
    allowed_models: tuple[str, ...]
    fair_share_weight: int
    period: Period
    # Tokens the ledger holds for this period: seeds the budget counters when Redis has none.
    tenant_used: int
    key_used: int


def _used_tokens(period: Period, **filters) -> int:
    total = UsageRecord.objects.filter(finished_at__gte=period.start, finished_at__lt=period.end, **filters).aggregate(
        n=Sum(F("prompt_tokens") + F("completion_tokens"))
    )["n"]
    return int(total or 0)


def _resolve(tenant_id: int, period: Period) -> dict:
    quota = TenantQuota.objects.select_related("plan").filter(tenant_id=tenant_id).first()
    plan = quota.plan if quota else None
    tenant_limits = {}
    for name in LimitFields.LIMITS:
        override = getattr(quota, name) if quota else None
        tenant_limits[name] = override if override is not None else (getattr(plan, name) if plan else None)
    keys = {str(kq.api_key_id): kq.limits() for kq in KeyQuota.objects.filter(api_key__tenant_id=tenant_id)}
    used = {"tenant": _used_tokens(period, tenant_id=tenant_id) if tenant_limits["budget_tokens"] is not None else 0}
    for key_id, limits in keys.items():
        if limits["budget_tokens"] is not None:
            used[key_id] = _used_tokens(period, api_key_id=int(key_id))
    return {
        "period": period.id,
        "tenant": tenant_limits,
        "keys": keys,
        "allowed_models": list(plan.allowed_models) if plan else [],
        "weight": plan.fair_share_weight if plan else 1,
        "used": used,
    }


def limits_cache_key(tenant_id: int) -> str:
    """Where the tenant's resolved limits are cached (for a caller that reads them with something else)."""
    return _CACHE.format(tenant_id=tenant_id)


def limits_for(*, tenant_id: int, key_id: int, prefetched: tuple[str | None] | None = None) -> Limits:
    """The limits of the tenant and the key. `prefetched`: the value at `limits_cache_key(tenant_id)`
    (None: absent), read by the caller just before in a round trip of its own; else it is read here."""
    period = Period.current()
    redis = get_redis()
    cache_key = limits_cache_key(tenant_id)
    raw = prefetched[0] if prefetched is not None else redis.get(cache_key)
    record = json.loads(raw) if raw else None
    if record is None or record["period"] != period.id:
        record = read_with_fallback(
            lambda: _resolve(tenant_id, period), lambda: _last_known(tenant_id, period), what="this tenant's limits"
        )
        pipe = redis.pipeline()
        pipe.set(cache_key, json.dumps(record), ex=LIMITS_CACHE_SECONDS)
        pipe.set(_LAST_KNOWN.format(tenant_id=tenant_id), json.dumps(record), ex=LAST_KNOWN_SECONDS)
        pipe.execute()
    key_limits = record["keys"].get(str(key_id))
    return Limits(
        tenant=record["tenant"],
        key=key_limits,
        allowed_models=tuple(record["allowed_models"]),
        fair_share_weight=record["weight"],
        period=period,
        tenant_used=record["used"]["tenant"],
        key_used=record["used"].get(str(key_id), 0),
    )


def _last_known(tenant_id: int, period: Period) -> dict | None:
    """The tenant's limits as last read from PostgreSQL, for a database outage; read in an earlier
    month, its usage so far is that month's, not this one's."""
    raw = get_redis().get(_LAST_KNOWN.format(tenant_id=tenant_id))
    if raw is None:
        return None
    record = json.loads(raw)
    if record["period"] != period.id:
        record.update(period=period.id, used={"tenant": 0})
    return record


def limits_forget(*, tenant_id: int) -> None:
    get_redis().delete(_CACHE.format(tenant_id=tenant_id), _LAST_KNOWN.format(tenant_id=tenant_id))
