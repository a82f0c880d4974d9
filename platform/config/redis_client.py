"""Redis clients: one blocking pool per process for sync code, one asyncio pool per event loop.

The sync client serves the threads (redis-py clients are thread-safe); the async one serves the
gateway's relay, which runs on the ASGI server's event loop. Both pools share the same options.
``scripts_in_one_round_trip`` runs several Lua scripts in one round trip (the gateway's admission).
"""

import asyncio
import functools
import weakref

import redis
import redis.asyncio
from django.conf import settings
from redis.commands.core import Script
from redis.exceptions import NoScriptError

from contract.env import env_int


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


def scripts_in_one_round_trip(calls: list[tuple[Script, list, list]], client: redis.Redis | None = None) -> list:
    """Run several Lua scripts, each given as (script, keys, args), in one round trip; their replies
    in order, or the first error.

    A pipeline of EVALSHAs. redis-py's own pipelined scripts would ask SCRIPT EXISTS first, a round
    trip of its own on every call; here a script Redis does not hold (after a restart or a flush)
    answers NOSCRIPT and is run again on its own, which loads it."""
    client = client or get_redis()
    pipe = client.pipeline(transaction=False)
    for script, keys, args in calls:
        pipe.evalsha(script.sha, len(keys), *keys, *args)
    replies = pipe.execute(raise_on_error=False)
    for i, ((script, keys, args), reply) in enumerate(zip(calls, replies, strict=True)):
        if isinstance(reply, NoScriptError):
            replies[i] = script(keys=keys, args=args, client=client)
        elif isinstance(reply, Exception):
            raise reply
    return replies

