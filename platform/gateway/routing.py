"""Which worker of a pool runs a request: the one place that decides (the `route` step).

`choose_worker` sends a request to the own queue of one ready worker of its pool. The decision reads
what the platform knows of each worker, in one Redis script (one round trip, atomic with the
bookkeeping that follows it):

- **Filters.** Only workers that heartbeat within WORKER_HEARTBEAT_TIMEOUT and report `ready` are
  candidates (a draining, starting, failed or stale worker gets nothing). A request for a tenant's
  LoRA adapter goes only to workers whose engine runs adapters.
- **Prefix-cache overlap.** The prompt's token ids are cut into chunks of ROUTING_CHUNK_TOKENS and
  hashed as a chain (each chunk's hash covers every token before it), seeded with the tenant's
  cache salt and the adapter: two tenants never share a chunk, as their engines' blocks are never
  shared either (the per-tenant `cache_salt`). Each worker has an index of the chunks last routed to
  it (`route:idx:<worker>`, a sorted set chunk → last use), capped at what its engine's KV cache holds
  (the `kv_tokens` its heartbeat reports, else ROUTING_INDEX_CHUNKS): the oldest chunks go first, as
  the engine's own prefix cache evicts the least recently used blocks. The overlap with a worker is
  the longest indexed prefix of the prompt's chain (a binary search: a chain's chunks are indexed and
  touched together, so an indexed chunk implies its prefix).
- **Load.** Each worker's open requests (`route:open:<worker>`: request → the tokens it brings, and
  their sum under the field `=`) are kept by the gateway: added here, removed by `release` when the
  gateway stops following the request (its end, a failure, a client gone). The load is the sum of
  the tokens its open requests bring to the engine (prompt tokens not found in its cache plus
  `max_tokens`): the same unit as the prefill a cache hit saves.
- **Adapters.** A worker that already holds the request's adapter saves loading it:
  ROUTING_ADAPTER_LOAD_TOKENS of cost, the same unit again.

cost(worker) = ROUTING_PREFILL_WEIGHT x prompt tokens not cached there + ROUTING_LOAD_WEIGHT x its
load - (ROUTING_ADAPTER_LOAD_TOKENS if it holds the adapter); the lowest cost wins, ties to the
worker with fewer open requests. With no index data the prefill term is equal everywhere and the
decision is the least-loaded worker (NVIDIA Dynamo's KV router uses the same shape of cost;
affinity without the load term is slower than random once one worker's queue grows).

ROUTING_POLICY picks the decision: `cache_aware` (the above, default), `least_loaded` (the load term
only), `round_robin` (the candidates in turn), `pool` (the pool's shared queue: whichever worker takes
the task first, with adapter requests still sent to a holder). The last three exist to measure
against (benchmarks/fleet.py).

Memory: a chunk costs its index about 120 bytes of Redis (a 16-character member and its score in a
sorted set; MEMORY USAGE, `python -m benchmarks.routing_cost`), so the default cap of 65,536 chunks
is about 8 MiB a worker. Indexes of workers that stopped heartbeating expire
(ROUTE_INDEX_TTL_SECONDS after their last write) and are deleted sooner by `routing_reap`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import time
from array import array
from dataclasses import dataclass

from django.conf import settings

from catalog.readiness import heartbeat_cutoff
from config.redis_client import get_async_redis, get_redis
from contract import protocol
from contract.outage import REDIS_UNAVAILABLE
from contract.protocol import RequestInput
from gateway.errors import ServiceUnavailable

ROUTE_INDEX_TTL_SECONDS = 3600
# An open request the gateway never released (its web process died) stops counting as load after this.
OPEN_REQUEST_MAX_SECONDS = 3600


def index_key(worker: str) -> str:
    return f"route:idx:{worker}"


def open_key(worker: str) -> str:
    return f"route:open:{worker}"


def turn_key(pool: str) -> str:
    return f"route:turn:{pool}"


@dataclass(frozen=True)
class Route:
    """A decision: the worker whose own queue gets the request ("" for the pool's queue) and the
    prompt tokens its index expects the engine to have cached."""

    worker: str
    cached_tokens: int = 0


def prompt_chunks(request: RequestInput, chunk_tokens: int | None = None) -> list[str]:
    """The chained hashes of the prompt's full chunks (hex, 8 bytes each), seeded with the tenant's
    cache salt and the adapter: equal prompts of one tenant and adapter give equal chains."""
    ids = array("q", request.prompt_token_ids).tobytes()  # the whole prompt converted once
    width = 8 * (chunk_tokens or settings.ROUTING_CHUNK_TOKENS)
    digest = f"{request.cache_salt}|{request.adapter_id}".encode()
    chunks = []
    for start in range(0, len(ids) - len(ids) % width, width):
        digest = hashlib.blake2b(digest + ids[start : start + width], digest_size=8).digest()
        chunks.append(digest.hex())
    return chunks


def choose_worker(request: RequestInput, pool: str) -> Route:
    """Decide which worker runs ``request`` and record the decision (its chunks in that worker's
    index, the request among its open ones). Raises ServiceUnavailable (503) when no ready worker
    of the pool can run it (an adapter request where no worker runs adapters)."""
    policy = settings.ROUTING_POLICY
    if policy == "pool" and not request.adapter_id:
        return Route("")
    chunks = prompt_chunks(request) if policy == "cache_aware" else []
    reply = _decide_script()(
        keys=[protocol.pool_workers_key(pool), turn_key(pool)],
        args=_decide_args(request, policy, chunks),
        client=get_redis(),
    )
    worker, cached_chunks = reply[0], int(reply[1])
    if worker == "":
        if request.adapter_id:
            raise ServiceUnavailable(
                f"No worker serving '{request.model.rpartition(':')[0]}' runs adapters right now; try again later.",
                code="adapters_unavailable",
                headers={"Retry-After": "5"},
            )
        return Route("")  # no ready worker right now: the pool's queue (the relay's checks take over)
    return Route(worker, cached_chunks * settings.ROUTING_CHUNK_TOKENS)


def _decide_args(request: RequestInput, policy: str, chunks: list[str]) -> list:
    max_tokens = int(request.params.get("max_tokens") or 0) * max(1, int(request.params.get("n") or 1))
    return [
        heartbeat_cutoff(),
        protocol.worker_key(""),
        index_key(""),
        open_key(""),
        policy,
        request.request_id,
        request.prompt_tokens,
        max_tokens,
        str(request.adapter_id or ""),
        settings.ROUTING_CHUNK_TOKENS,
        settings.ROUTING_INDEX_CHUNKS,
        settings.ROUTING_PREFILL_WEIGHT,
        settings.ROUTING_LOAD_WEIGHT,
        settings.ROUTING_ADAPTER_LOAD_TOKENS,
        time.time(),
        ROUTE_INDEX_TTL_SECONDS,
        *chunks,
    ]


def release(request_id: str, worker: str) -> None:
    """The gateway no longer follows the request on ``worker``: it stops counting in its load.
    Through a Redis outage the entry stays until `routing_reap`."""
    if worker:
        with contextlib.suppress(*REDIS_UNAVAILABLE):
            get_redis().eval(_RELEASE_SCRIPT, 1, open_key(worker), request_id)


async def release_async(request_id: str, worker: str) -> None:
    """`release`, on the event loop. Through a Redis outage the entry stays until `routing_reap`."""
    if worker:
        with contextlib.suppress(*REDIS_UNAVAILABLE):
            await get_async_redis().eval(_RELEASE_SCRIPT, 1, open_key(worker), request_id)


def routing_reap(*, now: float | None = None) -> int:
    """Drop what the routing keeps for workers that no longer heartbeat (their index and open
    requests) and open requests older than OPEN_REQUEST_MAX_SECONDS (their gateway died before
    releasing them). Run every minute by beat; returns the entries removed."""
    redis = get_redis()
    now = now or time.time()
    removed = 0
    for pool_key in redis.scan_iter(match=protocol.pool_workers_key("*"), count=100):
        for worker, seen in redis.zrange(pool_key, 0, -1, withscores=True):
            if seen < heartbeat_cutoff():
                removed += redis.delete(index_key(worker), open_key(worker))
                continue
            removed += _reap_open(redis, worker, now - OPEN_REQUEST_MAX_SECONDS)
    return removed


def _reap_open(redis, worker: str, before: float) -> int:
    entries = redis.hgetall(open_key(worker)).items()
    stale = [rid for rid, value in entries if rid != LOAD_FIELD and float(value.split(":")[1]) < before]
    return sum(redis.eval(_RELEASE_SCRIPT, 1, open_key(worker), rid) for rid in stale)


# The field of a worker's open requests that holds their tokens' sum (request ids never equal it).
LOAD_FIELD = "="

# KEYS[1] a worker's open requests, ARGV[1] a request id: removed, its tokens out of the sum.
_RELEASE_SCRIPT = """
local value = redis.call('HGET', KEYS[1], ARGV[1])
if not value then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HINCRBY', KEYS[1], '=', -tonumber(string.match(value, '^(%d+)')))
return 1
"""


# KEYS[1] the pool's heartbeat set, KEYS[2] the pool's round-robin counter.
# ARGV: 1 heartbeat cutoff, 2-4 key prefixes (worker record, index, open requests), 5 policy,
# 6 request id, 7 prompt tokens, 8 max tokens, 9 adapter id ("" none), 10 chunk tokens,
# 11 default index cap (chunks), 12 prefill weight, 13 load weight, 14 adapter load tokens, 15 now,
# 16 index TTL, 17.. the prompt's chunk hashes.
# Returns {worker or "", cached chunks}.
_DECIDE_SCRIPT = """
local policy, rid, adapter = ARGV[5], ARGV[6], ARGV[9]
local prompt_tokens, max_tokens = tonumber(ARGV[7]), tonumber(ARGV[8])
local chunk_tokens, default_cap = tonumber(ARGV[10]), tonumber(ARGV[11])
local w_prefill, w_load, adapter_tokens = tonumber(ARGV[12]), tonumber(ARGV[13]), tonumber(ARGV[14])
local now, ttl = ARGV[15], tonumber(ARGV[16])
local nchunks = #ARGV - 16

local function holds(list, item)
  for id in string.gmatch(list or '', '[^,]+') do if id == item then return true end end
  return false
end

local function overlap(idx)
  -- the longest indexed prefix of the chain, by binary search
  local lo, hi = 0, nchunks
  while lo < hi do
    local mid = math.floor((lo + hi + 1) / 2)
    if redis.call('ZSCORE', idx, ARGV[16 + mid]) then lo = mid else hi = mid - 1 end
  end
  return lo
end

local function load(open)
  local tokens = tonumber(redis.call('HGET', open, '=') or '0')
  return tokens, math.max(0, redis.call('HLEN', open) - 1)
end

local candidates = {}
for _, name in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], ARGV[1], '+inf')) do
  local f = redis.call('HMGET', ARGV[2] .. name, 'state', 'lora', 'adapters', 'kv_tokens')
  if f[1] == 'ready' and (adapter == '' or f[2] == '1') then
    candidates[#candidates + 1] = {name = name, holds = adapter ~= '' and holds(f[3], adapter),
                                   kv_tokens = tonumber(f[4] or '0') or 0}
  end
