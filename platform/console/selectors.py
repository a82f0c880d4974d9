"""Every read the console makes, in one place (HackSoft-style selectors).

Usage numbers are aggregated in PostgreSQL, always over a bounded window, and no raw ledger row is
loaded into Python: totals come from billing's one usage aggregation (`billing.selectors.usage_totals`:
rollups per hour or day, the ledger for minute buckets), latency percentiles (`percentile_cont`) from
indexed range scans of the ledger.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

import redis
from django.db.models import Aggregate, Count, F, FloatField, Q, QuerySet, Sum
from django.db.models.functions import Coalesce, Trunc
from django.http import Http404
from django.utils import timezone

from billing.models import Invoice, UsageRollup
from billing.selectors import cache_hit_rates, usage_totals
from catalog.models import ServedModel
from config.redis_client import get_redis
from contract.protocol import Usage
from core.periods import Period, truncate
from gateway.pools import PoolDemand, pool_demand
from ledger.models import UsageRecord
from ledger.services import LEDGER_REJECTED
from quotas.admission import LIMIT_NAMES
from quotas.limits import limits_for
from quotas.models import KeyQuota, LimitFields, Plan, TenantQuota
from quotas.refusals import refusals_recent
from tenants.models import ApiKey, Tenant

FAILED_STATUSES = (UsageRecord.Status.ERROR, UsageRecord.Status.WORKER_LOST)
OVERVIEW_WINDOW = dt.timedelta(minutes=5)
TOP_TENANTS = 10


class PercentileCont(Aggregate):
    """PostgreSQL's `percentile_cont(f) WITHIN GROUP (ORDER BY expr)`; NULLs are ignored."""

    function = "percentile_cont"
    template = "%(function)s(%(fraction)s) WITHIN GROUP (ORDER BY %(expressions)s)"
    output_field = FloatField()

    def __init__(self, expression, fraction: float, **extra):
        fraction = float(fraction)  # a number from our code, never user input; formatted into SQL
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"percentile fraction must be within [0, 1], got {fraction}")
        super().__init__(expression, fraction=repr(fraction), **extra)


@dataclass(frozen=True)
class UsageWindow:
    """What a usage chart covers: the last `buckets` buckets of one `bucket` unit, up to now."""

    key: str
    label: str
    bucket: str  # a core.periods.truncate unit: minute, hour, day
    step: dt.timedelta
    buckets: int

    def starts(self, now: dt.datetime) -> list[dt.datetime]:
        last = truncate(now, self.bucket)
        return [last - self.step * i for i in reversed(range(self.buckets))]

    def label_for(self, start: dt.datetime) -> str:
        if self.bucket == "day":
            return start.strftime("%m-%d")
        if self.step * self.buckets > dt.timedelta(days=1):
            return start.strftime("%m-%d %H:%M")
        return start.strftime("%H:%M")


PERIODS = {
    p.key: p
    for p in (
        UsageWindow("1h", "last hour", "minute", dt.timedelta(minutes=1), 60),
        UsageWindow("24h", "last 24 hours", "hour", dt.timedelta(hours=1), 24),
        UsageWindow("7d", "last 7 days", "hour", dt.timedelta(hours=1), 24 * 7),
        UsageWindow("30d", "last 30 days", "day", dt.timedelta(days=1), 30),
    )
}
DEFAULT_PERIOD = "24h"


def period_get(key: str | None) -> UsageWindow:
    return PERIODS.get(key or DEFAULT_PERIOD, PERIODS[DEFAULT_PERIOD])


# --- usage ------------------------------------------------------------------------------------
#
# Totals (requests, failures, tokens) come from `usage_totals`: billing's rollups for hour and day
# buckets, the ledger only for the last hour's minute buckets. Rollups hold sums, not distributions,
# so the latency percentiles are computed from the ledger over at most PERCENTILE_WINDOW.

PERCENTILE_WINDOW = dt.timedelta(days=7)
# Platform-wide pages sort every tenant's rows: a shorter window keeps them fast.
PERCENTILE_WINDOW_ALL_TENANTS = dt.timedelta(days=1)


