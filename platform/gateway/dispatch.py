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
- started: its worker given up for lost once no event came for WORKER_HEARTBEAT_TIMEOUT and the
  worker that wrote the start entry no longer heartbeats.
A request whose worker is lost (or that waits in the own queue of a lost worker) continues on another
ready worker of the pool (`_continue`: the prompt plus the tokens already sent, for the rest of
`max_tokens`), on the same event stream, up to MAX_CONTINUATIONS times; only then, or when no
worker is left, does it end as `worker_lost`.
Worker identities are unique per process start (contract/protocol.py), so a worker restarted under
the same node name does not keep its previous process's requests alive.
"""

import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field, replace

from django.conf import settings

from catalog.models import ServedModel
from catalog.readiness import heartbeat_cutoff as _heartbeat_cutoff
from catalog.readiness import ready_workers, ready_workers_async
from config.redis_client import get_async_redis, get_redis
from contract import protocol
from contract.outage import REDIS_UNAVAILABLE
from contract.protocol import RequestInput, Usage
from contract.task import task_message
from gateway import routing
from gateway.errors import ServiceUnavailable
from gateway.offload import run_blocking
from gateway.streams import stream_reader
from quotas.settlement import usage_buffer
from workers.celery_app import app as celery_app

log = logging.getLogger(__name__)


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
    token_ids: list[int] = field(default_factory=list)  # the completion's ids so far (n = 1), all attempts
    claim_seen_at: float | None = None  # when the relay first found the input claimed, no start yet
    continued: bool = False  # the attempt followed was given up and the request continues in another

    def next_attempt(self) -> None:
        """Follow the request's next attempt: nothing of it seen yet."""
        self.worker, self.claim_seen_at, self.continued = None, None, True
        self.last_event = time.monotonic()
        self.queue_deadline = self.last_event + settings.QUEUE_TIMEOUT_SECONDS

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
    """Store the request's input and its reader lease and send its Celery task to the queue the
    route step chose (`request.routed_to`, gateway/lifecycle.py), in one MULTI/EXEC: a worker never
    sees a task without its input, and the hot path pays one round trip."""
    queue = protocol.worker_queue_name(request.routed_to) if request.routed_to else model.queue
    attempt = protocol.attempt_id(request)
    message = task_message(celery_app, "workers.generate", task_id=attempt, args=[attempt], queue=queue)
    input_ttl = settings.QUEUE_TIMEOUT_SECONDS + INPUT_TTL_AFTER_QUEUE_DEADLINE_SECONDS
    pipe = get_redis().pipeline(transaction=True)
    pipe.set(protocol.input_key(attempt), request.dumps(), px=int(input_ttl * 1000))
    pipe.set(protocol.reader_key(request.request_id), 1, ex=int(protocol.READER_LEASE_SECONDS))
    pipe.lpush(queue, message)
    pipe.execute()


Event = Delta | Done | Failed | Idle


async def relay(request: RequestInput, model: ServedModel) -> AsyncIterator[list[Event]]:
    """Yield the request's events until Done or Failed, those of one read together (the SSE writer
    sends them in one write). The caller must call `abandon` if it stops early."""
    try:
        async with aclosing(_relay(request, model)) as batches:
            async for events in batches:
                yield events
    finally:
        await routing.release_async(request.request_id, request.routed_to)


async def _relay(request: RequestInput, model: ServedModel) -> AsyncIterator[list[Event]]:
    """The events of the request's attempts, one after the other (a continuation follows a lost one)."""
    progress = _Progress(queue_deadline=time.monotonic() + settings.QUEUE_TIMEOUT_SECONDS)
    lease = _ReaderLease(request.request_id)
    while True:
        progress.continued = False
        async with aclosing(_attempt_events(request, model, progress, lease)) as batches:
            async for events in batches:
                yield events
        if not progress.continued:
            return


