"""The live stack for end-to-end tests: gunicorn → Redis → Celery worker → vLLM (tiny model, CPU).

The stack is the platform's launcher's (deploy/local/launcher.py ``Stack``), as ``make up`` and the
benchmarks start it; this module adds the tests' defaults (the tiny model, pool ``tiny``, a worker
per pool on demand), the test's database and Redis, and the helpers the tests share.

One stack per test module (the engine takes tens of seconds to start; a fresh stack per module keeps
one module's leftovers from slowing the next). It uses the pytest-django
test database and its own Redis database index, so unit tests that flush their Redis database do
not disturb it. Tests that use it must commit their data (`transactional_db`).
"""

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse, urlunparse

import httpx
import pytest

from deploy.local import launcher
from deploy.local.launcher import CELERY_APP, free_port, stack_env, worker_command, worker_env

__all__ = ["free_port"]

ROOT = Path(__file__).resolve().parents[2]
POOL = "tiny"
MODEL = "tiny-gemma4"
# The stack's own Redis database, next to the suite's (TEST_REDIS_DB, default 15 -> stack 14; a
# suite on database n < 8 -> stack n + 7), so that suites run side by side never share a Celery queue.
_SUITE_REDIS_DB = int(os.environ.get("TEST_REDIS_DB", "15"))
STACK_REDIS_DB = os.environ.get("E2E_REDIS_DB") or str(_SUITE_REDIS_DB + 7 if _SUITE_REDIS_DB < 8 else 14)
ENGINE_START_TIMEOUT = float(os.environ.get("E2E_ENGINE_START_TIMEOUT", "600"))


def database_url(settings_dict: dict) -> str:
    user = settings_dict["USER"] or "postgres"
    password = f":{settings_dict['PASSWORD']}" if settings_dict["PASSWORD"] else ""
    host = settings_dict["HOST"] or "127.0.0.1"
    port = settings_dict["PORT"] or "5432"
    return f"postgres://{user}{password}@{host}:{port}/{settings_dict['NAME']}"


@dataclass(kw_only=True)
class Stack(launcher.Stack):
    """The launcher's stack with the tests' defaults: the tiny model in ``model_dir`` as ``tiny-gemma4``
    on pool ``tiny``; every worker serves tenants' adapters (tests/e2e/test_adapters.py)."""

    model_dir: Path

    def register_model(self, model: str = MODEL, path=None, pool: str = POOL, context_length: int = 2048) -> None:
        super().register_model(model, path or self.model_dir, pool, context_length)

    def worker_command(self, name: str, pool: str, concurrency: int = 64, app: str = CELERY_APP) -> list[str]:
        return worker_command(name, f"pool.{pool},control", concurrency, app=app)

    def worker_env(self, name: str, pool: str, model_path=None) -> dict:
        """The environment ``start_worker`` gives worker ``name`` (for a worker a test runs itself)."""
        return worker_env(self.env, pool, model=MODEL, model_path=model_path or self.model_dir, **_worker_options(name))

    def start_worker(self, name: str = "e2e", pool: str = POOL, concurrency: int = 64, **options) -> launcher.Child:
        """A Celery worker with an engine on `pool` (``children[name]``); `options` as the launcher's
        (``app``: a module of the tests' own that wraps the worker's, ``wrap``, environment variables)."""
        options = {**_worker_options(name), **options}
        return super().start_worker(name, pool, model=MODEL, model_path=self.model_dir, concurrency=concurrency,
                                    **options)  # fmt: skip

    def wait_ready(self, pool: str = POOL, *, count: int = 1, timeout: float = ENGINE_START_TIMEOUT,
                   since: float = 0.0) -> None:  # fmt: skip
        super().wait_ready(pool, count=count, timeout=timeout, since=since)


def _worker_options(name: str) -> dict:
    """Every test worker: its own pod name, the CPU profile, tenants' adapters served."""
    return {"pod": f"{name}-pod", "ENGINE_PROFILE": "cpu", "ENGINE_LORA": "1"}


def engine_processes(stack: Stack, worker: str = "e2e") -> list:
    """The worker's vLLM engine processes (EngineCore and its compute worker): to pause and resume."""
    import psutil

    process = psutil.Process(stack.children[worker].pid)
    return [child for child in process.children(recursive=True) if child.name().startswith("VLLM::")]


