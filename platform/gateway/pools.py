"""Pool demand and worker state, read from Redis: what /readyz, the operator and /metrics report."""

import json
import time
from dataclasses import asdict, dataclass, field

from django.conf import settings

from config.redis_client import get_redis
from contract import protocol


@dataclass
class WorkerInfo:
    name: str
    pod: str
    state: str
    in_flight: int
    tokens_per_second: float
    last_seen: float


@dataclass
class PoolDemand:
    pool: str
    queue_depth: int
    waiting: int
    in_flight: int
    tokens_per_second: float
    oldest_queued_wait_seconds: float | None
    workers: list[WorkerInfo] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def pool_workers(pool: str) -> list[WorkerInfo]:
    """Workers that heartbeat within the timeout (dead ones are left out)."""
    fresh = protocol.fresh_workers(get_redis(), pool, since=time.time() - settings.WORKER_HEARTBEAT_TIMEOUT)
    return [
        WorkerInfo(
            name=name,
            pod=info.get("pod", ""),
            state=info.get("state", "starting"),
            in_flight=int(info.get("in_flight", 0)),
            tokens_per_second=float(info.get("tps", 0.0)),
            last_seen=info["seen"],
        )
        for name, info in fresh.items()
    ]


def _oldest_queued_wait(queue: str) -> float | None:
    # kombu's Redis transport LPUSHes and BRPOPs: the oldest message is the list's last element.
    redis = get_redis()
    raw = redis.lindex(queue, -1)
    if raw is None:
        return None
    try:
        request_id = json.loads(raw)["headers"]["id"]
    except (ValueError, KeyError, TypeError):
        return None
    stored = redis.get(protocol.input_key(request_id))
    if stored is None:
        return None
    return max(0.0, time.time() - json.loads(stored)["enqueued_at"])


def pool_demand(pool: str) -> PoolDemand:
    redis = get_redis()
    queue = protocol.queue_name(pool)
    workers = pool_workers(pool)
    # Requests sent to one worker's own queue (it holds their adapter) are the pool's demand too.
    own_queues = [protocol.worker_queue_name(w.name) for w in workers]
    return PoolDemand(
        pool=pool,
        queue_depth=sum(redis.llen(q) for q in (queue, *own_queues)),
        waiting=max(0, int(redis.get(protocol.pool_waiting_key(pool)) or 0)),
        in_flight=sum(w.in_flight for w in workers),
        tokens_per_second=round(sum(w.tokens_per_second for w in workers), 2),
        oldest_queued_wait_seconds=max(
            (wait for q in (queue, *own_queues) if (wait := _oldest_queued_wait(q)) is not None), default=None
        ),
        workers=workers,
    )


def pool_drain(pool: str, pod: str, *, drain: bool) -> None:
    key = protocol.pool_drain_key(pool)
    if drain:
        get_redis().sadd(key, pod)
    else:
        get_redis().srem(key, pod)
