"""Helpers for quota tests: run admissions from many threads at once, and play a worker's part."""

import os
import threading
import time
import uuid

import redis

from contract.protocol import LEDGER_PENDING, Usage
from quotas.admission import QuotaExceeded, quota_admit

_clients = threading.local()


def thread_redis():
    """A client per thread: 200 threads at once are more than one pool's default 100 connections."""
    if not hasattr(_clients, "redis"):
        _clients.redis = redis.Redis.from_url(os.environ["REDIS_URL"], decode_responses=True)
    return _clients.redis


def admit(limits, tenant, key_id, *, prompt=10, max_tokens=16, implicit=False, rid=None):
    """One admission; returns (request id, Admitted) or (request id, QuotaExceeded)."""
    rid = rid or f"chatcmpl-{uuid.uuid4().hex}"
    try:
        return rid, quota_admit(
            request_id=rid, tenant_id=tenant.id, key_id=key_id, limits=limits, prompt_tokens=prompt,
            max_tokens=max_tokens, implicit_max_tokens=implicit, redis=thread_redis(),
        )  # fmt: skip
    except QuotaExceeded as exc:
        return rid, exc


def admit_concurrently(n: int, call) -> list:
    """Run `call()` from n threads released together by a barrier; returns the results."""
    barrier = threading.Barrier(n)
    results = [None] * n

    def run(i):
        barrier.wait()
        results[i] = call()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def worker_reports(redis_client, rid, tenant, key_id, *, prompt, completion, model="tiny-gemma4", status="ok"):
    """What a worker does when a request ends: the usage entry into ledger:pending (serving.RequestEvents.finish)."""
    usage = Usage(
        request_id=rid, tenant_id=tenant.id, key_id=key_id, model=model, prompt_tokens=prompt,
        completion_tokens=completion, queue_ms=5, ttft_ms=20, total_ms=200, finish_reason="length", status=status,
        worker="test-worker", finished_at=time.time(),
    )  # fmt: skip
    redis_client.hset(LEDGER_PENDING, rid, usage.dumps())
    return usage


def wait_for_window_room(redis_client, seconds_needed: float = 8.0) -> None:
    """Per-minute windows follow Redis's clock: start a window test early enough in a minute."""
    now = float(redis_client.time()[0])
    if now % 60 > 60 - seconds_needed:
        time.sleep(60 - now % 60 + 0.05)


def billed_tokens(tenant) -> int:
    """Prompt + completion tokens in the ledger for the tenant."""
    from django.db.models import F, Sum

    from ledger.models import UsageRecord

    total = UsageRecord.objects.filter(tenant=tenant).aggregate(n=Sum(F("prompt_tokens") + F("completion_tokens")))
    return int(total["n"] or 0)
