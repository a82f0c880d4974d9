"""Reads over the ledger and the rollups: the one usage aggregation of the platform (`usage_totals`),
used by the management API's usage endpoint and the console's usage pages."""

import datetime as dt

from django.db.models import Case, Count, F, Q, QuerySet, Sum, When
from django.db.models.functions import Coalesce, Trunc, TruncDay, TruncHour

from billing.models import UsageRollup
from catalog.models import ServedModel
from ledger.models import UsageRecord

_DECODE = Q(ttft_ms__isnull=False, completion_tokens__gt=1, total_ms__gt=F("queue_ms") + F("ttft_ms"))


def _ledger_measures() -> dict:
    # The decode measures come first: they read row fields that later annotations shadow by name.
    decode_ms = F("total_ms") - F("queue_ms") - F("ttft_ms")
    return {
        "decode_tokens": Coalesce(Sum(Case(When(_DECODE, then=F("completion_tokens") - 1), default=0)), 0),
        "decode_ms": Coalesce(Sum(Case(When(_DECODE, then=decode_ms), default=0)), 0),
        "requests": Count("id"),
        "failed_requests": Count("id", filter=~Q(status=UsageRecord.Status.OK)),
        "prompt_tokens": Coalesce(Sum("prompt_tokens"), 0),
        "cached_tokens": Coalesce(Sum("cached_tokens"), 0),
        "completion_tokens": Coalesce(Sum("completion_tokens"), 0),
        "queue_ms": Coalesce(Sum("queue_ms"), 0),
    }


def ledger_aggregates(queryset, *group_by: str):
    """The rollup measures of ledger rows, grouped by the given fields (or expressions named in them)."""
    return queryset.values(*group_by).annotate(**_ledger_measures())


TRUNC = {"hour": TruncHour, "day": TruncDay}


def ledger_rows(*, start: dt.datetime, end: dt.datetime, **filters):
    return UsageRecord.objects.filter(finished_at__gte=start, finished_at__lt=end, **filters)


def throughput(*, completion_tokens: int, decode_tokens: int, decode_ms: int, seconds: float) -> dict:
    """Delivered tokens/s over a span of wall-clock time, and the mean decode speed of its requests."""
    return {
        "delivered_tokens_per_second": round(completion_tokens / seconds, 3) if seconds > 0 else 0.0,
        "decode_tokens_per_second": round(decode_tokens * 1000 / decode_ms, 3) if decode_ms else None,
    }


# What `usage_totals` sums: the rollups' measures (queue_ms aside).
USAGE_MEASURES = (
    "requests",
    "failed_requests",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "decode_tokens",
    "decode_ms",
)
USAGE_GRANULARITIES = ("minute", "hour", "day")


def usage_totals(
    *,
    granularity: str,
    start: dt.datetime,
    end: dt.datetime | None = None,
    tenant_id: int | None = None,
    model: str = "",
    api_key_id: int | None = None,
    group: str | None = None,
) -> list[dict]:
    """Sums of USAGE_MEASURES over [start, end) (no end: up to now), for one tenant (None: all), model
    or key, grouped by `group`: "bucket" (one row per `granularity` bucket, its start in "bucket",
    oldest first), "model", or None (one row for the whole span).

    Hours and days are read from billing's rollups (refreshed every minute; a bucket counts whole, by
    its start), minutes from the ledger itself: no raw ledger row is loaded into Python."""
    if granularity not in USAGE_GRANULARITIES:
        raise ValueError(f"granularity must be one of {USAGE_GRANULARITIES}, got {granularity!r}")
    if granularity == "minute":
        rows: QuerySet = _span(UsageRecord.objects.all(), "finished_at", start, end)
        rows = rows.annotate(bucket=Trunc("finished_at", "minute", tzinfo=dt.UTC))
        measures = {name: value for name, value in _ledger_measures().items() if name in USAGE_MEASURES}
    else:
        rows = _span(UsageRollup.objects.filter(granularity=granularity), "bucket_start", start, end)
        rows = rows.annotate(bucket=F("bucket_start"))
        measures = {name: Coalesce(Sum(name), 0) for name in USAGE_MEASURES}
    if tenant_id is not None:
        rows = rows.filter(tenant_id=tenant_id)  # (tenant, time) indexes on the ledger and the rollups
    if model:
        rows = rows.filter(model=model)
    if api_key_id is not None:
        rows = rows.filter(api_key_id=api_key_id)
    rows = rows.order_by()
    if group is None:
        return [rows.aggregate(**measures)]
    return list(rows.values(group).annotate(**measures).order_by(group))


def _span(rows: QuerySet, field: str, start: dt.datetime, end: dt.datetime | None) -> QuerySet:
    rows = rows.filter(**{f"{field}__gte": start})
    return rows if end is None else rows.filter(**{f"{field}__lt": end})


# -- prefix cache --------------------------------------------------------------------------------
# What the prefix-cache hit rates are grouped by: the worker pool (from each row's model; a tenant's
# adapter "<base>:<name>" runs on its base model's pool), the worker, the tenant.
CACHE_GROUPS = ("pool", "worker", "tenant")


def cache_hit_rates(*, by: str, start: dt.datetime, end: dt.datetime | None = None, tenant_id: int | None = None):
    """Prompt tokens, the prompt tokens served from the engines' prefix caches, and their ratio (None
    without prompt tokens), per `by` (one of CACHE_GROUPS), over the ledger rows that finished in
    [start, end) (no end: up to now), highest prompt tokens first. Rows no worker ran (a request
    cancelled before one claimed it) are left out: no engine prefilled their prompt."""
    if by not in CACHE_GROUPS:
        raise ValueError(f"by must be one of {CACHE_GROUPS}, got {by!r}")
    rows = UsageRecord.objects.filter(finished_at__gte=start).exclude(worker="")
    if end is not None:
        rows = rows.filter(finished_at__lt=end)
    if tenant_id is not None:
        rows = rows.filter(tenant_id=tenant_id)
    field = {"pool": "model", "worker": "worker", "tenant": "tenant__name"}[by]
    sums = rows.order_by().values(field).annotate(prompt=Sum("prompt_tokens"), cached=Sum("cached_tokens"))
    totals: dict[str, list[int]] = {}
    pools = dict(ServedModel.objects.values_list("model_id", "pool")) if by == "pool" else {}
    for row in sums:
        name = row[field]
        if by == "pool":
            name = pools.get(name) or pools.get(name.split(":", 1)[0], "")
        total = totals.setdefault(name, [0, 0])
        total[0] += row["prompt"] or 0
        total[1] += row["cached"] or 0
    rates = [
        {by: name, "prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": cached / prompt if prompt else None}
        for name, (prompt, cached) in totals.items()
    ]
    return sorted(rates, key=lambda rate: (-rate["prompt_tokens"], rate[by]))