async def _attempt_events(
    request: RequestInput, model: ServedModel, progress: _Progress, lease: "_ReaderLease"
) -> AsyncIterator[list[Event]]:
    key = protocol.events_key(protocol.attempt_id(request))
    async with aclosing(stream_reader().batches(key)) as batches:
        async for batch in batches:
            if batch is None:
                progress.quiet_through_outage()
                yield [Idle()]
                continue
            await lease.renew_if_due()
            if not batch:
                outcome = await _check_stalled(request, model, progress)
                if outcome is CONTINUED:
                    return
                yield [outcome or Idle()]
                if outcome is not None:
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
            if "k" in fields:
                progress.token_ids.extend(map(int, fields["k"].split(",")))
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


class _Continued:
    """The attempt followed was given up; the request goes on in its next attempt (`_continue`)."""


CONTINUED = _Continued()


async def _check_stalled(
    request: RequestInput, model: ServedModel, progress: _Progress
) -> Failed | _Continued | None:
    """After a quiet keep-alive interval: the request's end if it can no longer make progress, or
    CONTINUED when it goes on in another attempt."""
    if progress.worker is None:
        return await _check_unstarted(request, model, progress)
    quiet = time.monotonic() - progress.last_event
    if quiet >= settings.WORKER_HEARTBEAT_TIMEOUT and not await _worker_alive_async(progress.worker):
        message = "The worker serving this request was lost; the request was stopped."
        return await _lost(request, model, progress, message, worker=progress.worker, started=True)
    return None


async def _check_unstarted(
    request: RequestInput, model: ServedModel, progress: _Progress
) -> Failed | _Continued | None:
    """A request with no start entry yet: still queued, or claimed by a worker that has to start it."""
    now = time.monotonic()
    ready = await ready_workers_async(model.pool)
    if ready and await _routed_to_lost(request) and await _take_back_to_continue(request):
        # Waiting in the own queue of a worker that is gone: queued again, for another worker.
        message = "The worker this request was sent to was lost before taking it."
        return await _lost(request, model, progress, message, worker=request.routed_to, started=False)
    if now >= progress.queue_deadline or not ready or await _routed_to_lost(request):
        if await _take_back(request):
            return Failed("No worker took the request in time; try again later.", "no_worker_available")
    claimer, queued = await _claim_state(protocol.attempt_id(request))
    if queued:
        return None
    progress.claim_seen_at = progress.claim_seen_at or now
    # Waits out one heartbeat timeout after a Redis outage, as for a started request: the claimer
    # could not heartbeat during it.
    quiet = now - progress.last_event
    if claimer and quiet >= settings.WORKER_HEARTBEAT_TIMEOUT and not await _worker_alive_async(claimer):
        message = "The worker that took this request was lost before starting it."
        return await _lost(request, model, progress, message, worker=claimer, started=False)
    if now - progress.claim_seen_at >= settings.WORKER_START_TIMEOUT_SECONDS:
        # A live claimer that does not start the request (or a claim that recorded no claimer):
        # the cancel key stops it should it start after all.
        message = "The worker that took this request did not start it in time."
        return await _lost(request, model, progress, message, worker=claimer or "", started=False, continued=False)
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


async def _lost(
    request: RequestInput,
    model: ServedModel,
    progress: _Progress,
    message: str,
    *,
    worker: str,
    started: bool,
    continued: bool = True,
) -> Failed | _Continued:
    """The attempt's worker is lost: tell it, should it still run, to stop; continue the request on
    another worker of the pool (`_continue`; not for a live worker that does not start it, which
    would be routed the same way again), or end it as `worker_lost` and record its usage (unless
    its worker recorded it already)."""
    await get_async_redis().set(protocol.cancel_key(protocol.attempt_id(request)), 1, ex=protocol.REQUEST_TTL)
    if continued and await _continue(request, model, progress, lost=worker):
        return CONTINUED
    started = started or request.attempt > 0  # an earlier attempt prefilled the prompt
    usage = _usage_for(request, progress.seen_tokens, status="worker_lost", worker=worker, started=started)
    await run_blocking(usage_buffer, usage, only_if_absent=True)
    return Failed(message, "worker_lost", usage)