end
if #candidates == 0 then return {'', 0} end
table.sort(candidates, function(a, b) return a.name < b.name end)

local best, best_cost, best_count, best_hit = nil, nil, nil, 0
if policy == 'round_robin' then
  best = candidates[(redis.call('INCR', KEYS[2]) % #candidates) + 1]
else
  for _, c in ipairs(candidates) do
    local hit = 0
    if policy == 'cache_aware' and nchunks > 0 then hit = overlap(ARGV[3] .. c.name) end
    local tokens, count = load(ARGV[4] .. c.name)
    local cost = w_load * tokens
    if policy == 'cache_aware' then
      cost = cost + w_prefill * math.max(0, prompt_tokens - hit * chunk_tokens)
      if c.holds then cost = cost - adapter_tokens end
    elseif policy == 'pool' then
      -- an adapter request under the pool policy: a holder first, then the least loaded
      if c.holds then cost = cost - 1e15 end
    end
    if best == nil or cost < best_cost or (cost == best_cost and count < best_count) then
      best, best_cost, best_count, best_hit = c, cost, count, hit
    end
  end
end

local brings = math.max(0, prompt_tokens - best_hit * chunk_tokens) + max_tokens
redis.call('HSET', ARGV[4] .. best.name, rid, brings .. ':' .. now)
redis.call('HINCRBY', ARGV[4] .. best.name, '=', brings)
redis.call('EXPIRE', ARGV[4] .. best.name, ttl)
if nchunks > 0 then
  local idx = ARGV[3] .. best.name
  for i = 17, #ARGV, 512 do
    local args = {}
    for j = i, math.min(i + 511, #ARGV) do
      args[#args + 1] = now
      args[#args + 1] = ARGV[j]
    end
    redis.call('ZADD', idx, unpack(args))
  end
  local cap = default_cap
  if best.kv_tokens > 0 then cap = math.floor(best.kv_tokens / chunk_tokens) end
  local excess = redis.call('ZCARD', idx) - cap
  if excess > 0 then redis.call('ZREMRANGEBYRANK', idx, 0, excess - 1) end
  redis.call('EXPIRE', idx, ttl)
end
return {best.name, best_hit}
"""


@functools.cache
def _decide_script():
    return get_redis().register_script(_DECIDE_SCRIPT)
