"""Which workers serve a model pool right now, from their heartbeats in Redis (workers/protocol.py).

Read by admission (a pool's fair-share capacity, quotas/fairshare.py) and by the gateway's dispatch
(wait for a ready worker, detect a lost one), which re-exports these names.
"""

import time

from django.conf import settings

from config.redis_client import get_redis
from workers import protocol


def heartbeat_cutoff() -> float:
    """Workers whose last heartbeat is older than this (unix seconds) count as gone."""
    return time.time() - settings.WORKER_HEARTBEAT_TIMEOUT


def state_reads(pipe, names: list[str]):
    """Queue on `pipe` (sync or async) the read of each worker's state and reported slots."""
    for name in names:
        pipe.hmget(protocol.worker_key(name), "state", "slots")
    return pipe


def only_ready(names: list[str], replies: list[list[str | None]]) -> dict[str, int]:
    """The ready workers among `names`, each with the slots its heartbeat reports (0: none)."""
    return {name: int(slots or 0) for name, (state, slots) in zip(names, replies, strict=True) if state == "ready"}


def ready_workers(pool: str) -> dict[str, int]:
    """The pool's workers that heartbeat recently and have a ready engine, each with its slots
    (its Celery concurrency, 0 if it reports none): one read serves dispatch and fair share."""
    redis = get_redis()
    fresh = redis.zrangebyscore(protocol.pool_workers_key(pool), heartbeat_cutoff(), "+inf")
    if not fresh:
        return {}
    return only_ready(fresh, state_reads(redis.pipeline(transaction=False), fresh).execute())


def worker_alive(name: str) -> bool:
    redis = get_redis()
    pool = redis.hget(protocol.worker_key(name), "pool")
    score = redis.zscore(protocol.pool_workers_key(pool), name) if pool else None
    return score is not None and score > heartbeat_cutoff()
