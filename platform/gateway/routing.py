"""Which worker of a pool runs a request: the one place that decides (the `route` step).

`choose_worker` returns the identity of the worker whose own queue gets the request, or "" for the
pool's shared queue (whichever worker takes it first).
"""

from catalog.readiness import heartbeat_cutoff as _heartbeat_cutoff
from config.redis_client import get_redis
from gateway.errors import ServiceUnavailable
from workers import protocol
from workers.protocol import RequestInput


def choose_worker(request: RequestInput, pool: str) -> str:
    """The worker identity whose own queue gets ``request``; "" for the pool's queue."""
    return _adapter_holder(request, pool) or ""


def _adapter_holder(request: RequestInput, pool: str) -> str | None:
    """Where a request with an adapter goes: the own queue of a ready worker of the pool that holds
    it and has a free slot (the fewest requests in flight first), so no other engine loads it again;
    else the pool's queue when every live worker of the pool runs LoRA, or the own queue of the
    least busy ready worker that does when some do not (the pool's queue could hand it to an engine
    without LoRA, which refuses it). None: the pool's queue. From heartbeats, so up to a heartbeat
    late. Raises ServiceUnavailable (503 `adapters_unavailable`) when no ready worker of the pool
    runs LoRA: nothing is enqueued for an engine that would refuse it."""
    if not request.adapter_id:
        return None
    fresh = protocol.fresh_workers(get_redis(), pool, since=_heartbeat_cutoff())
    serving = {name: info for name, info in fresh.items() if protocol.runs_lora(info)}
    ready = {name: info for name, info in serving.items() if info.get("state") == "ready"}
    if not ready:
        raise ServiceUnavailable(
            f"No worker serving '{request.model.rpartition(':')[0]}' runs adapters right now; try again later.",
            code="adapters_unavailable",
            headers={"Retry-After": "5"},
        )
    adapter = str(request.adapter_id)
    free = {name: info for name, info in ready.items() if _in_flight(info) < int(info.get("slots") or 0)}
    holders = [(_in_flight(info), name) for name, info in free.items() if adapter in _held(info)]
    if holders:
        return min(holders)[1]
    if len(serving) == len(fresh):
        return None
    return min((_in_flight(info) - int(info.get("slots") or 0), name) for name, info in ready.items())[1]


def _in_flight(info: dict) -> int:
    return int(info.get("in_flight") or 0)


def _held(info: dict) -> list[str]:
    return (info.get("adapters") or "").split(",")
