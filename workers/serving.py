"""The GPU worker's runtime: one engine per process, request execution, heartbeat and drain.

A worker is configured by environment: SERVED_MODEL (the model id clients use), MODEL_PATH,
WORKER_POOL, ENGINE_PROFILE. A Celery worker without SERVED_MODEL (a control-queue worker) hosts
no engine. The engine starts in `celeryd_after_setup`, before the worker consumes anything, so a
worker never takes a task it cannot run.
"""

import logging
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import redis
from celery.concurrency import thread as thread_pool
from celery.signals import celeryd_after_setup, worker_init, worker_ready, worker_shutting_down
from celery.worker import state as worker_state

from contract import protocol
from contract.env import env_float, env_int, env_str, redis_url_checked
from contract.heap import freeze_startup_heap
from workers.adapters import held_field
from workers.broker import take_waves
from workers.celery_app import app
from workers.engine import EngineHost
from workers.relay import EventRelay, relay_client
from workers.requestpool import RequestPool, hand_off
from workers.threadpools import prestart_threads

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 2.0
# How long a worker's heartbeat record outlives its last beat; the pool's heartbeat set forgets a
# worker gone this long (each process start is a new identity, so a restarted one never comes back).
WORKER_RECORD_SECONDS = 3600
# Connections of the worker's synchronous Redis client (heartbeat, drain, stop: the request tasks make
# no Redis call, workers/claims.py); a caller that finds all busy waits up to REDIS_POOL_WAIT_SECONDS.
REDIS_CONNECTIONS = 8
REDIS_POOL_WAIT_SECONDS = 20
# Celery's loggers of each task's receipt and success (`_serve_requests_in_slots`).
PER_TASK_LOGGERS = ("celery.worker.strategy", "celery.app.trace")


def _env_number(name: str, default: float, high: float) -> float:
    return env_float(name, default, minimum=0, maximum=high)


def _flush_interval_seconds() -> float:
    """WORKER_FLUSH_INTERVAL_MS (default 20): the shortest interval between two flushes of the
    relay (a request's first text and its end go out at once; workers/relay.py)."""
    return _env_number("WORKER_FLUSH_INTERVAL_MS", 20, 1000) / 1000


def _flush_events_per_second() -> float:
    """WORKER_FLUSH_EVENTS_PER_SECOND (default 250, 0 = off): a budget for the delta events of all the
    requests in flight together. Every event costs an XADD here and, in the gateway, a stream read, an
    SSE frame and a socket write: that per-event work, not the engine, bounded the platform at 32+
    streams (docs/benchmarks.md). So the relay's interval grows with the requests in flight
    (in flight / budget, never below WORKER_FLUSH_INTERVAL_MS): smooth streams when few run, a few
    tokens per event when many do. Measured on 2 cores at 64 streams: 20 ms fixed 1,325 tok/s, 100 ms
    fixed 3,120."""
    return _env_number("WORKER_FLUSH_EVENTS_PER_SECOND", 250, 1_000_000)


def engine_stream_interval() -> int:
    """WORKER_ENGINE_STREAM_INTERVAL (default 8): the tokens a request gathers in the engine's
    output handling before the worker takes them, once the request has shown text; until then
    every token comes at once, so the first text is never held back (``EngineHost``'s
    ``_widen_stream_interval``). 8 saves the worker 7-15% of its CPU per 64-token request against
    1 (the relay writes a request's text at most once per flush interval anyway; docs/benchmarks.md).
    An ENGINE_ARGS_JSON ``stream_interval`` (vLLM's own, from a request's first token on) wins."""
    return env_int("WORKER_ENGINE_STREAM_INTERVAL", 8, minimum=1)


def _redis_url() -> str:
    """REDIS_URL, required and checked as the control plane's settings check it (config/settings.py)."""
    return redis_url_checked(env_str("REDIS_URL"))


def _worker_redis() -> redis.Redis:
    """The worker's synchronous client: a bounded pool whose callers wait for a connection (never
    "Too many connections")."""
    pool = redis.BlockingConnectionPool.from_url(
        _redis_url(),
        decode_responses=True,
        health_check_interval=30,
        max_connections=REDIS_CONNECTIONS,
        timeout=REDIS_POOL_WAIT_SECONDS,
    )
    return redis.Redis(connection_pool=pool)


