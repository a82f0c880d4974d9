"""The platform under test: gunicorn (gateway) → Redis → Celery worker (vLLM engine), plus beat.

The processes are the platform launcher's (deploy/local/launcher.py ``Stack``, as ``make up`` and the
end-to-end tests start them), pinned to the benchmark's serving cores (benchmarks/procs.py). It runs
against its own database (``gemma_bench``, dropped and re-created each run) on the PostgreSQL server
named by DATABASE_URL, and its own Redis database index (BENCH_REDIS_DB, default 12, emptied each
run) on the Redis server named by REDIS_URL; when those are unset the embedded servers of
deploy/local/services.py (in .run/) are used, as ``make up`` and ``make test`` do. The tenant, its API
key and the served model are set up with the project's management commands, as an operator would.

Tuning knobs come from the environment the benchmark runs in (WEB_CONCURRENCY, GATEWAY_THREADS,
BENCH_WORKER_CONCURRENCY, ...) or from ``extra_env``, so a tuning experiment needs no code change.
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse, urlunparse

from benchmarks.gpu.worker_metrics import behind_metrics
from benchmarks.procs import ROOT, STATE_DIR, Child, engine_cpu_env, free_port
from deploy.local.launcher import Stack, stack_env

POOL = "bench"
BENCH_DATABASE = "gemma_bench"
START_TIMEOUT_S = float(os.environ.get("BENCH_ENGINE_START_TIMEOUT", "900"))


def with_database(url: str, name: str) -> str:
    """``url`` pointing at database ``name`` (postgres:// URLs)."""
    return urlunparse(urlparse(url)._replace(path=f"/{name}"))


def with_redis_db(url: str, index: int) -> str:
    return urlunparse(urlparse(url)._replace(path=f"/{index}"))


def recreate_database(server_url: str, name: str) -> None:
    import psycopg

    parsed = urlparse(server_url)
    admin_url = urlunparse(parsed._replace(path="/postgres"))
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')


@dataclass(kw_only=True)
class BenchStack(Stack):
    """The launcher's stack whose processes are pinned to the serving cores (benchmarks/procs.py),
    named ``<label>-<name>`` so that stacks run side by side keep their logs apart."""

    label: str = "platform"

    def new_child(self, name: str, argv: list[str], env: dict[str, str], *, engine: bool = False) -> Child:
        return Child(f"{self.label}-{name}", argv, env, cwd=self.cwd, hosts_engine=engine)


class PlatformStack:
    """The whole platform on local ports; ``base_url`` ends in /v1 and ``api_key`` is a tenant's key."""

    def __init__(
        self, model_dir: str, served_model_name: str, extra_env: dict[str, str] | None = None,
        database: str = BENCH_DATABASE, *, source: Path = ROOT, redis_db: int | None = None,
        label: str = "platform", metrics_port: int | None = None,
    ) -> None:  # fmt: skip
        """``source``: the checkout whose code the processes run (another version of the platform,
        a ``git worktree``, for a side-by-side comparison; the same database schema); ``redis_db``:
        its Redis database (default BENCH_REDIS_DB or 12); ``label`` names its processes;
        ``metrics_port``: the worker serves its process's Prometheus metrics there (the engine's
        steps, benchmarks/gpu/worker_metrics.py)."""
        self.model_dir, self.model_name = str(Path(model_dir).resolve()), served_model_name
        self.metrics_port = metrics_port
        self.database = database  # dropped and re-created on entry
        self.source, self.label = Path(source).resolve(), label
        self.redis_db = int(os.environ.get("BENCH_REDIS_DB", "12")) if redis_db is None else redis_db
        self.stack = BenchStack(env={}, log_dir=STATE_DIR / "logs", port=free_port(), cwd=self.source, label=label)
        self.base_url = f"{self.stack.base_url}/v1"
        self.extra_env = dict(extra_env or {})
        self.worker_concurrency = int(os.environ.get("BENCH_WORKER_CONCURRENCY", "80"))
        self.api_key = ""
        self.services = None

    @property
    def env(self) -> dict[str, str]:
        return self.stack.env

    @property
    def children(self) -> list[Child]:
        """The processes: web, worker, beat."""
        return list(self.stack.children.values())

    # -- setup ------------------------------------------------------------------------------
    def _environment(self) -> dict[str, str]:
        from deploy.local.services import ensure_services

        self.services = ensure_services(ROOT / ".run")
        database_url = with_database(self.services["DATABASE_URL"], self.database)
        redis_url = with_redis_db(self.services["REDIS_URL"], self.redis_db)
        recreate_database(self.services["DATABASE_URL"], self.database)
        import redis

        redis.Redis.from_url(redis_url).flushdb()
        defaults = {
            "DJANGO_DEBUG": "0",
            "ALLOWED_HOSTS": "127.0.0.1,localhost",
            "ENGINE_PROFILE": "cpu",
            "LOG_LEVEL": "WARNING",
        }
        base = {**defaults, **engine_cpu_env(), **os.environ, **self.extra_env}
        env = stack_env(database_url, redis_url, base, SECRET_KEY=secrets.token_urlsafe(48))
        if self.source != ROOT:
            # Before the virtual environment's .pth entries, which name this checkout's source roots.
            env["PYTHONPATH"] = f"{self.source / 'platform'}{os.pathsep}{self.source}"
        return env

    def manage(self, *args: str) -> str:
        return self.stack.manage(*args)

    def _provision(self) -> None:
        self.manage("migrate", "--noinput", "-v", "0")
        self.manage("createtenant", "bench", "--if-not-exists")
        self.api_key = self.manage("createkey", "bench", "--name", "benchmark").strip().splitlines()[-1]
        self.stack.register_model(self.model_name, self.model_dir, POOL)

    def _start(self) -> None:
        """Web, worker, beat (in this order: ``children``); returns once the worker's engine is ready."""
        wrap = (lambda argv: behind_metrics(argv, self.metrics_port)) if self.metrics_port else None
        web = self.stack.start_web(wait=False)
        self.stack.start_worker(
            "worker", POOL, model=self.model_name, model_path=self.model_dir, pod="bench-pod",
            concurrency=self.worker_concurrency, loglevel="WARNING", wrap=wrap,
        )  # fmt: skip
        self.stack.start_beat(STATE_DIR / f"{self.label}-celerybeat-schedule", loglevel="WARNING")
        web.wait_http(f"{self.stack.base_url}/healthz", 120)
        self._wait_worker_ready()

    def _wait_worker_ready(self, since: float = 0.0, timeout: float = START_TIMEOUT_S) -> None:
        """Wait for a ready worker whose last heartbeat is fresh and later than ``since`` (unix time)."""
        self.stack.wait_ready(POOL, timeout=timeout, since=since)

    # -- lifecycle --------------------------------------------------------------------------
    def __enter__(self) -> PlatformStack:
        try:
            self.stack.env = self._environment()
            self._provision()
            self._start()
            for child in self.children:
                child.pin_serving_threads()
        except BaseException:
            self.__exit__()
            raise
        return self

    def pause(self) -> None:
        self.stack.pause()

    def resume(self) -> None:
        """Resume every process and wait for the worker's next heartbeat (the gateway needs it fresh)."""
        resumed = time.time()
        self.stack.resume()
        self._wait_worker_ready(since=resumed, timeout=60)

    def __exit__(self, *exc: object) -> None:
        self.stack.stop_all()
        if self.services is not None:
            self.services.stop()  # only the embedded servers this run started

    def pids(self) -> dict[str, int]:
        """Process ids to profile: gunicorn's master and Celery worker (their children hold the work),
        as ``platform-web``, ``platform-worker`` and ``platform-beat`` (whatever the label)."""
        return {"platform-" + child.name.rpartition("-")[2]: child.pid for child in self.children}
