"""Settlement: usage became durable → the request's quota reservation is replaced by it.

A request's usage is durable once its entry is in `ledger:pending` (Redis): the worker writes it
with the stream's `done` event, or the gateway does for a request no worker finished (taken back
from the queue, a lost worker). Settling then gives the tenant's concurrency slot, fair-share slot
and unused budget back at once, without waiting for PostgreSQL. This module is the one place that
does it; the settle script itself (`quota_settle`) is idempotent per request id, so each path below
may overlap the others safely:

- the worker, in the write that carries a request's done event and usage entry (workers/relay.py,
  `quotas.scripts.settle_pending_call`): the fast path of every request a worker ends;
- `usage_record_now` (ledger batching off): the gateway writes the row now, settling on the way;
- `usage_buffer`: the gateway puts the usage of a request no worker finished, and settles it;
- every flush of `ledger:pending` (the periodic `ledger.flush` task, an invoice run) settles each
  batch before writing it (`ledger.services.pending_flushing`), for a request whose gateway died;
- `reservations_reap` (`quotas.reap`, every minute): reservations nobody settled within their hold.
"""

import time

from django.dispatch import receiver

from config.redis_client import get_redis, scripts_in_one_round_trip
from ledger.models import UsageRecord
from ledger.services import ledger_flush, ledger_pending_put, pending_flushing
from ledger.writer import ledger_write_soon
from quotas.admission import quota_settle
from quotas.scripts import RESERVATIONS, quota_script, resv_key
from workers.protocol import LEDGER_PENDING, Usage


def usages_settle(usages: list[Usage]) -> None:
    """Settle the reservations of these durable usage entries, in one round trip (idempotent)."""
    if not usages:
        return
    script = quota_script("settle")
    scripts_in_one_round_trip([(script, _settle_keys(usage), _settle_args(usage)) for usage in usages])


def usage_record_now(request_id: str) -> None:
    """A request ended (its usage entry is pending) and ledger batching is off
    (LEDGER_BATCH_SECONDS=0): settle its quota and write its ledger row now, in this thread.

    Blocking (Redis script, an INSERT): call it through `run_blocking` from async code."""
    ledger_flush(request_ids=[request_id])  # settles through `pending_flushing`, then writes


def usage_record_soon(request_id: str) -> None:
    """A request ended and ledger batching is on: its worker settled its quota already, in the
    write that carried its end; have its row written with this process's next batch
    (LEDGER_BATCH_SECONDS). No I/O: safe on the event loop."""
    ledger_write_soon(request_id)


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
    expired = redis.zrangebyscore(RESERVATIONS, "-inf", time.time(), start=0, num=limit)
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
