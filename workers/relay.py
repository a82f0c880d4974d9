"""The worker's relay of every request in flight into Redis, run on the engine's event loop.

Each request's outputs arrive on the engine's event loop (``EngineHost.submit`` feeds a
``RelayedRequest``, which only appends to its buffer). One flusher coroutine turns what all the
requests produced since its last pass into a single pipelined MULTI/EXEC: the start, delta, error
and done entries of every request it touched, the done entries' usage in ``ledger:pending`` and the
settle of their quota reservations (contract/settle.py). So the relay's cost is one Redis round trip
per flush, whatever the number of requests, and no thread wakes up per request or per token: the
Celery task that handed a request over holds its slot, but no thread, until the done entry is
written (workers/requestpool.py; it stays the unit of dispatch, acknowledgement and drain).

Coalescing: a request's first text and its end are written at once (with nothing else), the rest
at most once per interval, for all requests together. The interval grows with the requests in
flight so that the events of all of them stay within ``WORKER_FLUSH_EVENTS_PER_SECOND`` (each event
costs the gateway a read, an SSE frame and a socket write), between ``WORKER_FLUSH_INTERVAL_MS`` and
``FLUSH_INTERVAL_CAP_SECONDS``.

Cancellation: one ``MGET`` of the cancel keys and the gateways' reader leases of all running
requests per ``CANCEL_CHECK_SECONDS``; a request whose client left (cancel key) or whose gateway's
lease lapsed (the web process relaying it died) has its engine task cancelled (vLLM aborts it) and
is billed for what it generated. Redis outages: a flush is retried as it was built (entries are numbered by the worker,
so a write whose reply was lost is refused as a duplicate, never doubled), while the engine goes on
and the next flush carries everything generated meanwhile.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import time

import redis
import redis.asyncio
from redis.exceptions import NoScriptError

from contract import protocol
from contract.outage import REDIS_UNAVAILABLE, through_outage
from contract.protocol import RequestInput, Usage
from contract.settle import settle_pending_call
from workers.adapters import AdapterResolver
from workers.choices import Choice, compact_logprobs
from workers.claims import ClaimBatcher
from workers.engine import EngineHost, RequestRejected
from workers.images import decode_images

log = logging.getLogger(__name__)

CANCEL_CHECK_SECONDS = 0.25
# However many requests are in flight, a stream still gets an event at least this often.
FLUSH_INTERVAL_CAP_SECONDS = 0.25
# How long a flush is retried through a Redis outage (a restart, a failover) before its usage
# entries are logged for an operator to replay and its requests are let go.
USAGE_RETRY_SECONDS = 600.0

Entry = tuple[str, dict]


class RelayedRequest:
    """One request's output not yet written to Redis, and its usage; an ``OutputSink``.

    Lives on the engine's event loop: ``push``/``end`` come from the engine, ``take_entries`` from
    the flusher. Entries are numbered 1-0, 2-0, ... in the order they are taken.
    """

    def __init__(self, request: RequestInput, usage: Usage, relay: EventRelay) -> None:
        self.request, self.usage, self.relay = request, usage, relay
        self.rid = request.request_id  # the request's: its usage, ledger row and reader lease
        self.aid = protocol.attempt_id(request)  # this attempt's: its events, cancel key, engine request
        self.abandoned = False  # OutputSink: the relay never stops reading a request itself
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()
        self.engine_request: concurrent.futures.Future | None = None
        self.submitted_at = time.monotonic()
        self.first_token_at: float | None = None
        self.n = int(request.params.get("n") or 1)
        self.top_logprobs = request.params.get("logprobs")
        self.choices = [Choice(i, holding=request.tool_mode in ("required", "named")) for i in range(self.n)]
        self.start_pending = True
        self.text_sent = False
        self.finished = False
        self.end_written = False  # its done entry is taken: nothing follows it
        self.error: BaseException | None = None
        self.entry_count = 0
        self.reader_seen = False  # its gateway's lease was seen: a lapse then means no one reads it
        # The new token ids of its one choice not yet written, which a continuation would append to
        # its prompt should this worker be lost (None for n > 1: such a request is not continued).
        self.token_ids: list[int] | None = [] if self.n == 1 else None

    # -- from the engine ------------------------------------------------------------------
    def prefilled(self, prompt_tokens: int, cached_tokens: int = 0) -> None:
        # A continuation's prompt holds the earlier attempts' completion tokens, billed as completion.
        self.usage.prompt_tokens = max(0, prompt_tokens - self.request.continued_tokens)
        self.usage.cached_tokens = min(cached_tokens, self.usage.prompt_tokens)

    def push(
        self, text: str, token_ids: list[int], finished: bool, finish_reason: str | None, index: int = 0,
        logprobs: list | None = None,
    ) -> None:  # fmt: skip
        if self.finished:
            return
        choice = self.choices[index]
        if token_ids:
            if self.first_token_at is None:
                self.first_token_at = time.monotonic()
            choice.tokens += len(token_ids)
            self.usage.completion_tokens += len(token_ids)
            if self.token_ids is not None:
                self.token_ids.extend(token_ids)
            if self.top_logprobs is not None and logprobs:
                entries = compact_logprobs(logprobs, token_ids, self.top_logprobs)
                choice.logprobs = (choice.logprobs or []) + entries
        if text:
            text = choice.add_text(text, self.request.tool_mode)
        if finish_reason is not None:
            choice.finish_reason = finish_reason
        if finished:
            self.finished = True
            self.usage.finish_reason = finish_reason
        # The first visible text and the end go out at once (clients measure time to first text).
        self.relay.mark(self, urgent=finished or (bool(text) and not self.text_sent))

    def end(self, finish_reason: str | None, error: BaseException | None = None) -> None:
        if self.finished:
            return
        self.finished = True
        self.usage.finish_reason = finish_reason
        if error is not None:
            self.error = error
            self.usage.status = "error"
        self.relay.mark(self, urgent=True)

    def cancel(self) -> None:
        """The client went away: stop generating; the request is billed for what it generated."""
        if self.finished:
            return
        self.usage.status = "cancelled"
        if self.engine_request is not None:
            self.engine_request.cancel()  # the engine task ends the sink with "abort"
        else:
            self.end("abort")

    # -- for the flusher ------------------------------------------------------------------
    def take_entries(self) -> list[Entry]:
        """Everything not yet written, as numbered stream entries."""
        entries: list[Entry] = []
        if self.end_written:
            return entries
        if self.start_pending:
            self.start_pending = False
            entries.append(self._entry({"t": "start", "w": self.relay.worker}))
        ends = [self._finish(choice) for choice in self.choices] if self.finished else []
        for choice in self.choices:
            if choice.pending():
                entries.append(self._entry(self._delta(choice)))
        if self.finished:
            self.end_written = True
            if self.error is not None:
                entries.append(self._entry(_error_fields(self.error)))
            done = {"t": "done", "u": self._final_usage().dumps()}
            if self.n > 1 or self.request.tool_mode:
                done["c"] = json.dumps(ends, separators=(",", ":"))
            entries.append(self._entry(done))
        return entries

    def _delta(self, choice: Choice) -> dict:
        text = "".join(choice.texts)
        fields = {"t": "delta", "x": text, "n": choice.tokens}
        if self.n > 1:
            fields["i"] = choice.index
        if self.token_ids:
            fields["k"] = ",".join(map(str, self.token_ids))
            self.token_ids = []
        if choice.logprobs:
            fields["l"] = json.dumps(choice.logprobs, separators=(",", ":"))
        self.text_sent = self.text_sent or bool(text)
        choice.texts, choice.tokens, choice.logprobs = [], 0, None
        return fields

    def _finish(self, choice: Choice) -> dict:
        if choice.finish_reason is None:
            choice.finish_reason = self.usage.finish_reason
        return choice.finish(self.request.tool_mode, self.request.tool_name)

    def _entry(self, fields: dict) -> Entry:
        self.entry_count += 1
        return f"{self.entry_count}-0", fields

    def _final_usage(self) -> Usage:
        usage = self.usage
        if self.first_token_at is not None:
            usage.ttft_ms = int((self.first_token_at - self.submitted_at) * 1000)
        usage.finished_at = time.time()
        usage.total_ms = max(0, int((usage.finished_at - self.request.enqueued_at) * 1000))
        return usage


class EventRelay:
    """Relays the requests of one engine into Redis (see the module docstring).

    ``claim_and_run`` and ``run`` are thread-safe and return a future that completes once the
    request's done entry and usage are in Redis. ``client`` is a ``redis.asyncio`` client used only
    on the engine's loop (the relay's writes and the worker's claims, workers/claims.py).
    """

    def __init__(
        self,
        engine: EngineHost,
        client: redis.asyncio.Redis,
        *,
        worker: str,
        flush_interval: float,
        flush_events_per_second: float,
        adapters: AdapterResolver | None = None,
    ) -> None:
        self.engine, self.client, self.worker = engine, client, worker
        self.adapters = adapters or AdapterResolver()
        self.claims = ClaimBatcher(client, worker)
        self.flush_interval = flush_interval
        self.flush_events_per_second = flush_events_per_second
        self.tokens_total = 0  # completion tokens relayed, for the heartbeat's tokens/s
        self.flushes = 0  # pipelined writes so far
        self._active: dict[str, RelayedRequest] = {}
        self._dirty: dict[str, RelayedRequest] = {}  # requests with output not yet written
        self._urgent_jobs: dict[str, RelayedRequest] = {}  # those of them to write at once
        self._wake: asyncio.Event | None = None
        self._urgent: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []
        self._last_flush = 0.0
        # One flush at a time: a request's entries must reach Redis in their numbered order, or a
        # later entry written first would make an earlier one look like a duplicate.
        self._flushing: asyncio.Lock | None = None

    # -- from any thread ----------------------------------------------------------------------
    def start(self) -> None:
        """Start the flusher and the cancel watcher on the engine's (running) loop."""
        asyncio.run_coroutine_threadsafe(self._start(), self._loop()).result(timeout=30)

    def claim_and_run(self, rid: str) -> concurrent.futures.Future:
        """Claim request ``rid`` and run it. The future's result: False if there was nothing to claim
        (the gateway took the request back, or another worker claimed it), else True once the
        request's end is written to Redis."""
        return asyncio.run_coroutine_threadsafe(self._claim_and_serve(rid), self._loop())

    def run(self, request: RequestInput) -> concurrent.futures.Future:
        """Start a claimed request; the future completes when its end is written to Redis."""
        return asyncio.run_coroutine_threadsafe(self._serve(request), self._loop())

    def _loop(self) -> asyncio.AbstractEventLoop:
        loop = self.engine.loop
        if loop is None:
            raise RuntimeError("the engine is not running")
        return loop

    # -- on the engine's loop -----------------------------------------------------------------
    async def _start(self) -> None:
        self._wake, self._urgent = asyncio.Event(), asyncio.Event()
        self._flushing = asyncio.Lock()
        self._tasks = [
            asyncio.create_task(self._flush_forever(), name="relay-flush"),
            asyncio.create_task(self._watch_cancels(), name="relay-cancels"),
        ]

    async def _claim_and_serve(self, rid: str) -> bool:
        raw = await self.claims.claim(rid)
        if raw is None:
            return False
        await self._serve(RequestInput.loads(raw))
        return True

    async def _serve(self, request: RequestInput) -> None:
        usage = Usage(
            request_id=request.request_id,
            tenant_id=request.tenant_id,
            key_id=request.key_id,
            model=request.model,
            prompt_tokens=request.prompt_tokens,  # then as the engine counts it (``prefilled``)
            completion_tokens=request.continued_tokens,
            queue_ms=max(0, int((time.time() - request.enqueued_at) * 1000)),
            worker=",".join(filter(None, (request.earlier_workers, self.worker))),
        )
        job = RelayedRequest(request, usage, self)
        self._active[job.aid] = job
        self.mark(job, urgent=False)  # its start entry
        params = dict(request.params, cache_salt=request.cache_salt) if request.cache_salt else request.params
        try:
            if request.unknown_fields:
                # A newer gateway's fields (a rolling upgrade): a server error the client may retry.
                raise RuntimeError(f"this worker's version does not support {', '.join(request.unknown_fields)}")
            lora = await self.adapters.lora_request(request, self.engine) if request.adapter_id else None
            images = await asyncio.to_thread(decode_images, request.images) if request.images else None
            job.engine_request = self.engine.submit(
                job.aid, request.prompt_token_ids, params, job, lora_request=lora, multi_modal_data=images
            )
        except Exception as exc:  # refused parameters, an engine not ready: the stream still ends
            log.warning("request %s refused by the engine: %s", job.rid, exc)
            job.end("abort", exc)
        await job.done

    def mark(self, job: RelayedRequest, *, urgent: bool) -> None:
        """``job`` has something to write; ``urgent`` writes it now instead of at the next interval."""
        assert self._wake is not None and self._urgent is not None, "the relay is not started"
        self._dirty[job.aid] = job
        self._wake.set()
        if urgent:
            self._urgent_jobs[job.aid] = job
            self._urgent.set()

    def interval(self) -> float:
        """The wait between two flushes for the requests in flight now."""
        if not self.flush_events_per_second:
            return self.flush_interval
        budgeted = min(len(self._active) / self.flush_events_per_second, FLUSH_INTERVAL_CAP_SECONDS)
        return max(self.flush_interval, budgeted)

    async def _flush_forever(self) -> None:
        assert self._wake is not None and self._urgent is not None
        while True:
            await self._wake.wait()
            delay = self._last_flush + self.interval() - time.monotonic()
            if delay > 0 and not self._urgent.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._urgent.wait(), delay)
            batch = self._take_batch()
            try:
                await self.flush(batch)
            except Exception as exc:  # the flusher must outlive any one batch
                log.exception("relay: a flush of %d request(s) failed", len(batch))
                self._release([job for job in batch if job.end_written], exc)

    def _take_batch(self) -> list[RelayedRequest]:
        """At the interval, every request with output; before it, only the urgent ones (a first text,
        an end): one request starting or ending must not flush all the others with it."""
        assert self._wake is not None and self._urgent is not None
        self._urgent.clear()
        if time.monotonic() >= self._last_flush + self.interval():
            self._last_flush = time.monotonic()
            batch, self._dirty, self._urgent_jobs = list(self._dirty.values()), {}, {}
        else:
            batch, self._urgent_jobs = list(self._urgent_jobs.values()), {}
            for job in batch:
                del self._dirty[job.aid]
        if not self._dirty:
            self._wake.clear()
        return batch

    async def flush(self, batch: list[RelayedRequest]) -> None:
        """Write the batch's entries in one MULTI/EXEC (retried through an outage), then let the
        requests that ended go."""
        assert self._flushing is not None, "the relay is not started"
        async with self._flushing:
            await self._flush_locked(batch)

    async def _flush_locked(self, batch: list[RelayedRequest]) -> None:
        writes = [(job, job.take_entries()) for job in batch]
        writes = [(job, entries) for job, entries in writes if entries]
        if not writes:
            return
        # The requests whose end this write carries, told now: one that ends while the write is on
        # its way to Redis has its end in the next write, and must hold its slot (and count as in
        # flight for a drain) until then.
        ending = [job for job, _ in writes if job.end_written]
        delivered = await self._execute(writes)
        self.flushes += 1
        self.tokens_total += sum(int(fields.get("n", 0)) for _, entries in writes for _, fields in entries)
        if not delivered:
            for job in ending:
                log.error("usage of %s NOT recorded (Redis unreachable): %s", job.rid, job.usage.dumps())
        self._release(ending)

    async def _execute(self, writes: list[tuple[RelayedRequest, list[Entry]]]) -> bool:
        """Run the batch's pipeline until Redis takes it; False if it stayed unreachable."""

        async def execute() -> list:
            pipe = self.client.pipeline(transaction=True)
            for job, entries in writes:
                _queue_writes(pipe, job, entries)
            return await pipe.execute(raise_on_error=False)

        try:
            results = await through_outage(
                execute, seconds=USAGE_RETRY_SECONDS, what=f"relaying {len(writes)} request(s)"
            )
        except REDIS_UNAVAILABLE:
            return False
        if any(isinstance(result, NoScriptError) for result in results):
            # Redis restarted since the settle script was loaded: settling loads it (idempotent).
            await self._settle([job for job, _ in writes if job.end_written])
        for result in results:
            if isinstance(result, redis.ResponseError) and not isinstance(result, NoScriptError):
                _raise_unless_written(result)
        return True

    async def _settle(self, jobs: list[RelayedRequest]) -> None:
        """Settle again with the script's text (which loads it). Their ends and usage entries are
        written: a Redis that fails now leaves the settle to the ledger's next flush of them, and
        must not fail the requests."""
        try:
            for job in jobs:
                script, keys, args = settle_pending_call(job.rid)
                await self.client.eval(script.script, len(keys), *keys, *args)
        except REDIS_UNAVAILABLE:
            log.warning("relay: %d request(s) left to the ledger's flush to settle (Redis unavailable)", len(jobs))

    def _release(self, jobs: list[RelayedRequest], error: BaseException | None = None) -> None:
        for job in jobs:
            self._active.pop(job.aid, None)
            if job.done.done():
                continue
            if error is None:
                job.done.set_result(None)
            else:
                job.done.set_exception(error)

    async def _watch_cancels(self) -> None:
        leases_checked_from = 0.0  # after an outage, the gateways get a lease's length to renew theirs
        while True:
            await asyncio.sleep(CANCEL_CHECK_SECONDS)
            running = [job for job in self._active.values() if not job.finished]
            if not running:
                continue
            keys = [protocol.cancel_key(job.aid) for job in running] + [protocol.reader_key(job.rid) for job in running]
            try:
                flags = await self.client.mget(keys)
            except REDIS_UNAVAILABLE:
                leases_checked_from = time.monotonic() + protocol.READER_LEASE_SECONDS
                continue  # checked again once Redis is back
            check_leases = time.monotonic() >= leases_checked_from
            for job, cancel, reader in zip(running, flags[: len(running)], flags[len(running) :], strict=True):
                if cancel is not None:
                    job.cancel()
                elif reader is not None:
                    job.reader_seen = True
                elif job.reader_seen and check_leases:
                    log.warning("request %s: no gateway relays it any more (lease lapsed); stopping it", job.rid)
                    job.cancel()

    async def stop(self) -> None:
        """Stop the flusher and the cancel watcher and close the client (on the engine's loop)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.client.aclose()


def _queue_writes(pipe, job: RelayedRequest, entries: list[Entry]) -> None:
    key = protocol.events_key(job.aid)
    for entry_id, fields in entries:
        pipe.xadd(key, fields, id=entry_id)
        if fields["t"] == "start":
            pipe.expire(key, protocol.REQUEST_TTL)  # a stream whose worker dies still expires
        elif fields["t"] == "done":
            pipe.expire(key, protocol.REQUEST_TTL)
            pipe.hset(protocol.LEDGER_PENDING, job.rid, fields["u"])  # a second HSET is harmless
            # The usage is durable from here on: its quota settles in the same transaction.
            script, keys, args = settle_pending_call(job.rid)
            pipe.evalsha(script.sha, len(keys), *keys, *args)


def _error_fields(error: BaseException) -> dict:
    if isinstance(error, RequestRejected):  # the engine refused the request's parameters: the client's
        return {"t": "error", "m": f"the engine refused the request: {error}", "c": "request_rejected"}
    return {"t": "error", "m": f"engine error: {error}", "c": "engine_error"}


def _raise_unless_written(error: redis.ResponseError) -> None:
    # XADD with an id at or below the stream's last one: this entry was written by an earlier try.
    if "equal or smaller than the target stream top item" not in str(error):
        raise error


def relay_client(url: str, *, max_connections: int = 4) -> redis.asyncio.Redis:
    """The relay's Redis client: a small bounded pool (one flush, one cancel check and one batch of
    claims at a time) whose callers wait for a connection rather than fail."""
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        url, decode_responses=True, health_check_interval=30, max_connections=max_connections, timeout=20
    )
    return redis.asyncio.Redis(connection_pool=pool)
