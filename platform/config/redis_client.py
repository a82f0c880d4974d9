"""Redis clients: one blocking pool per process for sync code, one asyncio pool per event loop.

The sync client serves the threads (redis-py clients are thread-safe); the async one serves the
gateway's relay, which runs on the ASGI server's event loop. Both pools share the same options.
"""

import asyncio
import functools
import weakref

import redis
import redis.asyncio
from django.conf import settings

from config.env import env_int

# Redis unreachable or not answering (a restart, a failover, a saturated server). redis.asyncio
# raises these same classes.
REDIS_UNAVAILABLE = (redis.ConnectionError, redis.TimeoutError)


def _pool_options() -> dict:
    return {
        "decode_responses": True,
        "health_check_interval": 30,  # a connection idle across a Redis restart is re-checked, not failed
        # Each open stream holds a connection for its blocking XREAD: the cap bounds the streams one
        # web process relays at once (the others wait up to `timeout` for a connection).
        "max_connections": env_int("REDIS_MAX_CONNECTIONS", 4096, minimum=8),
        # redis-py 8 reads with a 5 s socket timeout by default: as long as the gateway's blocking
        # XREAD (SSE_KEEPALIVE_SECONDS), so a stream waiting for its first token behind a busy pool
        # died with "Timeout reading from socket" whenever the reply came a moment late.
        "socket_timeout": max(30.0, settings.SSE_KEEPALIVE_SECONDS + 10),
        "timeout": 20,
    }


@functools.cache
def get_redis() -> redis.Redis:
    # A blocking pool: a thread that finds every connection busy waits for one instead of failing
    # (redis-py's default pool raises past its cap).
    pool = redis.BlockingConnectionPool.from_url(settings.REDIS_URL, **_pool_options())
    return redis.Redis(connection_pool=pool)


# asyncio connections belong to the loop that opened them: one client per loop (the ASGI server has
# one per process; tests may run several in turn). Weak keys: a closed loop's client goes with it.
_async_clients: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, redis.asyncio.Redis]" = (
    weakref.WeakKeyDictionary()
)


def get_async_redis() -> redis.asyncio.Redis:
    """The running event loop's Redis client (call from a coroutine)."""
    loop = asyncio.get_running_loop()
    client = _async_clients.get(loop)
    if client is None:
        pool = redis.asyncio.BlockingConnectionPool.from_url(settings.REDIS_URL, **_pool_options())
        client = _async_clients[loop] = redis.asyncio.Redis(connection_pool=pool)
    return client
