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
    """Queue on `pipe` (sync or async) the read of each worker's state."""
    for name in names:
        pipe.hget(protocol.worker_key(name), "state")
    return pipe


def only_ready(names: list[str], states: list[str | None]) -> list[str]:
    return [name for name, state in zip(names, states, strict=True) if state == "ready"]


def ready_workers(pool: str) -> list[str]:
    """Names of the pool's workers that heartbeat recently and have a ready engine."""
    redis = get_redis()
    fresh = redis.zrangebyscore(protocol.pool_workers_key(pool), heartbeat_cutoff(), "+inf")
    if not fresh:
        return []
    return only_ready(fresh, state_reads(redis.pipeline(transaction=False), fresh).execute())


def worker_alive(name: str) -> bool:
    redis = get_redis()
    pool = redis.hget(protocol.worker_key(name), "pool")
    score = redis.zscore(protocol.pool_workers_key(pool), name) if pool else None
    return score is not None and score > heartbeat_cutoff()
