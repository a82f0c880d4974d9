"""Fair share of a saturated worker pool between tenants, enforced at the gateway.

Celery's pool queues are FIFO: a tenant that floods one would put everyone else behind its backlog.
So the gateways send at most `capacity` requests of a pool to its workers at once (the sum of the
slots its ready workers report in their heartbeat: their Celery concurrency); a request beyond that
waits at a gateway (bounded by QUEUE_TIMEOUT_SECONDS), and a freed slot goes to the waiting tenant
that holds the fewest slots per unit of its plan's fair-share weight. A tenant alone on the pool
still gets all of it. The slot is recorded in the request's reservation, so settling the request
gives it back; slots of requests nobody settled expire with the reservation.
"""

import random
import time

from django.conf import settings

from catalog.readiness import ready_workers as _ready
from config.redis_client import get_redis
from core.errors import ServiceUnavailable
from quotas.admission import HOLD_SECONDS, _script, resv_key
from workers import protocol

# A waiting tenant counts as waiting while one of its requests polled within this many seconds.
WAITER_FRESH_SECONDS = 2.0


def pool_prefix(pool: str) -> str:
    return f"fq:{pool}"


def fair_share_acquire(
    *,
    pool: str,
    request_id: str,
    tenant_id: int,
    weight: int,
    capacity: int,
    timeout: float | None = None,
    poll: float | None = None,
    redis=None,
) -> float:
    """Wait for a slot of the pool; returns the seconds waited. ServiceUnavailable after `timeout`."""
    if capacity <= 0:
        return 0.0
    timeout = settings.QUEUE_TIMEOUT_SECONDS if timeout is None else timeout
    poll = settings.FAIR_SHARE_POLL_SECONDS if poll is None else poll
    script = _script("fair_acquire")
    started = time.monotonic()
    waiting = False
    while True:
        got = script(
            keys=[pool_prefix(pool), resv_key(request_id)],
            args=[tenant_id, request_id, max(1, weight), capacity, HOLD_SECONDS, WAITER_FRESH_SECONDS, int(waiting)],
            client=redis,
        )
        if got == 1:
            return time.monotonic() - started
        if got == -1:
            raise ServiceUnavailable("The request's reservation expired before a worker slot freed.", code="expired")
        waiting = True
        if time.monotonic() - started >= timeout:
            _stop_waiting(redis or get_redis(), pool, tenant_id)
            raise ServiceUnavailable(
                "The model's workers are saturated; try again later.",
                code="pool_saturated",
                headers={"Retry-After": "5"},
            )
        time.sleep(poll * (0.5 + random.random()))  # jitter: waiters do not poll in lockstep


def _stop_waiting(redis, pool: str, tenant_id: int) -> None:
    if redis.hincrby(f"{pool_prefix(pool)}:waitn", tenant_id, -1) < 0:
        redis.hset(f"{pool_prefix(pool)}:waitn", tenant_id, 0)


def pool_capacity(pool: str, ready_workers: list[str] | None = None) -> int:
    """Requests the pool's ready workers run at once: the slots each reports in its heartbeat (its
    Celery concurrency), FAIR_SHARE_SLOTS_PER_WORKER for one that reports none; 0 when fair share is off.
    `ready_workers`: the names the caller already read (the gateway did, a moment before), else read now."""
    if not settings.FAIR_SHARE:
        return 0
    names = _ready(pool) if ready_workers is None else ready_workers
    if not names:
        return 0
    pipe = get_redis().pipeline(transaction=False)
    for name in names:
        pipe.hget(protocol.worker_key(name), "slots")
    return sum(int(slots or 0) or settings.FAIR_SHARE_SLOTS_PER_WORKER for slots in pipe.execute())