def requests_in_flight(stack: Stack, pool: str = POOL) -> int:
    """What the pool's workers reported in their last heartbeat (every 2 s): tasks they are running."""
    import redis

    from contract import protocol

    client = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    return sum(int(record.get("in_flight") or 0) for record in protocol.fresh_workers(client, pool, 0).values())


class PausedEngine:
    """A worker's engine processes, stopped with SIGSTOP; ``resumed()`` lets them run for a while."""

    def __init__(self, processes: list) -> None:
        self.processes = processes

    def suspend(self) -> None:
        for process in self.processes:
            process.suspend()

    def resume(self) -> None:
        for process in self.processes:
            process.resume()

    def describe(self) -> str:
        """Each process's state and CPU seconds so far: for a failure message."""
        import psutil

        parts = []
        for process in self.processes:
            try:
                cpu = process.cpu_times()
                parts.append(f"{process.pid} {process.status()} user {cpu.user:.1f} s system {cpu.system:.1f} s")
            except psutil.Error as exc:  # a process gone meanwhile is part of the description
                parts.append(f"{process.pid} {exc!r}")
        return "; ".join(parts)

    @contextlib.contextmanager
    def resumed(self):
        self.resume()
        try:
            yield
        finally:
            self.suspend()


@contextlib.contextmanager
def engine_paused(stack: Stack, worker: str = "e2e"):
    """The worker's engine stopped (SIGSTOP) inside the block: requests are taken but make no progress."""
    engine = PausedEngine(engine_processes(stack, worker))
    assert engine.processes, f"no vLLM engine process under {worker}"
    engine.suspend()
    try:
        yield engine
    finally:
        engine.resume()


def disconnect_mid_stream(stack: Stack, key: str, body: dict, attempts: int = 5) -> httpx.Headers:
    """Stream a chat completion and go away while the worker generates it; return the reply's
    headers once the gateway has told the worker to stop.

    The engine is paused except while it makes the request's first tokens: left running, it can
    finish a short request before a client on a loaded machine has read the first line, and the
    client then leaves a request that already ended; paused throughout, the worker stops the request
    before it generated anything, and there is nothing to bill. It stays paused after the client
    left until the worker has ended the request (its done entry): resumed as soon as the gateway had
    set the cancel key, it generated all 1,500 tokens of a request before the worker, slowed by a CPU
    hog, saw that key (CI, 2026-12-03). Even the short run can finish the request when this
    process gets no CPU for seconds (a busy 2-core machine): such an attempt is seen by its done
    entry and repeated with a new request, once the finished one is settled.
    """
    import redis

    from contract import protocol

    client = redis.Redis.from_url(stack.redis_url, decode_responses=True)

    def cancelled(request_id: str):
        return lambda: client.exists(protocol.cancel_key(request_id))

    for _ in range(attempts):
        with engine_paused(stack) as engine:
            with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", json=dict(body, stream=True),
                              headers={"Authorization": f"Bearer {key}"}, timeout=60) as response:  # fmt: skip
                assert response.status_code == 200, response.read()
                headers, request_id = response.headers, response.headers["x-request-id"]
                lines = response.iter_lines()  # held: a dropped line iterator closes the connection
                next(line for line in lines if line.startswith("data: {"))  # the role chunk
                finished_before_leaving = run_to_first_tokens(engine, client, request_id)
            if not finished_before_leaving:
                # The gateway notices the client is gone at once (the server reads the closed
                # connection), at the latest at its next keep-alive write; the worker then aborts
                # the request (its cancel check) and writes its end, all with the engine paused.
                wait_until(cancelled(request_id), "the gateway never cancelled the request", 60)
                wait_until(relayed(client, "done", request_id), "the worker never ended the cancelled request", 60)
                return headers
        # Its usage settled (and its concurrency slot given back) before the next attempt is admitted.
        wait_usage_row(request_id)
        wait_until(settled(client, request_id), "the finished request was never settled")
    raise AssertionError(f"the engine finished the request before the client left, {attempts} times")


def settled(client, request_id: str):
    """A condition for `wait_until`: the request's quota reservation is settled (its concurrency
    slot given back)."""
    from quotas.admission import resv_key

    return lambda: not client.exists(resv_key(request_id))


def relayed(client, kind: str, request_id: str):
    """A condition for `wait_until`: the request's event stream in Redis holds an entry of `kind`
    (start, delta, done, error)."""
    return lambda: kind in entry_kinds(client, request_id)


