"""The GPU worker's runtime: one engine per process, request execution, heartbeat and drain.

A worker is configured by environment: SERVED_MODEL (the model id clients use), MODEL_PATH,
WORKER_POOL, ENGINE_PROFILE. A Celery worker without SERVED_MODEL (a control-queue worker) hosts
no engine. The engine starts in `celeryd_after_setup`, before the worker consumes anything, so a
worker never takes a task it cannot run.
"""

import contextlib
import logging
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import redis
from celery.signals import celeryd_after_setup, worker_ready, worker_shutting_down
from django.conf import settings

from config.redis_client import REDIS_UNAVAILABLE
from workers import protocol
from workers.celery_app import app
from workers.protocol import RequestInput, Usage
from workers.threadpools import prestart_threads

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 2.0
CANCEL_CHECK_SECONDS = 0.25
# However many requests are in flight, a stream still gets an event at least this often.
FLUSH_INTERVAL_CAP_SECONDS = 0.25
# How long a request's writes to Redis are retried through an outage (a restart, a failover)
# before giving up: its token events, then (much longer) its done event and usage entry.
REDIS_RETRY_SECONDS = 30.0
USAGE_RETRY_SECONDS = 600.0


def _env_number(name: str, default: str, high: float) -> float:
    raw = os.environ.get(name, "").strip() or default
    try:
        value = float(raw)
    except ValueError:
        raise RuntimeError(f"{name} must be a number, got {raw!r}") from None
    if not 0 <= value <= high:
        raise RuntimeError(f"{name} must be within 0..{high:g}, got {raw!r}")
    return value


def _through_outage(call, *, seconds: float, what: str):
    """``call()``, retried with backoff while Redis is unreachable, for at most ``seconds``.

    redis-py retries a command on a connection it already has, but not a failure to get one (a
    server that is restarting resets new connections), so a worker thread writing when Redis
    restarts would otherwise lose the write, and with it a stream's end or a request's usage.
    """
    deadline = time.monotonic() + seconds
    pause = 0.05
    while True:
        try:
            return call()
        except REDIS_UNAVAILABLE:
            if time.monotonic() + pause > deadline:
                raise
            log.warning("Redis unreachable while %s; retrying in %.2fs", what, pause)
            time.sleep(pause)
            pause = min(pause * 2, 2.0)


class RequestEvents:
    """The worker's side of one request's event stream (the gateway relays it to the client).

    Entries are numbered 1-0, 2-0, ... by the worker, so a write retried after Redis executed it but
    the reply was lost (a restart between the two) is refused as a duplicate instead of appended
    twice: the client never sees a piece of text twice.
    """

    def __init__(self, client: redis.Redis, rid: str):
        self.client, self.rid, self.key, self.count = client, rid, protocol.events_key(rid), 0

    def _next_id(self) -> str:
        self.count += 1
        return f"{self.count}-0"

    def append(self, fields: dict) -> None:
        entry_id = self._next_id()

        def write():
            try:
                self.client.xadd(self.key, fields, id=entry_id)
            except redis.ResponseError as exc:
                _raise_unless_written(exc)

        _through_outage(write, seconds=REDIS_RETRY_SECONDS, what=f"writing an event of {self.rid}")

    def finish(self, usage: Usage) -> None:
        """The done event and the durable usage entry, written together (MULTI/EXEC) or not at all."""
        entry_id = self._next_id()

        def write():
            pipe = self.client.pipeline(transaction=True)
            pipe.xadd(self.key, {"t": "done", "u": usage.dumps()}, id=entry_id)
            pipe.expire(self.key, protocol.REQUEST_TTL)
            pipe.hset(protocol.LEDGER_PENDING, self.rid, usage.dumps())  # a second HSET is harmless
            for result in pipe.execute(raise_on_error=False):
                if isinstance(result, redis.ResponseError):
                    _raise_unless_written(result)

        try:
            _through_outage(write, seconds=USAGE_RETRY_SECONDS, what=f"recording the usage of {self.rid}")
        except REDIS_UNAVAILABLE:
            # Nothing left to write it to: the log line carries the entry for an operator to replay.
            log.error("usage of %s NOT recorded (Redis unreachable): %s", self.rid, usage.dumps())
            raise


def _raise_unless_written(error: redis.ResponseError) -> None:
    # XADD with an id at or below the stream's last one: this entry was written by an earlier try.
    if "equal or smaller than the target stream top item" not in str(error):
        raise error


def _flush_interval_seconds() -> float:
    """WORKER_FLUSH_INTERVAL_MS (default 20): the shortest interval between two delta events of one
    request (the first and the last go out at once)."""
    return _env_number("WORKER_FLUSH_INTERVAL_MS", "20", 1000) / 1000


