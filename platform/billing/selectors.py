"""Reads over the ledger and the rollups."""

import datetime as dt

from django.db.models import Case, Count, F, Q, Sum, When
from django.db.models.functions import Coalesce, TruncDay, TruncHour

from ledger.models import UsageRecord

_DECODE = Q(ttft_ms__isnull=False, completion_tokens__gt=1, total_ms__gt=F("queue_ms") + F("ttft_ms"))


def ledger_aggregates(queryset, *group_by: str):
    """The rollup measures of ledger rows, grouped by the given fields (or expressions named in them)."""
    # The decode measures come first: they read row fields that later annotations shadow by name.
    return queryset.values(*group_by).annotate(
        decode_tokens=Coalesce(Sum(Case(When(_DECODE, then=F("completion_tokens") - 1), default=0)), 0),
        decode_ms=Coalesce(Sum(Case(When(_DECODE, then=F("total_ms") - F("queue_ms") - F("ttft_ms")), default=0)), 0),
        requests=Count("id"),
        failed_requests=Count("id", filter=~Q(status=UsageRecord.Status.OK)),
        prompt_tokens=Coalesce(Sum("prompt_tokens"), 0),
        completion_tokens=Coalesce(Sum("completion_tokens"), 0),
        queue_ms=Coalesce(Sum("queue_ms"), 0),
    )


TRUNC = {"hour": TruncHour, "day": TruncDay}


def ledger_rows(*, start: dt.datetime, end: dt.datetime, **filters):
    return UsageRecord.objects.filter(finished_at__gte=start, finished_at__lt=end, **filters)


def throughput(*, completion_tokens: int, decode_tokens: int, decode_ms: int, seconds: float) -> dict:
    """Delivered tokens/s over a span of wall-clock time, and the mean decode speed of its requests."""
    return {
        "delivered_tokens_per_second": round(completion_tokens / seconds, 3) if seconds > 0 else 0.0,
        "decode_tokens_per_second": round(decode_tokens * 1000 / decode_ms, 3) if decode_ms else None,
    }
