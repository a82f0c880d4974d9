"""Dispatch to the worker pools and relay of their token events back to the gateway.

A request's life on this side: `enqueue` stores its input in Redis and sends a small Celery task to
the model pool's queue (sync, on a gateway thread); `relay` reads the request's event stream on the
event loop (`redis.asyncio`, no thread held while it waits) and yields Delta/Done/Failed events,
with bounded waits, so that every request ends:
- queued (its input still in Redis): taken back at QUEUE_TIMEOUT_SECONDS, or at once when its pool
  has no ready worker left (503 `no_worker_available`);
- claimed but not started (its input gone, no start entry): `worker_lost` as soon as the claimer
  recorded with the claim (`req:<rid>:claim`) no longer heartbeats, and at the latest
  WORKER_START_TIMEOUT_SECONDS after the gateway saw the claim;
- started: `worker_lost` once no event came for WORKER_HEARTBEAT_TIMEOUT and the worker that wrote
  the start entry no longer heartbeats.
Worker identities are unique per process start (workers/protocol.py), so a worker restarted under
the same node name does not keep its previous process's requests alive.
"""

import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from django.conf import settings

from catalog.models import ServedModel
from catalog.readiness import heartbeat_cutoff as _heartbeat_cutoff
from catalog.readiness import ready_workers, ready_workers_async
from config.redis_client import REDIS_UNAVAILABLE, get_async_redis, get_redis
from gateway import routing
from gateway.errors import ServiceUnavailable
from gateway.offload import run_blocking
from gateway.streams import stream_reader
from quotas.settlement import usage_buffer as ledger_pending_put
from quotas.settlement import usage_record_now, usage_record_soon
from workers import protocol
from workers.broker import task_message
from workers.celery_app import app as celery_app
from workers.protocol import RequestInput, Usage


@dataclass
class Delta:
    text: str
    tokens: int
    index: int = 0  # the choice (n > 1)
    logprobs: list | None = None  # [[token, logprob, [[token, logprob], ...]], ...] when asked for


@dataclass
class Done:
    usage: Usage
    # Per choice {"finish_reason", "tool_calls"?} when n > 1 or tool calls were parsed; else None.
    choices: list[dict] | None = None


@dataclass
class Failed:
    message: str
    code: str
    usage: Usage | None = None


class Idle:
    """Nothing happened for a keep-alive interval (lets the SSE writer probe the client)."""


@dataclass
class _Progress:
    """What the relay knows of its request, for the stall checks (monotonic times)."""

    queue_deadline: float
    last_event: float = field(default_factory=time.monotonic)
    worker: str | None = None  # the identity in the start entry
    seen_tokens: int = 0
    claim_seen_at: float | None = None  # when the relay first found the input claimed, no start yet

    def quiet_through_outage(self) -> None:
        """Redis was unreachable, so no heartbeat or start could arrive either: time the stall
        checks from its end."""
        self.last_event = time.monotonic()
        if self.claim_seen_at is not None:
            self.claim_seen_at = self.last_event


def await_worker(model: ServedModel) -> dict[str, int]:
    """The pool's ready workers (name → slots), once there is one; waits (bounded) on a pool
    scaling from zero."""
    ready = ready_workers(model.pool)
    if ready:
        return ready
    if model.cold_start_wait_seconds:
        redis = get_redis()
        waiting = protocol.pool_waiting_key(model.pool)
        redis.incr(waiting)  # the operator scales a pool from zero when requests wait for it
        try:
            deadline = time.monotonic() + model.cold_start_wait_seconds
            while time.monotonic() < deadline:
                time.sleep(0.5)
                ready = ready_workers(model.pool)
                if ready:
                    return ready
        finally:
            redis.decr(waiting)
    raise ServiceUnavailable(
        f"No worker is serving the model '{model.model_id}' right now; try again later.",
        code="no_worker_available",
        headers={"Retry-After": "5"},
    )


# How long a request's input outlives its queue deadline. A live gateway takes its request back at
# the deadline (`_take_back`); an input still there this much later belongs to a gateway that died,
# and its expiry makes a worker that takes the task late find nothing to run (the claim finds no
# input). This is the task's expiry: Celery's own (`expires`) costs the worker's consumer thread,
# which takes a wave of tasks one after the other, a configuration lookup and a date parse per
# message (~40 µs).
INPUT_TTL_AFTER_QUEUE_DEADLINE_SECONDS = 60