async def _continue(request: RequestInput, model: ServedModel, progress: _Progress, *, lost: str) -> bool:
    """Run the rest of the request as its next attempt on another ready worker of the pool: its
    prompt plus the tokens the client has already been sent, for the rest of `max_tokens`, on the
    same event stream. The continuing worker records the request's one ledger row (the prompt once,
    every completion token once) and settles its reservation, which stays held meanwhile. False
    when it cannot go on: n > 1, tool calls or a structured output (their parsers and grammars
    start from the completion's first token), ids missing for tokens seen, no tokens left, the
    bound on continuations (MAX_CONTINUATIONS) reached, or no ready worker left."""
    params = request.params
    generated = len(progress.token_ids) - request.continued_tokens  # by the attempt given up
    remaining = int(params.get("max_tokens") or 0) - generated
    if (
        request.attempt >= settings.MAX_CONTINUATIONS
        or int(params.get("n") or 1) != 1
        or request.tool_mode
        or "structured_outputs" in params
        or len(progress.token_ids) != progress.seen_tokens
        or remaining <= 0
    ):
        return False
    try:
        route = await run_blocking(routing.choose_worker, _next_attempt(request, progress, lost, remaining), model.pool)
    except ServiceUnavailable:
        return False
    if not route.worker and not await ready_workers_async(model.pool):
        return False  # no worker left ("": the pool's queue, under the `pool` policy, when one is)
    await routing.release_async(request.request_id, request.routed_to)
    _advance(request, progress, lost, remaining)
    request.routed_to = route.worker
    await run_blocking(enqueue, request, model)
    progress.next_attempt()
    log.info("request %s continues as %s on %s (%s lost)", request.request_id, protocol.attempt_id(request),
             route.worker, lost or "its claimer")  # fmt: skip
    return True


def _next_attempt(request: RequestInput, progress: _Progress, lost: str, remaining: int) -> RequestInput:
    """The request as its next attempt runs it (a copy: the route step sees the prompt it will run)."""
    attempt = replace(request, params=dict(request.params), images=list(request.images))
    _advance(attempt, progress, lost, remaining)
    return attempt


def _advance(request: RequestInput, progress: _Progress, lost: str, remaining: int) -> None:
    generated = len(progress.token_ids) - request.continued_tokens
    prompt = request.prompt_token_ids[: len(request.prompt_token_ids) - request.continued_tokens]
    request.prompt_token_ids = prompt + progress.token_ids
    request.continued_tokens = len(progress.token_ids)
    request.params = dict(request.params, max_tokens=remaining)
    if request.params.get("min_tokens"):
        request.params["min_tokens"] = max(0, int(request.params["min_tokens"]) - generated)
    request.earlier_workers = ",".join(filter(None, (request.earlier_workers, lost)))
    request.attempt += 1


async def _take_back(request: RequestInput) -> bool:
    """Take a request no worker has started back from the queue; True if it was still unclaimed.

    Workers claim a request by deleting its input, so exactly one side wins and records its usage.
    A continuation taken back is billed for what its earlier attempts generated.
    """
    if not await _take_back_to_continue(request):
        return False
    usage = _usage_for(request, request.continued_tokens, status="cancelled", worker=request.earlier_workers,
                       started=request.attempt > 0)  # fmt: skip
    await run_blocking(usage_buffer, usage, only_if_absent=True)
    return True


async def _take_back_to_continue(request: RequestInput) -> bool:
    """Take the attempt's input back from its queue, recording nothing; True if it was unclaimed."""
    return await get_async_redis().delete(protocol.input_key(protocol.attempt_id(request))) == 1


async def abandon(request: RequestInput) -> None:
    """The client went away: stop the request wherever it is; the worker bills what it generated."""
    if not await _take_back(request):
        await get_async_redis().set(protocol.cancel_key(protocol.attempt_id(request)), 1, ex=protocol.REQUEST_TTL)


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
