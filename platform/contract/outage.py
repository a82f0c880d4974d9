"""Redis outages, as both sides meet them: which errors mean Redis is unreachable, and
``through_outage``, which retries an asyncio call until it is back (the worker's claims and relay)."""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis

# Redis unreachable or not answering (a restart, a failover, a saturated server). redis.asyncio
# raises these same classes.
REDIS_UNAVAILABLE = (redis.ConnectionError, redis.TimeoutError)
# The first and the longest pause between two tries of `through_outage` (doubling in between).
OUTAGE_BACKOFF_SECONDS = (0.05, 2.0)

log = logging.getLogger(__name__)
T = TypeVar("T")


async def through_outage(call: Callable[[], Awaitable[T]], *, seconds: float, what: str) -> T:
    """``await call()``, retried with backoff while Redis is unreachable, for at most ``seconds``
    (then its error is raised).

    redis-py retries a command on a connection it already has, but not a failure to get one (a
    server that is restarting resets new connections). ``call`` must be safe to repeat: its effect
    may have reached Redis before the reply was lost.
    """
    deadline = time.monotonic() + seconds
    pause, longest = OUTAGE_BACKOFF_SECONDS
    while True:
        try:
            return await call()
        except REDIS_UNAVAILABLE:
            if time.monotonic() + pause > deadline:
                raise
            log.warning("Redis unreachable while %s; retrying in %.2fs", what, pause)
            await asyncio.sleep(pause)
            pause = min(pause * 2, longest)
