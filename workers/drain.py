"""preStop hook of a GPU worker: `python -m workers.drain` stops this pod taking new requests and
waits, bounded by DRAIN_TIMEOUT_SECONDS (default 570), until its in-flight streams have ended.

It marks the pod in `pool:<pool>:drain`, which the worker's heartbeat thread follows by cancelling
its queue consumer (workers/serving.py). Kubernetes sends SIGTERM when this returns, and Celery's
warm shutdown then finishes whatever is left. The mark stays: the pod is going away, and removing
it could let the worker resume consuming in the seconds before SIGTERM.
"""

import os
import sys
import time

import redis

from contract import protocol
from workers.podstate import pod_name, pod_worker, pool_name, redis_client

POLL_SECONDS = 1.0


def drain(client: redis.Redis, pool: str, pod: str, timeout: float) -> bool:
    """True once the pod's worker has no request in flight (or no longer heartbeats)."""
    client.sadd(protocol.pool_drain_key(pool), pod)
    deadline = time.monotonic() + timeout
    while True:
        worker = pod_worker(client, pool, pod)
        if worker is None or (worker.get("state") == "draining" and int(worker.get("in_flight", 0)) == 0):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_SECONDS)


def main() -> int:
    pool, pod = pool_name(), pod_name()
    timeout = float(os.environ.get("DRAIN_TIMEOUT_SECONDS", "570"))
    started = time.monotonic()
    try:
        drained = drain(redis_client(), pool, pod, timeout)
    except redis.RedisError as exc:
        # Nothing to coordinate through: Celery's warm shutdown on SIGTERM still finishes running tasks.
        print(f"drain: Redis unavailable ({exc}); relying on Celery's warm shutdown", file=sys.stderr)
        return 0
    elapsed = time.monotonic() - started
    print(f"drain: pod {pod} {'drained' if drained else 'still busy at the timeout'} after {elapsed:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
