"""This pod's worker as the Redis heartbeat records it: shared by the probe and the preStop drain.

These run as separate short processes in the worker's container (Kubernetes exec probes and hooks),
so they read Redis directly and import neither Django nor vLLM: a probe must answer in a second.
"""

import os
import socket
import time

import redis

from contract import protocol
from contract.env import ConfigError, env_float, env_str

HEARTBEAT_FRESH_SECONDS = env_float("WORKER_HEARTBEAT_TIMEOUT", 10.0, minimum=0)


def pod_name() -> str:
    return os.environ.get("POD_NAME") or socket.gethostname()


def redis_client() -> redis.Redis:
    try:
        url = env_str("REDIS_URL")
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None
    return redis.Redis.from_url(url, decode_responses=True, socket_timeout=5, socket_connect_timeout=5)


def pod_worker(client: redis.Redis, pool: str, pod: str) -> dict | None:
    """The freshest heartbeat record of a worker of `pool` running in `pod`, or None."""
    fresh = protocol.fresh_workers(client, pool, since=time.time() - HEARTBEAT_FRESH_SECONDS)
    mine = [record for record in fresh.values() if record.get("pod") == pod]
    return max(mine, key=lambda r: float(r.get("updated", 0)), default=None)


def pool_name() -> str:
    pool = os.environ.get("WORKER_POOL")
    if not pool:
        raise SystemExit("WORKER_POOL must be set")
    return pool