def enqueue(request: RequestInput, model: ServedModel) -> None:
    """Store the request's input and its reader lease and send its Celery task, in one MULTI/EXEC:
    a worker never sees a task without its input, and the hot path pays one round trip."""
    request.routed_to = routing.choose_worker(request, model.pool)
    queue = protocol.worker_queue_name(request.routed_to) if request.routed_to else model.queue
    message = task_message(
        celery_app, "workers.generate", task_id=request.request_id, args=[request.request_id], queue=queue
    )
    input_ttl = settings.QUEUE_TIMEOUT_SECONDS + INPUT_TTL_AFTER_QUEUE_DEADLINE_SECONDS
    pipe = get_redis().pipeline(transaction=True)
    pipe.set(protocol.input_key(request.request_id), request.dumps(), px=int(input_ttl * 1000))
    pipe.set(protocol.reader_key(request.request_id), 1, ex=int(protocol.READER_LEASE_SECONDS))
    pipe.lpush(queue, message)
    pipe.execute()


Event = Delta | Done | Failed | Idle


async def relay(request: RequestInput, model: ServedModel) -> AsyncIterator[list[Event]]:
    """Yield the request's events until Done or Failed, those of one read together (the SSE writer
    sends them in one write). The caller must call `abandon` if it stops early."""
    key = protocol.events_key(request.request_id)
    progress = _Progress(queue_deadline=time.monotonic() + settings.QUEUE_TIMEOUT_SECONDS)
    lease = _ReaderLease(request.request_id)
    async with aclosing(stream_reader().batches(key)) as batches:
        async for batch in batches:
            if batch is None:
                progress.quiet_through_outage()
                yield [Idle()]
                continue
            await lease.renew_if_due()
            if not batch:
                failure = await _check_stalled(request, model, progress)
                yield [failure or Idle()]
                if failure is not None:
                    return
                continue
            progress.last_event = time.monotonic()
            events, last = await _events(key, batch, progress)
            if events:
                yield events
            if last:
                return


async def _events(key: str, batch: list, progress: _Progress) -> tuple[list[Event], bool]:
    """The events of one read's stream entries, and whether they hold the request's last one."""
    events: list[Event] = []
    for entry_id, fields in batch:
        kind = fields["t"]
        if kind == "delta":
            tokens = int(fields["n"])
            progress.seen_tokens += tokens
            logprobs = json.loads(fields["l"]) if "l" in fields else None
            events.append(Delta(fields["x"], tokens, int(fields.get("i", 0)), logprobs))
        elif kind == "start":
            progress.worker = fields["w"]
        elif kind == "done":
            events.append(Done(Usage.loads(fields["u"]), json.loads(fields["c"]) if "c" in fields else None))
            return events, True
        elif kind == "error":
            # The worker also writes a done event with the usage; wait for it (bounded).
            events.append(Failed(fields["m"], fields["c"], await _final_usage(key, entry_id)))
            return events, True
    return events, False


class _ReaderLease:
    """This process's lease on a request it relays (protocol.READER_LEASE_SECONDS), renewed at a
    quarter of its length: the stream's reads come at least every SSE_KEEPALIVE_SECONDS."""

    def __init__(self, request_id: str) -> None:
        self.key = protocol.reader_key(request_id)
        self.renewed = time.monotonic()  # set at enqueue

    async def renew_if_due(self) -> None:
        if time.monotonic() - self.renewed < protocol.READER_LEASE_SECONDS / 4:
            return
        try:
            await get_async_redis().set(self.key, 1, ex=int(protocol.READER_LEASE_SECONDS))
        except REDIS_UNAVAILABLE:
            return  # entries read before an outage are relayed during it: renewed with the next ones
        self.renewed = time.monotonic()


async def _final_usage(key: str, after_id: str) -> Usage | None:
    reply = await get_async_redis().xread({key: after_id}, block=2000, count=16)
    for _, fields in reply[0][1] if reply else []:
        if fields["t"] == "done":
            return Usage.loads(fields["u"])
    return None


async def _worker_alive_async(name: str) -> bool:
    """`worker_alive`, read on the event loop."""
    redis = get_async_redis()
    pool = await redis.hget(protocol.worker_key(name), "pool")
    score = await redis.zscore(protocol.pool_workers_key(pool), name) if pool else None
    return score is not None and score > _heartbeat_cutoff()


async def _check_stalled(request: RequestInput, model: ServedModel, progress: _Progress) -> Failed | None:
    """After a quiet keep-alive interval: the request's end if it can no longer make progress."""
    if progress.worker is None:
        return await _check_unstarted(request, model, progress)
    quiet = time.monotonic() - progress.last_event
    if quiet >= settings.WORKER_HEARTBEAT_TIMEOUT and not await _worker_alive_async(progress.worker):
        message = "The worker serving this request was lost; the request was stopped."
        return await _lost(request, message, worker=progress.worker, started=True, relayed_tokens=progress.seen_tokens)
    return None


