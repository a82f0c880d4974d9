"""Settlement: usage became durable → the request's quota reservation is replaced by it.

A request's usage is durable once its entry is in `ledger:pending` (Redis). Settling then gives the
tenant's concurrency slot, fair-share slot and unused budget back at once, without waiting for
PostgreSQL. The settle script (`quota_settle`) is idempotent per request id, so the paths that settle
may overlap safely. Every path by which a request's usage becomes final, and where it settles, is
listed in one table: gateway/lifecycle.py, "How usage becomes final". This module holds the
gateway-side ones: `usage_buffer` (a request no worker finished), the `pending_flushing` receiver
(every ledger flush) and `reservations_reap` (reservations nobody settled).
"""


from django.dispatch import receiver

from config.redis_client import get_redis, scripts_in_one_round_trip
from contract.protocol import LEDGER_PENDING, Usage
from contract.settle import RESERVATIONS, resv_key
from core import clock
from ledger.models import UsageRecord
from ledger.services import ledger_pending_put, pending_flushing
from quotas.admission import quota_settle
from quotas.scripts import quota_script


def usages_settle(usages: list[Usage]) -> None:
    """Settle the reservations of these durable usage entries, in one round trip (idempotent)."""
    if not usages:
        return
    script = quota_script("settle")
    scripts_in_one_round_trip([(script, _settle_keys(usage), _settle_args(usage)) for usage in usages])


def _settle_keys(usage: Usage) -> list[str]:
    return [resv_key(usage.request_id), RESERVATIONS]


def _settle_args(usage: Usage) -> list:
    return [usage.request_id, usage.prompt_tokens, usage.completion_tokens]


def usage_buffer(usage: Usage, *, only_if_absent: bool = False) -> None:
    """Make a usage entry durable (`ledger:pending`) and settle its quota; with `only_if_absent` a
    worker's own entry wins, and the quota settles to what the worker counted."""
    usages_settle([ledger_pending_put(usage, only_if_absent=only_if_absent)])


@receiver(pending_flushing)
def _settle_before_write(sender, usages: list[Usage], **kwargs) -> None:
    usages_settle(usages)


def reservations_reap(*, limit: int = 1000) -> int:
    """Settle reservations that outlived their hold (nobody settled them: a crashed gateway);
    returns how many.

    Settles to the usage in the ledger buffer or the ledger if the request ran, else to zero.
    Safe to run anywhere, any number of times: settle is idempotent.
    """
    redis = get_redis()
    expired = redis.zrangebyscore(RESERVATIONS, "-inf", clock.timestamp(), start=0, num=limit)
    for rid in expired:
        raw = redis.hget(LEDGER_PENDING, rid)
        if raw is not None:
            usage = Usage.loads(raw)
            quota_settle(request_id=rid, prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens)
            continue
        row = UsageRecord.objects.filter(request_id=rid).values("prompt_tokens", "completion_tokens").first()
        quota_settle(request_id=rid, prompt_tokens=row["prompt_tokens"] if row else 0,
                     completion_tokens=row["completion_tokens"] if row else 0)  # fmt: skip
    return len(expired)
