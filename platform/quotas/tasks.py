"""Periodic quota bookkeeping (Celery, `control` queue)."""

import time

from celery import shared_task

from config.redis_client import get_redis
from ledger.models import UsageRecord
from quotas.admission import RESERVATIONS, quota_settle
from workers.protocol import LEDGER_PENDING, Usage


@shared_task(name="quotas.reap", ignore_result=True)
def quota_reap(limit: int = 1000) -> int:
    """Settle reservations that outlived their hold (nobody settled them: a crashed gateway).

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
