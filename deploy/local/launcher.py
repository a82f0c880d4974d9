"""The platform's processes on one machine: what ``make up``, the benchmarks and the end-to-end tests start.

The same commands everywhere: gunicorn with ``deploy/gunicorn.conf.py`` (the web tier), Celery workers
on ``workers.worker`` (one vLLM engine per process when SERVED_MODEL is set) and Celery beat. Each runs
as a ``Child``: in its own session, so that a Ctrl-C in a terminal reaches only the launcher, which
stops the children in order, and so that the process group holds whatever a child spawns (vLLM's
engine core), killed with it; its output is appended to a log file.

Every process of the stack is a ``sys.executable`` of the virtual environment, where ``make venv``
puts the source roots (``platform/`` and the repository) on the path: no child needs PYTHONPATH.

``Stack`` holds a running set of them and the steps around them: provisioning with the management
commands, the web tier, any number of Celery workers per pool, beat, readiness waits, pause, resume
and stop. ``make up`` (deploy/local/up.py), the benchmarks (benchmarks/platform_stack.py) and the
end-to-end tests (tests/e2e/stack.py) each build one with their own environment and state folder.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from deploy.local.services import REPO_ROOT, free_port, port_open

__all__ = [
    "CELERY_APP",
    "REPO_ROOT",
    "Child",
    "Stack",
    "beat_command",
    "free_port",
    "http_status",
    "manage",
    "port_open",
    "stack_env",
    "stop_all",
    "wait_worker_ready",
    "web_command",
    "worker_command",
    "worker_env",
]

# The Celery worker's entry module (the app plus the worker runtime's signal handlers); the web tier
# imports only workers.celery_app, to send tasks.
CELERY_APP = "workers.worker"
# A log line that says something failed (Python logging levels, exceptions' last lines).
_ERROR_LINE = re.compile(r"\b(ERROR|CRITICAL)\b|^\w+(\.\w+)*(Error|Exception): ")


def web_command() -> list[str]:
    """gunicorn serving the ASGI application; every setting comes from the environment (GUNICORN_BIND...)."""
    return [sys.executable, "-m", "gunicorn", "-c", "deploy/gunicorn.conf.py"]


def worker_command(
    name: str, queues: str, concurrency: int, loglevel: str = "INFO", app: str = CELERY_APP
) -> list[str]:
    """A Celery worker named ``name@<host>`` on ``queues`` (comma-separated), ``concurrency`` task threads;
    ``app``: the module ``celery -A`` loads (a test may wrap the worker's in one of its own).

    Threads, not prefork: the engine lives on an event loop in a background thread and every task
    thread hands it a request (a prefork child, daemonic, cannot start vLLM's engine process).
    """
    return [
        sys.executable, "-m", "celery", "-A", app, "worker", "--pool", "threads",
        "--concurrency", str(concurrency), "-Q", queues, "-n", f"{name}@%h", "--loglevel", loglevel,
    ]  # fmt: skip


def worker_env(
    env: dict[str, str], pool: str, *, model: str, model_path: str | Path, pod: str | None = None, **own: str
) -> dict[str, str]:
    """A worker's environment: ``env``, its engine's model and pool, ``pod`` (what a drain names; by
    default ``env``'s POD_NAME, else the host's name) and ``own`` on top."""
    engine = {"SERVED_MODEL": model, "MODEL_PATH": str(model_path), "WORKER_POOL": pool}
    if pod is not None:
        engine["POD_NAME"] = pod
    return {**env, **engine, **own}


def beat_command(schedule: Path, loglevel: str = "INFO") -> list[str]:
    """Celery beat (the periodic ledger flush, reaper, rollups), its schedule state in ``schedule``."""
    return [sys.executable, "-m", "celery", "-A", "workers.celery_app", "beat", "--loglevel", loglevel,
            "--schedule", str(schedule)]  # fmt: skip


def manage(env: dict[str, str], *args: str, timeout: float = 300) -> str:
    """Run ``manage.py args`` in a new process with ``env``; its standard output. RuntimeError on failure."""
    result = subprocess.run(
        [sys.executable, "manage.py", *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    if result.returncode != 0:
        raise RuntimeError(f"manage.py {shlex.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return result.stdout


def http_status(url: str, headers: dict[str, str] | None = None, timeout: float = 5) -> int | None:
    """The HTTP status of a GET on a local server (``url`` is always http://127.0.0.1...), None if down."""
    request = urllib.request.Request(url, headers=headers or {})  # noqa: S310
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, ValueError):
        return None


@dataclass
class Child:
    """One process of the stack. ``cpus``: the cores it (and what it spawns) may run on, None for all."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    cwd: Path = REPO_ROOT
    cpus: set[int] | None = None
    process: subprocess.Popen | None = field(default=None, repr=False)
    log_offset: int = 0  # where this run's output starts in the (appended) log

    def start(self, env: dict[str, str] | None = None) -> Child:
        if env is not None:
            self.env = env
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cpus = self.cpus
        with open(self.log_path, "ab") as log:
            self.log_offset = log.tell()
            log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(self.argv)}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                self.argv,
                cwd=self.cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,  # noqa: PLW1509
            )
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None, f"{self.name} was never started"
        return self.process.pid

    def poll(self) -> int | None:
        """Its exit code once it has exited, else None (also None before it starts)."""
        return None if self.process is None else self.process.poll()

    def check_alive(self) -> None:
        code = self.poll()
        if code is not None:
            raise RuntimeError(
                f"{self.name} exited with code {code}; last lines of {self.log_path}:\n" + self.log_tail()
            )

    def errors(self) -> list[str]:
        """The lines of this run's log that report an error."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self.log_offset)
                text = log.read().decode(errors="replace")
        except OSError:
            return []
        return [line.strip() for line in text.splitlines() if _ERROR_LINE.search(line)]

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait_http(self, url: str, timeout: float, headers: dict[str, str] | None = None) -> None:
        """Wait until GET ``url`` answers 200; fails at once if the process exits."""
        deadline = time.monotonic() + timeout
        while http_status(url, headers, timeout=2) != 200:
            self.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} did not answer {url} within {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.3)

    def send(self, signum: int, group: bool = True) -> None:
        """``signum`` to the whole process group, or to the child alone (``group=False``)."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if group:
                os.killpg(self.process.pid, signum)
            else:
                self.process.send_signal(signum)

    def pause(self) -> None:
        """SIGSTOP the whole group (the engine's processes included): it uses no CPU until resumed."""
        if self.poll() is None:
            self.send(signal.SIGSTOP)

    def resume(self) -> None:
        if self.poll() is None:
            self.send(signal.SIGCONT)

    def stop(self, timeout: float = 30, sig: int = signal.SIGTERM, group: bool = True) -> None:
        """Stop it: ``sig`` (to the group, or to the child alone, which then stops its own children),
        SIGKILL after ``timeout`` seconds; whatever it left in its group is killed too."""
        stop_all([self], timeout=timeout, sig=sig, group=group)


def stop_all(
    children: Iterable[Child],
    *,
    timeout: float = 30,
    sig: int = signal.SIGTERM,
    group: bool = True,
    hurry: Callable[[], bool] = lambda: False,
) -> list[Child]:
    """Stop ``children`` together: ``sig`` to each, then wait for them all until one deadline (or
    until ``hurry()``), SIGKILL for the rest. Returns the children that had to be killed.

    An orphaned vLLM engine would keep polling and take the CPU from whatever runs next, so every
    child's process group is killed at the end, whatever the child did with ``sig``.
    """
    started = [child for child in children if child.process is not None]
    for child in started:
        if child.poll() is None:
            child.send(sig, group=group)
            child.send(signal.SIGCONT)  # a paused group acts on the signal only once resumed
    deadline = time.monotonic() + timeout
    killed = []
    for child in started:
        assert child.process is not None
        while child.poll() is None and time.monotonic() < deadline and not hurry():
            time.sleep(0.1)
        if child.poll() is None:
            killed.append(child)
        child.send(signal.SIGKILL)
        child.process.wait()
    return killed


def wait_worker_ready(
    redis_url: str,
    pool: str,
    *,
    timeout: float,
    since: float = 0.0,
    children: Iterable[Child] = (),
    count: int = 1,
) -> None:
    """Wait until ``count`` workers of ``pool`` heartbeat (after ``since``, unix seconds) with their
    engine ready; fails at once if one of ``children`` exits."""
    import redis

    from contract import protocol

    children = list(children)
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for child in children:
                child.check_alive()
            fresh = protocol.fresh_workers(client, pool, since=max(since, time.time() - 10))
            if sum(record.get("state") == "ready" for record in fresh.values()) >= count:
                return
            time.sleep(0.3)
    finally:
        client.close()
    raise TimeoutError(f"fewer than {count} workers of pool {pool} became ready within {timeout:.0f} s")


@dataclass
class Stack:
    """The platform's processes on local ports: gunicorn on ``port``, Celery workers, beat.

    ``env`` is every child's environment (DATABASE_URL, REDIS_URL, SECRET_KEY...; ``stack_env``
    makes one); each process adds its own variables on top. Children are named: ``web``, ``beat``
    and each worker's name, their output appended to ``log_dir/<name>.log``. ``cwd``: the checkout
    whose code they run.

    A stack with P workers of one pool and the web tier's own settings (a routing policy, say)::

        stack = Stack(stack_env(database_url, redis_url), log_dir=Path(".run/fleet/logs"))
        try:
            stack.manage("migrate", "--noinput")
            stack.register_model("tiny-gemma4", model_dir, pool="tiny")
            stack.start_web(ROUTING_POLICY="prefix")
            for index in range(P):
                stack.start_worker(f"w{index}", "tiny", model="tiny-gemma4", model_path=model_dir)
            stack.start_beat()
            stack.wait_ready("tiny", count=P)
            ...  # requests to stack.base_url + "/v1"
        finally:
            stack.stop_all()

    Each ``start_worker`` is a process of its own with its own engine (the Celery node ``name@host``);
    keyword arguments of ``start_web`` and ``start_worker`` are environment variables of that process.
    """

    env: dict[str, str]
    log_dir: Path
    port: int = field(default_factory=free_port)
    cwd: Path = REPO_ROOT
    children: dict[str, Child] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def redis_url(self) -> str:
        return self.env["REDIS_URL"]

    # -- provisioning ------------------------------------------------------------------------
    def manage(self, *args: str, timeout: float = 300) -> str:
        """``manage.py args`` against the stack's database and Redis; its standard output."""
        return manage(self.env, *args, timeout=timeout)

    def register_model(self, model: str, path: str | Path, pool: str, context_length: int = 2048) -> None:
        """Register (or update) ``model``, its weights in ``path``, served by the workers of ``pool``."""
        self.manage(
            "registermodel", model, "--path", str(path), "--pool", pool, "--context-length", str(context_length)
        )

    # -- processes ---------------------------------------------------------------------------
    def new_child(self, name: str, argv: list[str], env: dict[str, str], *, engine: bool = False) -> Child:
        """The ``Child`` for a process (``engine``: it hosts a vLLM engine); a subclass may pin it."""
        return Child(name, argv, self.log_dir / f"{name}.log", env=env, cwd=self.cwd)

    def start(self, name: str, argv: list[str], env: dict[str, str], *, engine: bool = False) -> Child:
        """Start a process of the stack under ``name``, unique among the running ones."""
        running = self.children.get(name)
        if running is not None and running.poll() is None:
            raise ValueError(f"a process named {name!r} is already running in this stack")
        # Recorded before it starts, so that a stop interrupting the start still finds it.
        child = self.children[name] = self.new_child(name, argv, env, engine=engine)
        return child.start()

    def start_web(self, *, wait: bool = True, timeout: float = 120, **env: str) -> Child:
        """gunicorn on ``port``; ``env``: its own variables (WEB_CONCURRENCY, ROUTING_POLICY...).
        With ``wait``, returns once ``/healthz`` answers."""
        web = self.start("web", web_command(), {**self.env, "GUNICORN_BIND": f"127.0.0.1:{self.port}", **env})
        if wait:
            web.wait_http(f"{self.base_url}/healthz", timeout)
        return web

    def start_worker(
        self,
        name: str,
        pool: str,
        *,
        model: str,
        model_path: str | Path,
        concurrency: int = 64,
        queues: str = "",
        app: str = CELERY_APP,
        loglevel: str = "INFO",
        pod: str | None = None,
        wrap: Callable[[list[str]], list[str]] | None = None,
        **env: str,
    ) -> Child:
        """A Celery worker ``name`` of ``pool``, its own process and vLLM engine serving ``model``;
        callable again for more workers of the same pool. ``queues``: what it consumes (default the
        pool's queue and ``control``); ``app``: the module ``celery -A`` loads; ``wrap``: a function of
        its command line (a benchmark's wrapper around Celery); ``env``: its own variables."""
        argv = worker_command(name, queues or f"pool.{pool},control", concurrency, loglevel=loglevel, app=app)
        own_env = worker_env(self.env, pool, model=model, model_path=model_path, pod=pod, **env)
        return self.start(name, wrap(argv) if wrap else argv, own_env, engine=True)

    def start_beat(self, schedule: Path | None = None, loglevel: str = "INFO") -> Child:
        """Celery beat, its schedule state in ``schedule`` (default beside the logs)."""
        schedule = schedule or self.log_dir / "celerybeat-schedule"
        return self.start("beat", beat_command(schedule, loglevel), self.env)

    # -- readiness, pause, stop --------------------------------------------------------------
    def wait_ready(self, pool: str, *, count: int = 1, timeout: float = 600, since: float = 0.0) -> None:
        """Wait until ``count`` workers of ``pool`` heartbeat (after ``since``, unix seconds) with their
        engine ready; fails at once if a process of the stack exits."""
        wait_worker_ready(
            self.redis_url, pool, timeout=timeout, since=since, children=self.children.values(), count=count
        )

    def pause(self) -> None:
        """SIGSTOP every process (engines included): the stack uses no CPU until ``resume``."""
        for child in self.children.values():
            child.pause()

    def resume(self) -> None:
        """SIGCONT every process; a worker is fresh again for the gateway at its next heartbeat
        (``wait_ready(pool, since=...)`` waits for it)."""
        for child in self.children.values():
            child.resume()

    def stop(self, name: str, sig: int = signal.SIGTERM, timeout: float = 30) -> None:
        """Stop one process (its whole group, vLLM's engine processes included)."""
        self.children.pop(name).stop(timeout, sig=sig)

    def stop_all(
        self, *, timeout: float = 30, group: bool = True, hurry: Callable[[], bool] = lambda: False
    ) -> list[Child]:
        """Stop every process together (see ``stop_all``); the ones that had to be killed."""
        killed = stop_all(self.children.values(), timeout=timeout, group=group, hurry=hurry)
        self.children.clear()
        return killed


def stack_env(database_url: str, redis_url: str, base: Mapping[str, str] | None = None, **env: str) -> dict[str, str]:
    """The environment of a stack's processes: ``base`` (default this process's), the stack's
    database and Redis, and ``env`` on top."""
    return {
        **(os.environ if base is None else base),
        "DJANGO_SETTINGS_MODULE": "config.settings",
        "PYTHONUNBUFFERED": "1",
        "DATABASE_URL": database_url,
        "REDIS_URL": redis_url,
        **env,
    }