def run_to_first_tokens(engine: PausedEngine, client, request_id: str) -> bool:
    """With `engine` paused: wait for its worker to take the request, let the engine run until the
    request's first tokens are relayed, pause it again. True when the request ended all the same (a
    test process starved for seconds lets the engine finish a long request meanwhile)."""
    wait_until(relayed(client, "start", request_id), "the worker never took the request")
    with engine.resumed():
        wait_until(relayed(client, "delta", request_id), lambda: (
            f"the engine generated nothing in 60 s: the request's entries {entry_kinds(client, request_id)}, "
            f"its engine processes {engine.describe()}"), timeout=60)  # fmt: skip
    return relayed(client, "done", request_id)()


def entry_kinds(client, request_id: str) -> list[str]:
    """The kinds of the entries in the request's event stream, in order."""
    from contract import protocol

    return [fields["t"] for _, fields in client.xrange(protocol.events_key(request_id))]


def wait_until(condition, what, timeout: float = 30) -> None:
    """Poll `condition` until true; fail with `what` (a message, or a function that makes one)
    after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(0.1)


def wait_usage_row(request_id: str, timeout: float = 30.0):
    """The ledger row of a request, once the stack has written it."""
    from ledger.models import UsageRecord

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = UsageRecord.objects.filter(request_id=request_id).first()
        if row is not None:
            return row
        time.sleep(0.2)
    raise AssertionError(f"no usage row for {request_id} after {timeout}s")


@pytest.fixture
def tiny_stack(live_stack):
    """The live stack with the tiny model registered as `tiny-gemma4` on its worker's pool."""
    live_stack.register_model()
    return live_stack


def _flush_retrying_deadlocks(handle):
    """Wrap `manage.py flush` (transactional tests' teardown) to retry when PostgreSQL picks it as a
    deadlock victim: the stack's own processes (gateway ledger writes, beat's flush and rollups) may
    still write while the test's teardown truncates every table."""

    def wrapped(self, **options):
        from django.core.management.base import CommandError
        from django.db import OperationalError

        for attempt in range(5):
            try:
                return handle(self, **options)
            except CommandError as exc:
                deadlock = isinstance(exc.__cause__, OperationalError) and "deadlock" in str(exc.__cause__)
                if not deadlock or attempt == 4:
                    raise
                time.sleep(0.5 * (attempt + 1))

    wrapped.retries_deadlocks = True
    return wrapped


@pytest.fixture(scope="module")
def stack_redis_url():
    """The Redis of a module's stack: a database of the suite's Redis (a module may override this)."""
    return urlunparse(urlparse(os.environ["REDIS_URL"])._replace(path=f"/{STACK_REDIS_DB}"))


@pytest.fixture(scope="module")
def stack_database_url(django_db_setup):
    """The PostgreSQL of a module's stack: the test database (a module may override this, e.g. to
    reach it through a proxy it can cut)."""
    from django.conf import settings

    return database_url(settings.DATABASES["default"])


@pytest.fixture(scope="module")
def live_stack(
    django_db_setup, django_db_blocker, tiny_model_dir, tmp_path_factory, stack_redis_url, stack_database_url
):
    from django.core.management.commands import flush

    if not getattr(flush.Command.handle, "retries_deadlocks", False):
        flush.Command.handle = _flush_retrying_deadlocks(flush.Command.handle)
    redis_url = stack_redis_url
    env = stack_env(
        stack_database_url,
        redis_url,
        AUTH_CACHE_SECONDS="30",
        DATABASE_POOL="1",  # as in production
        # Heartbeats come every 2 s; this 2-core machine sometimes stalls every process for 5 s
        # or more under load, so a shorter timeout declares live workers lost.
        WORKER_HEARTBEAT_TIMEOUT="12",
        SSE_KEEPALIVE_SECONDS="1",
        # Renewed every 5 s; lapses 20 s after a web process dies (tests/e2e/test_web_loss.py).
        READER_LEASE_SECONDS="20",
        # Tenants' adapters uploaded by the tests, apart from `make up`'s store.
        ADAPTER_STORE_DIR=str(tmp_path_factory.mktemp("adapter-store")),
    )
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    stack = Stack(env=env, log_dir=tmp_path_factory.mktemp("stack-logs"), model_dir=tiny_model_dir)
    try:
        stack.start_web(WEB_CONCURRENCY="2", timeout=180)
        stack.start_worker()
        stack.start_beat()
        stack.wait_ready()
        yield stack
    finally:
        stack.stop_all()