def _percentile_window(tenant: Tenant | None) -> dt.timedelta:
    return PERCENTILE_WINDOW if tenant is not None else PERCENTILE_WINDOW_ALL_TENANTS


def _percentile_aggregates() -> dict:
    return {
        "ttft_p50": PercentileCont("ttft_ms", 0.5),
        "ttft_p95": PercentileCont("ttft_ms", 0.95),
        "ttft_p99": PercentileCont("ttft_ms", 0.99),
        "decode_p50": PercentileCont("decode_tokens_per_second", 0.5),
        # The slow end of decode speed is what a user notices: the 10th percentile.
        "decode_p10": PercentileCont("decode_tokens_per_second", 0.1),
    }


def _scoped(rows: QuerySet, *, tenant: Tenant | None, model: str) -> QuerySet:
    if tenant is not None:
        rows = rows.filter(tenant=tenant)  # (tenant, time) indexes on the ledger and the rollups
    if model:
        rows = rows.filter(model=model)
    return rows


def _totals(*, tenant: Tenant | None, model: str, period: UsageWindow, since: dt.datetime, group: str) -> list[dict]:
    """Sums grouped by `group` ("bucket" or "model") since `since`."""
    return usage_totals(
        granularity=period.bucket, start=since, tenant_id=tenant.id if tenant is not None else None, model=model,
        group=group,
    )  # fmt: skip


def _percentiles(*, tenant: Tenant | None, model: str, period: UsageWindow, since: dt.datetime, now, group: str):
    since = max(since, now - _percentile_window(tenant))
    rows = _scoped(UsageRecord.objects.filter(finished_at__gte=since), tenant=tenant, model=model).order_by()
    rows = rows.annotate(bucket=Trunc("finished_at", period.bucket, tzinfo=dt.UTC))
    return {row[group]: row for row in rows.values(group).annotate(**_percentile_aggregates())}


@dataclass
class UsageSeries:
    """One chart's worth of data: a value per time bucket, zero-filled, oldest first."""

    period: UsageWindow
    labels: list[str] = field(default_factory=list)
    requests: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    input_tps: list[float] = field(default_factory=list)
    output_tps: list[float] = field(default_factory=list)
    ttft_p50: list[float | None] = field(default_factory=list)
    ttft_p95: list[float | None] = field(default_factory=list)
    decode_p50: list[float | None] = field(default_factory=list)
    decode_p10: list[float | None] = field(default_factory=list)

    @property
    def total_requests(self) -> int:
        return sum(self.requests)

    @property
    def total_failed(self) -> int:
        return sum(self.failed)

    def chart_data(self) -> dict:
        return {
            "labels": self.labels,
            "tokens": {"input": self.input_tps, "output": self.output_tps},
            "requests": self.requests,
            "failed": self.failed,
            "ttft": {"p50": self.ttft_p50, "p95": self.ttft_p95},
            "decode": {"p50": self.decode_p50, "p10": self.decode_p10},
        }