async def _check_unstarted(request: RequestInput, model: ServedModel, progress: _Progress) -> Failed | None:
    """A request with no start entry yet: still queued, or claimed by a worker that has to start it."""
    now = time.monotonic()
    if now >= progress.queue_deadline or not await ready_workers_async(model.pool) or await _routed_to_lost(request):
        if await _take_back(request):
            return Failed("No worker took the request in time; try again later.", "no_worker_available")
    claimer, queued = await _claim_state(request.request_id)
    if queued:
        return None
    progress.claim_seen_at = progress.claim_seen_at or now
    # Waits out one heartbeat timeout after a Redis outage, as for a started request: the claimer
    # could not heartbeat during it.
    quiet = now - progress.last_event
    if claimer and quiet >= settings.WORKER_HEARTBEAT_TIMEOUT and not await _worker_alive_async(claimer):
        message = "The worker that took this request was lost before starting it."
        return await _lost(request, message, worker=claimer, started=False)
    if now - progress.claim_seen_at >= settings.WORKER_START_TIMEOUT_SECONDS:
        # A live claimer that does not start the request (or a claim that recorded no claimer):
        # the cancel key stops it should it start after all.
        message = "The worker that took this request did not start it in time."
        return await _lost(request, message, worker=claimer or "", started=False)
    return None


async def _routed_to_lost(request: RequestInput) -> bool:
    """The request waits in the own queue of a worker that is gone (only that worker consumes it)."""
    return bool(request.routed_to) and not await _worker_alive_async(request.routed_to)


async def _claim_state(request_id: str) -> tuple[str | None, bool]:
    """(the recorded claimer, whether the input is still queued), read together: the worker's claim
    takes the input and records the claimer in one script (workers/claims.py)."""
    pipe = get_async_redis().pipeline(transaction=True)
    pipe.get(protocol.claim_key(request_id))
    pipe.exists(protocol.input_key(request_id))
    claimer, queued = await pipe.execute()
    return claimer, bool(queued)


async def _lost(request: RequestInput, message: str, *, worker: str, started: bool, relayed_tokens: int = 0) -> Failed:
    """End the request as `worker_lost`: record its usage (unless its worker recorded it already)
    and tell the worker, should it still run, to stop it."""
    usage = _usage_for(request, relayed_tokens, status="worker_lost", worker=worker, started=started)
    await run_blocking(ledger_pending_put, usage, only_if_absent=True)
    await get_async_redis().set(protocol.cancel_key(request.request_id), 1, ex=protocol.REQUEST_TTL)
    return Failed(message, "worker_lost", usage)


async def _take_back(request: RequestInput) -> bool:
    """Take a request no worker has started back from the queue; True if it was still unclaimed.

    Workers claim a request by deleting its input, so exactly one side wins and records its usage.
    """
    if await get_async_redis().delete(protocol.input_key(request.request_id)) == 0:
        return False
    usage = _usage_for(request, 0, status="cancelled", worker="", started=False)
    await run_blocking(ledger_pending_put, usage, only_if_absent=True)
    return True


async def abandon(request: RequestInput) -> None:
    """The client went away: stop the request wherever it is; the worker bills what it generated."""
    if not await _take_back(request):
        await get_async_redis().set(protocol.cancel_key(request.request_id), 1, ex=protocol.REQUEST_TTL)


def _usage_for(request: RequestInput, completion_tokens: int, *, status: str, worker: str, started: bool) -> Usage:
    now = time.time()
    return Usage(
        request_id=request.request_id,
        tenant_id=request.tenant_id,
        key_id=request.key_id,
        model=request.model,
        # A request no worker started was never prefilled: nothing to bill.
        prompt_tokens=request.prompt_tokens if started else 0,
        completion_tokens=completion_tokens,
        total_ms=max(0, int((now - request.enqueued_at) * 1000)),
        finish_reason="abort",
        status=status,
        worker=worker,
        finished_at=now,
    )


async def record(request_id: str) -> None:
    """Fast path into the ledger right after a request ends (the periodic flush is the safety net).
    Its worker settled its quota in the write that carried its end; its row follows with this
    process's next batch, or, with batching off (LEDGER_BATCH_SECONDS=0), now, on a gateway thread
    (an INSERT)."""
    if settings.LEDGER_BATCH_SECONDS:
        usage_record_soon(request_id)
    else:
        await run_blocking(usage_record_now, request_id)
