"""Kubernetes probe of a GPU worker: `python -m workers.probe` exits 0 when this pod's engine serves.

Ready means a fresh heartbeat from this pod's worker with its engine `ready` (or `draining`: a pod
finishing its streams before it stops is still healthy). Exit 1 otherwise, with the reason on stderr.
"""

import sys

import redis

from workers.podstate import pod_name, pod_worker, pool_name, redis_client

HEALTHY_STATES = {"ready", "draining"}


def main() -> int:
    pool, pod = pool_name(), pod_name()
    try:
        worker = pod_worker(redis_client(), pool, pod)
    except redis.RedisError as exc:
        print(f"probe: Redis unavailable: {exc}", file=sys.stderr)
        return 1
    if worker is None:
        print(f"probe: no fresh heartbeat from a worker of pool {pool!r} in pod {pod!r}", file=sys.stderr)
        return 1
    if worker.get("state") not in HEALTHY_STATES:
        print(f"probe: the engine is {worker.get('state')!r}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