class WorkerRuntime:
    """One GPU worker: its engine, the relay of its requests into Redis, heartbeat and drain.

    ``run_request`` is the body of a request's Celery task: it hands the request to the engine's
    loop, which claims it (workers/claims.py) and relays it; the task's slot stays taken until the
    relay has written its end, with no thread waiting for it (workers/requestpool.py). ``slots`` is
    the worker's Celery concurrency:
    the requests it runs at once, which the gateway's fair share counts on. ``node`` is the Celery
    node name (the destination of remote control); ``name``, the identity everything in Redis
    carries (heartbeat, claims, start entries, usage), is drawn anew for each process start.
    """

    def __init__(
        self, *, node: str, model: str, model_path: str, pool: str, profile: str, slots: int = 0,
        engine: EngineHost | None = None,
    ):  # fmt: skip
        self.node = node
        self.name = protocol.worker_identity(node)
        self.model = model
        self.pool = pool
        self.slots = slots
        self.pod = os.environ.get("POD_NAME") or socket.gethostname()
        self.redis = _worker_redis()
        self.engine = engine or EngineHost(
            model_path, profile=profile, served_model_name=model, text_stream_interval=engine_stream_interval()
        )
        self.relay = EventRelay(
            self.engine,
            relay_client(_redis_url()),
            worker=self.name,
            flush_interval=_flush_interval_seconds(),
            flush_events_per_second=_flush_events_per_second(),
        )
        self.state = "starting"
        self._in_flight = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._consuming = True
        self._rate_mark = (time.monotonic(), 0)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True).start()
        try:
            self.engine.start()
            self.relay.start()
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
                self.relay.adapters.forget_deleted(self.redis, self.engine)
            except redis.RedisError:
                log.warning("heartbeat: Redis unavailable", exc_info=True)

    def _tokens_per_second(self) -> float:
        now, total = time.monotonic(), self.relay.tokens_total
        then, before = self._rate_mark
        self._rate_mark = (now, total)
        return round((total - before) / (now - then), 2) if now > then else 0.0

    def _beat(self) -> None:
        now = time.time()
        pipe = self.redis.pipeline()
        pipe.hset(
            protocol.worker_key(self.name),
            mapping={
                "node": self.node,
                "pool": self.pool,
                "pod": self.pod,
                "model": self.model,
                "state": self.state,
                "in_flight": self._in_flight,
                "slots": self.slots,
                "tps": self._tokens_per_second(),
                "lora": int(bool(self.engine.engine_args.get("enable_lora"))),
                "adapters": self._held_adapters(),
                "kv_tokens": self.engine.kv_cache_tokens(),
                "updated": now,
            },
        )
        pipe.expire(protocol.worker_key(self.name), WORKER_RECORD_SECONDS)
        pipe.zadd(protocol.pool_workers_key(self.pool), {self.name: now})
        pipe.zremrangebyscore(protocol.pool_workers_key(self.pool), "-inf", now - WORKER_RECORD_SECONDS)
        pipe.execute()

    def _held_adapters(self) -> str:
        """The LoRA adapters the engine holds, for the gateway's dispatch (workers/adapters.py)."""
        try:
            return held_field(self.engine.loaded_adapters())
        except Exception:  # an engine busy past the timeout: advertise none this beat
            log.warning("worker %s: could not list the engine's adapters", self.name, exc_info=True)
            return ""

    @property
    def queues(self) -> list[str]:
        """The queues a drain stops consuming: the pool's. The worker's own queue (the requests the
        gateway's route step sent to it) is consumed to the end: the route step sends nothing to a
        draining worker, and what it sent before it saw the drain is this worker's to run."""
        return [protocol.queue_name(self.pool)]

    def _follow_drain_request(self) -> None:
        """Stop (or resume) consuming when the operator asks this pod to drain (or cancels it)."""
        if self.state not in ("ready", "draining"):
            return
        drain = bool(self.redis.sismember(protocol.pool_drain_key(self.pool), self.pod))
        if drain and self._consuming:
            for queue in self.queues:
                app.control.cancel_consumer(queue, destination=[self.node])
            self._consuming, self.state = False, "draining"
            log.info("worker %s: draining (%d in flight)", self.name, self._in_flight)
        elif not drain and not self._consuming:
            for queue in self.queues:
                app.control.add_consumer(queue, destination=[self.node])
            self._consuming, self.state = True, "ready"

    # -- requests ----------------------------------------------------------------------------
    def run_request(self, rid: str) -> None:
        """Hand the request to the engine's loop, which claims and relays it, and, unless the task's
        pool takes the wait over (workers/requestpool.py), wait until its end (and usage) is in Redis.

        If the gateway already gave up, it deleted the input (and recorded the request itself), so
        the claim finds nothing to run. Counted in flight from before the claim until its end: a
        drain that sees nothing in flight must not let the pod stop before the last stream has its end."""
        with self._lock:
            self._in_flight += 1
        try:
            ended = self.relay.claim_and_run(rid)
        except BaseException:
            self._request_ended()
            raise
        ended.add_done_callback(self._request_ended)
        if not hand_off(ended):
            ended.result()

    def _request_ended(self, _ended: object = None) -> None:
        with self._lock:
            self._in_flight -= 1


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
    try:
        _runtime = _build_runtime(sender, instance, model)
        _runtime.start()
    except Exception as exc:
        # Celery logs and swallows exceptions from signal handlers, which would leave a worker up
        # that can never serve (and a /readyz that never turns ready): exit instead, so the
        # supervisor (Kubernetes, make up) sees the failure and restarts or reports it. A setting
        # refused while the runtime is built (a bad ENGINE_ARGS_JSON...) ends the same way.
        log.critical("worker %s: the engine failed to start: %s", sender, exc)
        raise SystemExit(3) from exc


