"""Which workers serve a model pool right now, from their heartbeats in Redis (contract/protocol.py).

Read by admission (a pool's fair-share capacity, quotas/fairshare.py) and by the gateway's dispatch
(wait for a ready worker, detect a lost one), which re-exports these names.
"""

import functools
import time

from django.conf import settings
from redis.commands.core import Script

from config.redis_client import get_async_redis, get_redis
from contract import protocol


def heartbeat_cutoff() -> float:
    """Workers whose last heartbeat is older than this (unix seconds) count as gone."""
    return time.time() - settings.WORKER_HEARTBEAT_TIMEOUT


# The workers of a pool that heartbeat since ARGV[1], each with its state and reported slots, in one
# round trip (a request's admission reads them on the hot path). ARGV[2] is the prefix of the
# workers' hashes (contract/protocol.py `worker_key`).
_READY_SCRIPT = """
local rows = {}
for i, name in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], ARGV[1], '+inf')) do
  local fields = redis.call('HMGET', ARGV[2] .. name, 'state', 'slots')
  rows[i] = {name, fields[1], fields[2]}
end
return rows
"""


def _only_ready(rows: list[list]) -> dict[str, int]:
    """The ready workers among the script's rows (name, state, slots), each with its slots (0: none)."""
    return {name: int(slots or 0) for name, state, slots in rows if state == "ready"}


@functools.cache
def _ready_script():
    # Built once per process (its hash computed once): a request's admission calls it, on the
    # client get_redis() gives at the time.
    return get_redis().register_script(_READY_SCRIPT)


def _script_args(pool: str) -> dict:
    return {"keys": [protocol.pool_workers_key(pool)], "args": [heartbeat_cutoff(), protocol.worker_key("")]}


def ready_workers(pool: str) -> dict[str, int]:
    """The pool's workers that heartbeat recently and have a ready engine, each with its slots
    (its Celery concurrency, 0 if it reports none): one read serves dispatch and fair share."""
    return _only_ready(_ready_script()(**_script_args(pool), client=get_redis()))


def ready_workers_call(pool: str) -> tuple[Script, list, list]:
    """`ready_workers` as a script call (script, keys, args), to run beside others in one round
    trip (config/redis_client.py `scripts_in_one_round_trip`); `ready_workers_from` reads its reply."""
    args = _script_args(pool)
    return _ready_script(), args["keys"], args["args"]


def ready_workers_from(reply: list) -> dict[str, int]:
    """The reply of `ready_workers_call`, as `ready_workers` returns it."""
    return _only_ready(reply)


async def ready_workers_async(pool: str) -> dict[str, int]:
    """`ready_workers`, read on the event loop (the client is the loop's own)."""
    return _only_ready(await get_async_redis().register_script(_READY_SCRIPT)(**_script_args(pool)))


def worker_alive(name: str) -> bool:
    redis = get_redis()
    pool = redis.hget(protocol.worker_key(name), "pool")
    score = redis.zscore(protocol.pool_workers_key(pool), name) if pool else None
    return score is not None and score > heartbeat_cutoff()
