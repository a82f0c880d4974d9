"""This pod's worker as the Redis heartbeat records it: shared by the probe and the preStop drain.

These run as separate short processes in the worker's container (Kubernetes exec probes and hooks),
so they read Redis directly and import neither Django nor vLLM: a probe must answer in a second.
"""

import os
import socket
import time
from pathlib import Path

import redis

from workers import protocol

HEARTBEAT_FRESH_SECONDS = float(os.environ.get("WORKER_HEARTBEAT_TIMEOUT", "10"))


def pod_name() -> str:
    return os.environ.get("POD_NAME") or socket.gethostname()


def redis_client() -> redis.Redis:
    path = os.environ.get("REDIS_URL_FILE")
    url = Path(path).read_text().strip() if path else os.environ.get("REDIS_URL", "")
    if not url:
        raise SystemExit("REDIS_URL (or REDIS_URL_FILE) must be set")
    return redis.Redis.from_url(url, decode_responses=True, socket_timeout=5, socket_connect_timeout=5)


def pod_worker(client: redis.Redis, pool: str, pod: str) -> dict | None:
    """The freshest heartbeat record of a worker of `pool` running in `pod`, or None."""
    names = client.zrangebyscore(protocol.pool_workers_key(pool), time.time() - HEARTBEAT_FRESH_SECONDS, "+inf")
    records = [client.hgetall(protocol.worker_key(name)) for name in names]
    mine = [r for r in records if r.get("pod") == pod]
    return max(mine, key=lambda r: float(r.get("updated", 0)), default=None)


def pool_name() -> str:
    pool = os.environ.get("WORKER_POOL")
    if not pool:
        raise SystemExit("WORKER_POOL must be set")
    return pool
