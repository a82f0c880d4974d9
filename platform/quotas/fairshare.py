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
from collections.abc import Mapping

from django.conf import settings

from catalog.readiness import ready_workers as _ready
from config.redis_client import get_redis
from contract.settle import resv_key
from core.errors import ServiceUnavailable
from quotas.admission import HOLD_SECONDS, Admitted, admit_call, admitted_from, quota_admit
from quotas.limits import Limits
from quotas.scripts import quota_script

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
    queued: bool = False,
    redis=None,
) -> float:
    """Wait for a slot of the pool; returns the seconds waited. ServiceUnavailable after `timeout`.

    `queued`: the request's first try already found no slot and counted it as waiting
    (`quota_admit_with_slot`); the tries go on from there."""
    if capacity <= 0:
        return 0.0
    timeout = settings.QUEUE_TIMEOUT_SECONDS if timeout is None else timeout
    poll = settings.FAIR_SHARE_POLL_SECONDS if poll is None else poll
    script = quota_script("fair_acquire")
    started = time.monotonic()
    waiting = queued
    while True:
        if waiting:
            if time.monotonic() - started >= timeout:
                _stop_waiting(redis or get_redis(), pool, tenant_id)
                raise ServiceUnavailable(
                    "The model's workers are saturated; try again later.",
                    code="pool_saturated",
                    headers={"Retry-After": "5"},
                )
            time.sleep(poll * (0.5 + random.random()))  # jitter: waiters do not poll in lockstep
        got = script(
            keys=_slot_keys(pool, request_id), args=_slot_args(tenant_id, request_id, weight, capacity, waiting),
            client=redis,
        )  # fmt: skip
        if got == 1:
            return time.monotonic() - started
        if got == -1:
            raise ServiceUnavailable("The request's reservation expired before a worker slot freed.", code="expired")
        waiting = True


def quota_admit_with_slot(
    *, request_id: str, tenant_id: int, key_id: int, limits: Limits, prompt_tokens: int, max_tokens: int,
    implicit_max_tokens: bool, choices: int = 1, pool: str, weight: int, capacity: int, redis=None,
) -> tuple[Admitted, bool]:  # fmt: skip
    """`quota_admit` and, for a pool of `capacity` slots (> 0), the first try for the request's slot,
    in one script: one round trip, and no moment where the reservation exists without its try.
    Returns the reservation and whether the slot was taken (always, with no capacity to share);
    if not, the request counts as waiting and goes on with `fair_share_acquire(queued=True)`.
    Raises QuotaExceeded (nothing reserved, no slot tried)."""
    if capacity <= 0:
        admitted = quota_admit(
            request_id=request_id, tenant_id=tenant_id, key_id=key_id, limits=limits, prompt_tokens=prompt_tokens,
            max_tokens=max_tokens, implicit_max_tokens=implicit_max_tokens, choices=choices, redis=redis,
        )  # fmt: skip
        return admitted, True
    keys, args = admit_call(
        request_id=request_id, tenant_id=tenant_id, key_id=key_id, limits=limits, prompt_tokens=prompt_tokens,
        max_tokens=max_tokens, implicit_max_tokens=implicit_max_tokens, choices=choices,
    )  # fmt: skip
    slot_args = _slot_args(tenant_id, request_id, weight, capacity, waiting=False)
    reply = quota_script("admit_and_take_slot")(
        keys=[*keys, pool_prefix(pool)], args=[len(keys), len(args), *args, *slot_args], client=redis
    )
    return admitted_from(reply[:3] if reply[0] == 1 else reply), reply[0] == 1 and reply[3] == 1


def _slot_keys(pool: str, request_id: str) -> list[str]:
    return [pool_prefix(pool), resv_key(request_id)]


def _slot_args(tenant_id: int, request_id: str, weight: int, capacity: int, waiting: bool) -> list:
    return [tenant_id, request_id, max(1, weight), capacity, HOLD_SECONDS, WAITER_FRESH_SECONDS, int(waiting)]


def _stop_waiting(redis, pool: str, tenant_id: int) -> None:
    if redis.hincrby(f"{pool_prefix(pool)}:waitn", tenant_id, -1) < 0:
        redis.hset(f"{pool_prefix(pool)}:waitn", tenant_id, 0)


def pool_capacity(pool: str, ready_workers: Mapping[str, int] | None = None) -> int:
    """Requests the pool's ready workers run at once: the slots each reports in its heartbeat (its
    Celery concurrency), FAIR_SHARE_SLOTS_PER_WORKER for one that reports none; 0 when fair share is off.
    `ready_workers`: what the caller already read (`catalog.readiness.ready_workers`, name → slots),
    else read now."""
    if not settings.FAIR_SHARE:
        return 0
    slots = _ready(pool) if ready_workers is None else ready_workers
    return sum(reported or settings.FAIR_SHARE_SLOTS_PER_WORKER for reported in slots.values())
