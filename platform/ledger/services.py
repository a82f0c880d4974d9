"""Moving metered usage from Redis (where workers put it) into the PostgreSQL ledger, exactly once.

Workers write each request's final usage into the `ledger:pending` hash in the same Redis
transaction as the stream's `done` event. This module drains that hash with an idempotent insert
(unique request id, ON CONFLICT DO NOTHING) and only then removes the entries: if PostgreSQL is down,
usage stays in Redis and a later flush writes it; a replayed result is ignored by the unique key.

The ledger only writes. A usage entry in `ledger:pending` is durable, which is when the request's
quota reservation is settled: that is the quotas app's (quotas/settlement.py), which a flush tells
through the `pending_flushing` signal before it writes a batch.
"""

import datetime as dt
import logging

from django.db import DatabaseError, IntegrityError, transaction
from django.dispatch import Signal

from config.redis_client import get_redis
from contract.protocol import LEDGER_PENDING, Usage
from ledger.models import UsageRecord

log = logging.getLogger(__name__)

# Usage entries the ledger refused on their own (a key or tenant deleted mid-request), for operators.
LEDGER_REJECTED = "ledger:rejected"
# Sent with `usages=` (a list of contract.protocol.Usage) by `ledger_flush` before it
# writes a batch of pending entries: whoever owns what durable usage releases (the quotas' settlement)
# acts on it before the rows reach PostgreSQL, so it never waits for the database. Receivers must be
# idempotent: an entry is announced again by every flush until its row is written.
pending_flushing = Signal()


def usage_record_from(usage: Usage) -> UsageRecord:
    decode_tps = None
    if usage.ttft_ms is not None and usage.completion_tokens > 1:
        decode_ms = usage.total_ms - usage.queue_ms - usage.ttft_ms
        if decode_ms > 0:
            decode_tps = (usage.completion_tokens - 1) * 1000.0 / decode_ms
    return UsageRecord(
        request_id=usage.request_id,
        tenant_id=usage.tenant_id,
        api_key_id=usage.key_id,
        model=usage.model,
        prompt_tokens=usage.prompt_tokens,
        cached_tokens=usage.cached_tokens,
        completion_tokens=usage.completion_tokens,
        queue_ms=usage.queue_ms,
        ttft_ms=usage.ttft_ms,
        total_ms=usage.total_ms,
        decode_tokens_per_second=decode_tps,
        finish_reason=usage.finish_reason or "",
        status=usage.status,
        worker=usage.worker,
        finished_at=dt.datetime.fromtimestamp(usage.finished_at, tz=dt.UTC),
    )


def ledger_write(usages: list[Usage]) -> None:
    """Insert rows; a request id already in the ledger is skipped, never counted twice.

    In request id order: two writers of the same pending entries at once (a web process's ledger
    writer and the periodic flush) each lock a row's unique key as they insert it, so in their own
    orders each could hold a key the other waits for: a deadlock that fails one flush."""
    rows = [usage_record_from(u) for u in sorted(usages, key=lambda usage: usage.request_id)]
    UsageRecord.objects.bulk_create(rows, ignore_conflicts=True)


def ledger_flush(*, request_ids: list[str] | None = None, batch_size: int = 500) -> int:
    """Write pending usage into the ledger; returns how many entries were flushed.

    With request_ids, only those entries (the gateway's fast path right after a request ends);
    without, everything pending (the periodic task). Each batch is announced on `pending_flushing`
    first (the quotas settle from it). Entries stay in Redis when PostgreSQL fails.
    """
    redis = get_redis()
    flushed = 0
    for raw_by_id in _pending_batches(redis, request_ids, batch_size):
        usages = [Usage.loads(raw) for raw in raw_by_id.values()]
        pending_flushing.send(sender=UsageRecord, usages=usages)
        try:
            try:
                ledger_write(usages)
            except IntegrityError:
                _write_one_by_one(redis, usages, raw_by_id)
        except DatabaseError:
            log.warning("ledger flush failed; %d usage entries stay pending in Redis", len(usages), exc_info=True)
            break
        redis.hdel(LEDGER_PENDING, *raw_by_id.keys())
        flushed += len(usages)
    return flushed


def _write_one_by_one(redis, usages: list[Usage], raw_by_id: dict[str, str]) -> None:
    """A batch the database refused: write its rows one by one, so that one bad entry (its API key
    or tenant deleted while the request ran) cannot hold back every other request's usage forever.
    An entry refused on its own is kept in `ledger:rejected` for an operator, never dropped."""
    for usage in usages:
        try:
            with transaction.atomic():
                ledger_write([usage])
        except IntegrityError as exc:
            redis.hset(LEDGER_REJECTED, usage.request_id, raw_by_id[usage.request_id])
            log.error("usage of %s refused by the ledger (%s); kept in %s", usage.request_id, exc, LEDGER_REJECTED)


def _pending_batches(redis, request_ids, batch_size):
    if request_ids is not None:
        raws = redis.hmget(LEDGER_PENDING, request_ids) if request_ids else []
        found = {rid: raw for rid, raw in zip(request_ids, raws, strict=True) if raw is not None}
        if found:
            yield found
        return
    batch: dict[str, str] = {}
    for rid, raw in redis.hscan_iter(LEDGER_PENDING, count=batch_size):
        batch[rid] = raw
        if len(batch) >= batch_size:
            yield batch
            batch = {}
    if batch:
        yield batch


def ledger_unwritten(*, start: dt.datetime, end: dt.datetime) -> dict[str, list[Usage]]:
    """Usage that finished in [start, end) and is not in the ledger: still pending in Redis, or
    refused by the ledger and kept in `ledger:rejected`; by where it is."""
    redis = get_redis()
    unwritten: dict[str, list[Usage]] = {"pending": [], "rejected": []}
    for where, key in (("pending", LEDGER_PENDING), ("rejected", LEDGER_REJECTED)):
        for _, raw in redis.hscan_iter(key, count=500):
            usage = Usage.loads(raw)
            if start.timestamp() <= usage.finished_at < end.timestamp():
                unwritten[where].append(usage)
    return unwritten


def ledger_pending_put(usage: Usage, *, only_if_absent: bool = False) -> Usage:
    """Buffer a usage entry durably in Redis (the gateway's, for a request no worker finished);
    returns the entry the buffer holds: with `only_if_absent`, the worker's own if it wrote one."""
    redis = get_redis()
    if only_if_absent:
        if not redis.hsetnx(LEDGER_PENDING, usage.request_id, usage.dumps()):
            return Usage.loads(redis.hget(LEDGER_PENDING, usage.request_id) or usage.dumps())
    else:
        redis.hset(LEDGER_PENDING, usage.request_id, usage.dumps())
    return usage
