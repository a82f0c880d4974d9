"""One Redis connection pool per process, shared by every thread (redis-py clients are thread-safe)."""

import functools

import redis
from django.conf import settings

from config.env import env_int

# Redis unreachable or not answering (a restart, a failover, a saturated server).
REDIS_UNAVAILABLE = (redis.ConnectionError, redis.TimeoutError)


@functools.cache
def get_redis() -> redis.Redis:
    # A blocking pool: a thread that finds every connection busy waits for one instead of failing
    # (redis-py's default pool raises past 100 connections, fewer than gunicorn's threads may need).
    pool = redis.BlockingConnectionPool.from_url(
        settings.REDIS_URL,
        decode_responses=True,
        health_check_interval=30,  # a connection idle across a Redis restart is re-checked, not failed
        max_connections=env_int("REDIS_MAX_CONNECTIONS", 512, minimum=8),
        # redis-py 8 reads with a 5 s socket timeout by default: as long as the gateway's blocking
        # XREAD (SSE_KEEPALIVE_SECONDS), so a stream waiting for its first token behind a busy pool
        # died with "Timeout reading from socket" whenever the reply came a moment late.
        socket_timeout=max(30.0, settings.SSE_KEEPALIVE_SECONDS + 10),
        timeout=20,
    )
    return redis.Redis(connection_pool=pool)