def _flush_events_per_second() -> float:
    """WORKER_FLUSH_EVENTS_PER_SECOND (default 250, 0 = off): a budget for the delta events of all the
    requests in flight together. Every event costs an XADD here and, in the gateway, a stream read, an
    SSE frame and a socket write: that per-event work, not the engine, bounded the platform at 32+
    streams (docs/benchmarks.md). So a request's interval grows with the requests in flight
    (in flight / budget, never below WORKER_FLUSH_INTERVAL_MS): smooth streams when few run, a few
    tokens per event when many do. Measured on 2 cores at 64 streams: 20 ms fixed 1,325 tok/s, 100 ms
    fixed 3,120."""
    return _env_number("WORKER_FLUSH_EVENTS_PER_SECOND", "250", 1_000_000)


class WorkerRuntime:
    def __init__(self, *, name: str, model: str, model_path: str, pool: str, profile: str, slots: int = 0):
        from workers.engine import EngineHost

        self.name = name
        self.model = model
        self.pool = pool
        self.slots = slots  # requests this worker runs at once (its Celery concurrency): the gateway's fair share
        self.pod = os.environ.get("POD_NAME") or socket.gethostname()
        self.redis = redis.Redis.from_url(settings.REDIS_URL, decode_responses=True, health_check_interval=30)
        self.engine = EngineHost(model_path, profile=profile, served_model_name=model)
        self.state = "starting"
        self._in_flight = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._consuming = True
        self._tokens_total = 0  # completion tokens generated, for the tokens/s the heartbeat reports
        self.flush_interval = _flush_interval_seconds()
        self.flush_events_per_second = _flush_events_per_second()
        self._rate_mark = (time.monotonic(), 0)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True).start()
        try:
            self.engine.start()
        except Exception:
            self.state = "failed"
            self._beat()
            raise
        self.state = "ready"
        self._beat()
        log.info("worker %s: engine ready for %s on queue %s", self.name, self.model, protocol.queue_name(self.pool))

    def stop(self) -> None:
        self.state = "stopped"
        self._stop.set()
        pipe = self.redis.pipeline()
        pipe.zrem(protocol.pool_workers_key(self.pool), self.name)
        pipe.hset(protocol.worker_key(self.name), "state", "stopped")
        pipe.execute()
        self.engine.shutdown()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    # -- heartbeat and drain -----------------------------------------------------------------
    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                self._beat()
                self._follow_drain_request()
            except redis.RedisError:
                log.warning("heartbeat: Redis unavailable", exc_info=True)

    def _tokens_per_second(self) -> float:
        now, total = time.monotonic(), self._tokens_total
        then, before = self._rate_mark
        self._rate_mark = (now, total)
        return round((total - before) / (now - then), 2) if now > then else 0.0

    def _beat(self) -> None:
        pipe = self.redis.pipeline()
        pipe.hset(
            protocol.worker_key(self.name),
            mapping={
                "pool": self.pool,
                "pod": self.pod,
                "model": self.model,
                "state": self.state,
                "in_flight": self._in_flight,
                "slots": self.slots,
                "tps": self._tokens_per_second(),
                "updated": time.time(),
            },
        )
        pipe.expire(protocol.worker_key(self.name), 3600)
        pipe.zadd(protocol.pool_workers_key(self.pool), {self.name: time.time()})
        pipe.execute()

    def _follow_drain_request(self) -> None:
        """Stop (or resume) consuming when the operator asks this pod to drain (or cancels it)."""
        if self.state not in ("ready", "draining"):
            return
        drain = bool(self.redis.sismember(protocol.pool_drain_key(self.pool), self.pod))
        if drain and self._consuming:
            app.control.cancel_consumer(protocol.queue_name(self.pool), destination=[self.name])
            self._consuming, self.state = False, "draining"
            log.info("worker %s: draining (%d in flight)", self.name, self._in_flight)
        elif not drain and not self._consuming:
            app.control.add_consumer(protocol.queue_name(self.pool), destination=[self.name])
            self._consuming, self.state = True, "ready"

    # -- requests ----------------------------------------------------------------------------
    def run_request(self, rid: str) -> None:
        # Claim the request by taking its input: if the gateway already gave up, it deleted the
        # input (and recorded the request itself), so there is nothing to do.
        raw = self.redis.getdel(protocol.input_key(rid))
        if raw is None:
            return
        request = RequestInput.loads(raw)
        started = time.time()
        # Claimed: from here on the request must reach its done event, through an outage too.
        events = RequestEvents(self.redis, rid)
        events.append({"t": "start", "w": self.name})
        with self._lock:
            self._in_flight += 1
        usage = Usage(
            request_id=rid,
            tenant_id=request.tenant_id,
            key_id=request.key_id,
            model=request.model,
            prompt_tokens=len(request.prompt_token_ids),
            queue_ms=max(0, int((started - request.enqueued_at) * 1000)),
            worker=self.name,
        )
        try:
            self._generate(request, usage, events)
        except Exception as exc:  # the stream must end with an explicit event, whatever happened
            log.exception("request %s failed", rid)
            usage.status = "error"
            with contextlib.suppress(*REDIS_UNAVAILABLE):  # the done event below still ends the stream
                events.append({"t": "error", "m": f"engine error: {exc}", "c": "engine_error"})
        finally:
            try:
                usage.finished_at = time.time()
                usage.total_ms = max(0, int((usage.finished_at - request.enqueued_at) * 1000))
                events.finish(usage)
            finally:
                # Only after the done event is written: a drain that sees nothing in flight must
                # not let the pod stop before the last stream has its end.
                with self._lock:
                    self._in_flight -= 1

    def _generate(self, request: RequestInput, usage: Usage, events: RequestEvents) -> None:
        rid = request.request_id
        next_cancel_check = 0.0
        params = dict(request.params, cache_salt=request.cache_salt) if request.cache_salt else request.params
        stream = self.engine.stream(
            rid, request.prompt_token_ids, params, flush_interval=self._request_flush_interval()
        )
        try:
            for chunk in stream:
                if chunk.ttft is not None and usage.ttft_ms is None:
                    usage.ttft_ms = int(chunk.ttft * 1000)
                usage.completion_tokens += chunk.token_count
                self._tokens_total += chunk.token_count
                if chunk.finished:
                    usage.finish_reason = chunk.finish_reason
                if chunk.text or chunk.token_count:
                    # While this waits out an outage the engine keeps generating; the next chunk
                    # carries everything generated meanwhile.
                    events.append({"t": "delta", "x": chunk.text, "n": chunk.token_count})
                now = time.monotonic()
                if now >= next_cancel_check and not chunk.finished:
                    next_cancel_check = now + CANCEL_CHECK_SECONDS
                    cancelled = _through_outage(lambda: self.redis.exists(protocol.cancel_key(rid)),
                                                seconds=REDIS_RETRY_SECONDS, what=f"checking {rid}")  # fmt: skip
                    if cancelled:
                        usage.status, usage.finish_reason = "cancelled", "abort"
                        break  # closing the stream aborts the request in the engine
        finally:
            stream.close()

    def _request_flush_interval(self) -> float:
        """The coalescing interval for a request starting now (see _flush_events_per_second)."""
        if not self.flush_events_per_second:
            return self.flush_interval
        budgeted = min(self._in_flight / self.flush_events_per_second, FLUSH_INTERVAL_CAP_SECONDS)
        return max(self.flush_interval, budgeted)


