"""The live stack for end-to-end tests: gunicorn → Redis → Celery worker → vLLM (tiny model, CPU).

One stack per test module (the engine takes tens of seconds to start; a fresh stack per module keeps
one module's leftovers from slowing the next). It uses the pytest-django
test database and its own Redis database index, so unit tests that flush their Redis database do
not disturb it. Tests that use it must commit their data (`transactional_db`).
"""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse, urlunparse

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
POOL = "tiny"
STACK_REDIS_DB = os.environ.get("E2E_REDIS_DB", "14")
ENGINE_START_TIMEOUT = float(os.environ.get("E2E_ENGINE_START_TIMEOUT", "600"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def database_url(settings_dict: dict) -> str:
    user = settings_dict["USER"] or "postgres"
    password = f":{settings_dict['PASSWORD']}" if settings_dict["PASSWORD"] else ""
    host = settings_dict["HOST"] or "127.0.0.1"
    port = settings_dict["PORT"] or "5432"
    return f"postgres://{user}{password}@{host}:{port}/{settings_dict['NAME']}"


@dataclass
class Stack:
    base_url: str
    env: dict
    model_dir: Path
    log_dir: Path
    procs: dict = field(default_factory=dict)

    @property
    def redis_url(self) -> str:
        return self.env["REDIS_URL"]

    def manage(self, *args: str) -> str:
        """Run a management command against the stack's database and Redis; returns stdout."""
        result = subprocess.run(
            [sys.executable, "manage.py", *args], cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=120
        )
        if result.returncode != 0:
            raise AssertionError(f"manage.py {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
        return result.stdout

    def register_model(self, model_id: str = "tiny-gemma4", pool: str = POOL) -> None:
        """Register the tiny model under `model_id` on `pool` (idempotent)."""
        self.manage(
            "registermodel", model_id, "--path", str(self.model_dir), "--pool", pool, "--context-length", "2048"
        )

    def worker_command(self, name: str, pool: str, concurrency: int = 64, queues: str = "") -> list[str]:
        queues = queues or f"pool.{pool},control"
        return [
            sys.executable, "-m", "celery", "-A", "workers.celery_app", "worker", "--pool", "threads",
            "--concurrency", str(concurrency), "-Q", queues, "-n", f"{name}@%h", "--loglevel", "INFO",
        ]  # fmt: skip

    def worker_env(self, name: str, pool: str, model_path: str | None = None) -> dict:
        return dict(
            self.env,
            SERVED_MODEL="tiny-gemma4",
            MODEL_PATH=model_path or str(self.model_dir),
            WORKER_POOL=pool,
            ENGINE_PROFILE="cpu",
            POD_NAME=f"{name}-pod",
        )

    def start_worker(self, name: str = "e2e", pool: str = POOL, concurrency: int = 64) -> subprocess.Popen:
        log = open(self.log_dir / f"worker-{name}.log", "ab")  # noqa: SIM115
        proc = subprocess.Popen(
            self.worker_command(name, pool, concurrency),
            cwd=ROOT,
            env=self.worker_env(name, pool),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs[f"worker-{name}"] = proc
        return proc

    def start_beat(self) -> None:
        log = open(self.log_dir / "beat.log", "ab")  # noqa: SIM115
        self.procs["beat"] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "workers.celery_app",
                "beat",
                "--loglevel",
                "INFO",
                "--schedule",
                str(self.log_dir / "beat-schedule"),
            ],
            cwd=ROOT,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, pool: str = POOL, timeout: float = ENGINE_START_TIMEOUT) -> None:
        import redis

        client = redis.Redis.from_url(self.redis_url, decode_responses=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            names = client.zrangebyscore(f"pool:{pool}:workers", time.time() - 10, "+inf")
            if any(client.hget(f"worker:{n}", "state") == "ready" for n in names):
                return
            for key, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{key} exited with {proc.returncode}; see {self.log_dir}")
            time.sleep(1)
        raise TimeoutError(f"no ready worker on pool {pool} after {timeout}s; see {self.log_dir}")

    def stop(self, key: str, sig=signal.SIGTERM, timeout: float = 30) -> None:
        proc = self.procs.pop(key)
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        # Whatever the process left in its group (vLLM's engine processes) must not outlive it: an
        # orphaned engine keeps polling and takes CPU from the tests that follow.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    def stop_all(self) -> None:
        for key in list(self.procs):
            self.stop(key)


def _start_gunicorn(stack: Stack, port: int) -> None:
    log = open(stack.log_dir / "gunicorn.log", "ab")  # noqa: SIM115
    stack.procs["gunicorn"] = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "-c", "deploy/gunicorn.conf.py"],
        cwd=ROOT,
        env=dict(stack.env, GUNICORN_BIND=f"127.0.0.1:{port}", WEB_CONCURRENCY="2"),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{stack.base_url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.3)
    raise TimeoutError(f"gunicorn did not answer /healthz; see {stack.log_dir}/gunicorn.log")


def engine_processes(stack: Stack, worker: str = "worker-e2e") -> list:
    """The worker's vLLM engine processes (EngineCore and its compute worker): to pause and resume."""
    import psutil

    process = psutil.Process(stack.procs[worker].pid)
    return [child for child in process.children(recursive=True) if child.name().startswith("VLLM::")]


def requests_in_flight(stack: Stack, pool: str = POOL) -> int:
    """What the pool's workers reported in their last heartbeat (every 2 s): tasks they are running."""
    import redis

    from workers import protocol

    client = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    names = client.zrange(protocol.pool_workers_key(pool), 0, -1)
    return sum(int(client.hget(protocol.worker_key(name), "in_flight") or 0) for name in names)


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

    @contextlib.contextmanager
    def resumed(self):
        self.resume()
        try:
            yield
        finally:
            self.suspend()


@contextlib.contextmanager
def engine_paused(stack: Stack, worker: str = "worker-e2e"):
    """The worker's engine stopped (SIGSTOP) inside the block: requests are taken but make no progress."""
    engine = PausedEngine(engine_processes(stack, worker))
    assert engine.processes, f"no vLLM engine process under {worker}"
    engine.suspend()
    try:
        yield engine
    finally:
        engine.resume()


def disconnect_mid_stream(stack: Stack, key: str, body: dict) -> httpx.Headers:
    """Stream a chat completion and go away while the worker generates it; return the reply's
    headers once the gateway has told the worker to stop.

    The engine is paused except while it makes the request's first tokens: left running, it can
    finish a short request before a client on a loaded machine has read the first line, and the
    client then leaves a request that already ended; paused throughout, the worker stops the request
    before it generated anything, and there is nothing to bill.
    """
    import redis

    from workers import protocol

    client = redis.Redis.from_url(stack.redis_url, decode_responses=True)

    def relayed(kind: str, request_id: str):
        return lambda: any(f["t"] == kind for _, f in client.xrange(protocol.events_key(request_id)))

    with engine_paused(stack) as engine:
        with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", json=dict(body, stream=True),
                          headers={"Authorization": f"Bearer {key}"}, timeout=60) as response:  # fmt: skip
            assert response.status_code == 200, response.read()
            headers, request_id = response.headers, response.headers["x-request-id"]
            lines = response.iter_lines()  # held: a dropped line iterator closes the connection
            next(line for line in lines if line.startswith("data: {"))  # the role chunk
            wait_until(relayed("start", request_id), "the worker never took the request")
            with engine.resumed():
                wait_until(relayed("delta", request_id), "the engine generated nothing")
        # The gateway notices the client is gone at once (the server reads the closed connection),
        # at the latest at its next keep-alive write. Bounded generously: on a 2-core machine beside
        # busy loops the notice has come late or not at all (docs/reliability.md, known limits).
        wait_until(
            lambda: client.exists(protocol.cancel_key(request_id)), "the gateway never cancelled the request", 120
        )
    return headers


def wait_until(condition, what: str, timeout: float = 30) -> None:
    """Poll `condition` until true; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
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
def live_stack(django_db_setup, django_db_blocker, tiny_model_dir, tmp_path_factory, stack_redis_url):
    from django.conf import settings
    from django.core.management.commands import flush

    if not getattr(flush.Command.handle, "retries_deadlocks", False):
        flush.Command.handle = _flush_retrying_deadlocks(flush.Command.handle)
    port = free_port()
    redis_url = stack_redis_url
    env = dict(
        os.environ,
        DATABASE_URL=database_url(settings.DATABASES["default"]),
        REDIS_URL=redis_url,
        PYTHONPATH=os.pathsep.join([str(ROOT / "platform"), str(ROOT)]),
        AUTH_CACHE_SECONDS="30",
        DATABASE_POOL="1",  # as in production
        # Heartbeats come every 2 s; this 2-core machine sometimes stalls every process for 5 s
        # or more under load, so a shorter timeout declares live workers lost.
        WORKER_HEARTBEAT_TIMEOUT="12",
        SSE_KEEPALIVE_SECONDS="1",
        # Renewed every 5 s; lapses 20 s after a web process dies (tests/e2e/test_web_loss.py).
        READER_LEASE_SECONDS="20",
        PYTHONUNBUFFERED="1",
    )
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    stack = Stack(
        base_url=f"http://127.0.0.1:{port}",
        env=env,
        model_dir=tiny_model_dir,
        log_dir=tmp_path_factory.mktemp("stack-logs"),
    )
    try:
        _start_gunicorn(stack, port)
        stack.start_worker()
        stack.start_beat()
        stack.wait_ready()
        yield stack
    finally:
        stack.stop_all()