def _build_runtime(sender, instance, model: str) -> WorkerRuntime:
    missing = [name for name in ("MODEL_PATH", "WORKER_POOL") if not os.environ.get(name)]
    if missing:
        raise RuntimeError(f"SERVED_MODEL is set, so {', '.join(missing)} must be set too")
    runtime = WorkerRuntime(
        node=sender,
        model=model,
        model_path=os.environ["MODEL_PATH"],
        pool=os.environ["WORKER_POOL"],
        profile=os.environ.get("ENGINE_PROFILE", "cpu"),
        slots=getattr(instance, "concurrency", 0) or 0,
    )
    # This process's own queue (requests for an adapter its engine holds), consumed from the start.
    instance.app.amqp.queues.select_add(protocol.worker_queue_name(runtime.name))
    return runtime


@worker_init.connect
def _serve_requests_in_slots(sender, **kwargs) -> None:
    """Before Celery builds its pool and consumer, in a worker that serves a model:

    - started with the threads pool, it runs its requests' tasks in `RequestPool`, the threads pool
      less a thread per request (workers/requestpool.py);
    - at log level INFO, Celery's "received" and "succeeded" lines for each task are left out: two
      log records per request, written on the consumer's thread that every request's hand-off waits
      on, thousands a minute at full batch, where the ledger already keeps a row per request.
      Failures are still logged; at DEBUG everything is."""
    if not os.environ.get("SERVED_MODEL"):
        return
    if sender.pool_cls in ("threads", thread_pool.TaskPool):
        sender.pool_cls = RequestPool
    if sender.loglevel > logging.DEBUG:
        for name in PER_TASK_LOGGERS:
            logging.getLogger(name).setLevel(max(sender.loglevel, logging.WARNING))


@worker_ready.connect
def _prestart_task_threads(sender, **kwargs) -> None:
    """Start every thread of the threads pool before the first task (see workers/threadpools.py):
    a burst of requests would otherwise start them one by one, stalling the consumer and the engine."""
    pool = getattr(sender, "pool", None)
    executor = getattr(pool, "executor", None)  # only the threads pools have one
    if isinstance(executor, ThreadPoolExecutor):
        prestart_threads(executor, executor._max_workers)
        log.info("worker %s: started its %d task threads", sender.hostname, executor._max_workers)


@worker_ready.connect
def _take_waves_of_tasks(sender, **kwargs) -> None:
    """A worker that serves a model takes a wave of waiting requests in one round trip, up to its free
    task slots (workers/broker.py); each slot runs one request, from receipt until its end."""
    if _runtime is None:
        return
    slots = sender.pool.num_processes
    take_waves(lambda: slots - len(worker_state.reserved_requests))


@worker_ready.connect
def _freeze_startup_heap(sender, **kwargs) -> None:
    """Once the engine and the task threads are up: keep what they allocated out of the garbage
    collector's full passes, which would stop the engine's loop (contract/heap.py)."""
    log.info("worker %s: froze %d start-up objects", sender.hostname, freeze_startup_heap())


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