_runtime: WorkerRuntime | None = None


def runtime() -> WorkerRuntime:
    if _runtime is None:
        raise RuntimeError("this worker hosts no engine: start it with SERVED_MODEL, MODEL_PATH and WORKER_POOL set")
    return _runtime


@celeryd_after_setup.connect
def _start_engine(sender, instance, **kwargs) -> None:
    """Start the engine before the worker consumes tasks (only in workers that serve a model)."""
    global _runtime
    model = os.environ.get("SERVED_MODEL")
    if not model:
        return
    missing = [name for name in ("MODEL_PATH", "WORKER_POOL") if not os.environ.get(name)]
    if missing:
        raise RuntimeError(f"SERVED_MODEL is set, so {', '.join(missing)} must be set too")
    _runtime = WorkerRuntime(
        name=sender,
        model=model,
        model_path=os.environ["MODEL_PATH"],
        pool=os.environ["WORKER_POOL"],
        profile=os.environ.get("ENGINE_PROFILE", "cpu"),
        slots=getattr(instance, "concurrency", 0) or 0,
    )
    try:
        _runtime.start()
    except Exception as exc:
        # Celery logs and swallows exceptions from signal handlers, which would leave a worker up
        # that can never serve (and a /readyz that never turns ready): exit instead, so the
        # supervisor (Kubernetes, make up) sees the failure and restarts or reports it.
        log.critical("worker %s: the engine failed to start: %s", sender, exc)
        raise SystemExit(3) from exc


@worker_ready.connect
def _prestart_task_threads(sender, **kwargs) -> None:
    """Start every thread of the threads pool before the first task (see workers/threadpools.py):
    a burst of requests would otherwise start them one by one, stalling the consumer and the engine."""
    pool = getattr(sender, "pool", None)
    executor = getattr(pool, "executor", None)  # only the threads pool has one
    if isinstance(executor, ThreadPoolExecutor):
        prestart_threads(executor, pool.limit)
        log.info("worker %s: started its %d task threads", sender.hostname, pool.limit)


@worker_shutting_down.connect
def _stop_engine(**kwargs) -> None:
    # Celery's warm shutdown waits for running tasks first; this runs when they are done or abandoned.
    if _runtime is not None:
        _runtime.state = "draining"
        threading.Thread(target=_stop_after_in_flight, daemon=True).start()


def _stop_after_in_flight() -> None:
    assert _runtime is not None
    deadline = time.monotonic() + 600
    while _runtime.in_flight and time.monotonic() < deadline:
        time.sleep(0.5)
    _runtime.stop()