def _rounded(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def usage_series(
    *, tenant: Tenant | None, period: UsageWindow, model: str = "", now: dt.datetime | None = None
) -> UsageSeries:
    """Tokens/s in and out, requests, failures and latency percentiles per time bucket."""
    now = now or timezone.now()
    starts = period.starts(now)
    scope = {"tenant": tenant, "model": model, "period": period, "since": starts[0], "group": "bucket"}
    totals = {row["bucket"]: row for row in _totals(**scope)}
    percentiles = _percentiles(**scope, now=now)
    seconds = period.step.total_seconds()
    series = UsageSeries(period=period)
    for start in starts:
        row, pct = totals.get(start, {}), percentiles.get(start, {})
        series.labels.append(period.label_for(start))
        series.requests.append(row.get("requests") or 0)
        series.failed.append(row.get("failed_requests") or 0)
        series.input_tps.append(round((row.get("prompt_tokens") or 0) / seconds, 3))
        series.output_tps.append(round((row.get("completion_tokens") or 0) / seconds, 3))
        series.ttft_p50.append(_rounded(pct.get("ttft_p50")))
        series.ttft_p95.append(_rounded(pct.get("ttft_p95")))
        series.decode_p50.append(_rounded(pct.get("decode_p50")))
        series.decode_p10.append(_rounded(pct.get("decode_p10")))
    return series


def usage_by_model(*, tenant: Tenant | None, period: UsageWindow, now: dt.datetime | None = None) -> list[dict]:
    """Per model over the period: totals, failure rate, mean decode speed, TTFT and decode percentiles."""
    now = now or timezone.now()
    scope = {"tenant": tenant, "model": "", "period": period, "since": period.starts(now)[0], "group": "model"}
    percentiles = _percentiles(**scope, now=now)
    rows = sorted(_totals(**scope), key=lambda row: -(row["requests"] or 0))
    for row in rows:
        row.update(percentiles.get(row["model"], {}))
        row["failure_rate"] = (row["failed_requests"] or 0) / row["requests"] if row["requests"] else 0.0
        row["decode_mean"] = row["decode_tokens"] * 1000 / row["decode_ms"] if row["decode_ms"] else None
        row["hit_rate"] = _hit_rate(row["cached_tokens"], row["prompt_tokens"])
    return rows


def _hit_rate(cached_tokens: int | None, prompt_tokens: int | None) -> float | None:
    return (cached_tokens or 0) / prompt_tokens if prompt_tokens else None


def usage_hit_rate(by_model: list[dict]) -> float | None:
    """The prefix-cache hit rate (cached prompt tokens / prompt tokens) of `usage_by_model`'s rows together."""
    cached = sum(row["cached_tokens"] or 0 for row in by_model)
    return _hit_rate(cached, sum(row["prompt_tokens"] or 0 for row in by_model))


def cache_hits(*, tenant: Tenant | None, period: UsageWindow, now: dt.datetime | None = None) -> dict[str, list]:
    """Prefix-cache hit rates over the period (at most the percentiles' window: a ledger scan), per pool,
    and on the platform-wide page per worker and per tenant too (a tenant's page names no worker)."""
    now = now or timezone.now()
    since = max(period.starts(now)[0], now - _percentile_window(tenant))
    groups = ("pool",) if tenant is not None else ("pool", "worker", "tenant")
    tenant_id = tenant.id if tenant is not None else None
    return {by: cache_hit_rates(by=by, start=since, tenant_id=tenant_id) for by in groups}


def percentile_window_label(period: UsageWindow, *, tenant: Tenant | None) -> str:
    """What the percentiles cover when the period is longer than their window ("" when it is not)."""
    window = _percentile_window(tenant)
    if period.step * period.buckets <= window:
        return ""
    return f"last {window.days} days" if window.days > 1 else "last 24 hours"


def usage_models() -> list[str]:
    """Model ids to filter the usage pages by: the catalog's."""
    return list(ServedModel.objects.values_list("model_id", flat=True))


# --- overview ---------------------------------------------------------------------------------


@dataclass
class Overview:
    window_seconds: int
    requests_per_second: float
    input_tokens_per_second: float
    output_tokens_per_second: float
    error_rate: float
    requests: int
    errors: int
    pools: list[PoolDemand]
    top_tenants: list[dict] = field(default_factory=list)
    redis_error: str = ""

    @property
    def error_percent(self) -> float:
        return self.error_rate * 100

    @property
    def worker_count(self) -> int:
        return sum(len(p.workers) for p in self.pools)


def platform_overview(*, now: dt.datetime | None = None) -> Overview:
    """Rates over the last few minutes of the ledger, plus live pool state from Redis."""
    now = now or timezone.now()
    window = OVERVIEW_WINDOW.total_seconds()
    recent = UsageRecord.objects.filter(finished_at__gte=now - OVERVIEW_WINDOW).order_by()
    measures = {
        "requests": Count("id"),
        "prompt_tokens": Coalesce(Sum("prompt_tokens"), 0),
        "completion_tokens": Coalesce(Sum("completion_tokens"), 0),
        "errors": Count("id", filter=Q(status__in=FAILED_STATUSES)),
    }
    totals = recent.aggregate(**measures)
    top_tenants = list(recent.values("tenant__name").annotate(**measures).order_by("-completion_tokens")[:TOP_TENANTS])
    pools: list[PoolDemand] = []
    redis_error = ""
    try:
        pools = [
            pool_demand(pool) for pool in ServedModel.objects.order_by("pool").values_list("pool", flat=True).distinct()
        ]
    except redis.RedisError as exc:
        redis_error = f"Redis is unreachable: {exc}"
    return Overview(
        window_seconds=int(window),
        requests_per_second=round(totals["requests"] / window, 3),
        input_tokens_per_second=round(totals["prompt_tokens"] / window, 1),
        output_tokens_per_second=round(totals["completion_tokens"] / window, 1),
        error_rate=totals["errors"] / totals["requests"] if totals["requests"] else 0.0,
        requests=totals["requests"],
        errors=totals["errors"],
        pools=pools,
        top_tenants=top_tenants,
        redis_error=redis_error,
    )


# --- tenants and keys -------------------------------------------------------------------------


def tenant_search(*, query: str = "") -> QuerySet:
    tenants = Tenant.objects.order_by("name")
    query = query.strip()
    if query:
        tenants = tenants.filter(Q(name__icontains=query) | Q(display_name__icontains=query))
    return tenants


def tenant_page_stats(*, tenant_ids: list[int], now: dt.datetime | None = None) -> dict[int, dict]:
    """Active keys and the last 24 hours' usage (hourly rollups) of a page of tenants: two grouped queries."""
    since = truncate((now or timezone.now()) - dt.timedelta(hours=24), "hour")
    stats = {tid: {"active_keys": 0, "requests_24h": 0, "tokens_24h": 0} for tid in tenant_ids}
    keys = (
        ApiKey.objects.filter(tenant_id__in=tenant_ids, revoked_at__isnull=True)
        .values("tenant_id")
        .annotate(n=Count("id"))
        .order_by()
    )
    for row in keys:
        stats[row["tenant_id"]]["active_keys"] = row["n"]
    usage = (
        UsageRollup.objects.filter(granularity="hour", tenant_id__in=tenant_ids, bucket_start__gte=since)
        .values("tenant_id")
        .annotate(n=Sum("requests"), tokens=Sum(F("prompt_tokens") + F("completion_tokens")))
        .order_by()
    )
    for row in usage:
        stats[row["tenant_id"]].update(requests_24h=row["n"] or 0, tokens_24h=row["tokens"] or 0)
    return stats


def tenant_for_user(user, name: str) -> Tenant:
    """The tenant `name` if `user` may see it, else 404 (another tenant's pages do not exist for them)."""
    if not user.is_authenticated or not user.is_active:
        raise Http404
    if user.is_staff:
        tenant = Tenant.objects.filter(name=name).first()
    else:
        tenant = Tenant.objects.filter(name=name, memberships__user=user).first()
    if tenant is None:
        raise Http404
    return tenant


def tenant_of_member(user) -> Tenant | None:
    return Tenant.objects.filter(memberships__user=user).first() if user.is_authenticated else None


def apikey_list(*, tenant: Tenant) -> QuerySet:
    return ApiKey.objects.filter(tenant=tenant).order_by("revoked_at", "-created_at")


def apikey_get(*, tenant: Tenant, key_id: int) -> ApiKey:
    key = ApiKey.objects.filter(tenant=tenant, id=key_id).first()
    if key is None:
        raise Http404
    return key


# --- plans, limits, invoices, throttling ------------------------------------------------------


@dataclass
class TenantLimits:
    plan: Plan | None
    overrides: dict[str, int | None]
    effective: dict[str, int | None]
    key_limits: list[tuple[ApiKey, dict[str, int | None]]]
    period: Period
    used_tokens: int

    @property
    def rows(self) -> list[dict]:
        plan_limits = self.plan.limits() if self.plan else {}
        return [
            {
                "name": name,
                "label": LIMIT_LABELS[name],
                "plan": plan_limits.get(name),
                "override": self.overrides.get(name),
                "effective": self.effective.get(name),
            }
            for name in LimitFields.LIMITS
        ]

    @property
    def budget_percent(self) -> float | None:
        budget = self.effective.get("budget_tokens")
        return None if not budget else min(100.0, self.used_tokens * 100 / budget)


LIMIT_LABELS = {
    "rpm": "Requests per minute",
    "input_tpm": "Input tokens per minute",
    "output_tpm": "Output tokens per minute",
    "concurrency": "Concurrent requests",
    "budget_tokens": "Token budget per month",
}


def tenant_limits(*, tenant: Tenant) -> TenantLimits:
    """The tenant's plan, its overrides, what admission enforces, and this month's tokens so far."""
    quota = TenantQuota.objects.select_related("plan").filter(tenant=tenant).first()
    plan = quota.plan if quota else None
    overrides = quota.limits() if quota else dict.fromkeys(LimitFields.LIMITS)
    effective = limits_for(tenant_id=tenant.id, key_id=0).tenant  # admission's own resolution (cached)
    key_limits = [
        (kq.api_key, kq.limits())
        for kq in KeyQuota.objects.filter(api_key__tenant=tenant, api_key__revoked_at__isnull=True).select_related(
            "api_key"
        )
    ]
    period = Period.current()
    # Closed days from the daily rollups plus today from the ledger: bounded whatever the month's volume.
    today = truncate(timezone.now(), "day")
    used = (
        UsageRollup.objects.filter(
            granularity="day", tenant=tenant, bucket_start__gte=period.start, bucket_start__lt=today
        ).aggregate(n=Sum(F("prompt_tokens") + F("completion_tokens")))["n"]
        or 0
    )
    used += (
        UsageRecord.objects.filter(tenant=tenant, finished_at__gte=max(today, period.start)).aggregate(
            n=Sum(F("prompt_tokens") + F("completion_tokens"))
        )["n"]
        or 0
    )
    return TenantLimits(plan, overrides, effective, key_limits, period, used)


def plan_list() -> QuerySet:
    return Plan.objects.annotate(tenants=Count("tenant_quotas")).order_by("name")


def invoice_list(*, tenant: Tenant | None, status: str = "") -> QuerySet:
    invoices = Invoice.objects.select_related("tenant").order_by("-period_start", "tenant__name")
    if tenant is not None:
        invoices = invoices.filter(tenant=tenant)
    if status:
        invoices = invoices.filter(status=status)
    return invoices


def invoice_get(*, tenant: Tenant, number: str) -> Invoice:
    invoice = Invoice.objects.filter(tenant=tenant, number=number).prefetch_related("lines").first()
    if invoice is None:
        raise Http404
    return invoice


@dataclass(frozen=True)
class ThrottleEvent:
    at: dt.datetime
    key: str
    limit: str
    code: str
    message: str
    retry_after: int | None

    @property
    def limit_label(self) -> str:
        return LIMIT_NAMES.get(self.limit, self.limit or "unknown")


def throttle_events(*, tenant: Tenant, limit: int = 100) -> list[ThrottleEvent]:
    """The tenant's most recent requests refused by a limit, newest first (recorded by admission:
    quotas/refusals.py)."""
    return [
        ThrottleEvent(
            at=_from_unix(refusal.at),
            key=refusal.key_prefix,
            limit=refusal.limit,
            code=refusal.code,
            message=refusal.message,
            retry_after=refusal.retry_after,
        )  # fmt: skip
        for refusal in refusals_recent(tenant_id=tenant.id, count=limit)
    ]


def throttle_summary(events: list[ThrottleEvent]) -> list[tuple[str, int]]:
    counts: dict[str, int] = {}
    for event in events:
        counts[event.limit_label] = counts.get(event.limit_label, 0) + 1
    return sorted(counts.items(), key=lambda item: -item[1])


def usage_not_in_ledger() -> list[dict]:
    """Usage the ledger refused (`ledger:rejected`: its key or tenant was deleted while it ran),
    newest first: it keeps its tenant's invoice for that month open until an operator settles it."""
    usages = [Usage.loads(raw) for _, raw in get_redis().hscan_iter(LEDGER_REJECTED, count=500)]
    names = dict(Tenant.objects.filter(id__in={u.tenant_id for u in usages}).values_list("id", "name"))
    return [
        {"usage": usage, "tenant_name": names.get(usage.tenant_id), "finished_at": _from_unix(usage.finished_at)}
        for usage in sorted(usages, key=lambda u: u.finished_at, reverse=True)
    ]


def _from_unix(seconds: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(seconds, tz=dt.UTC)
