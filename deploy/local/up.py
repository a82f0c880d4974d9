"""``make up``: the whole platform on one machine, no Docker, no GPU.

Steps, each reusing what an earlier run left in ``.run/``:

1. PostgreSQL and Redis: ``DATABASE_URL`` / ``REDIS_URL`` when given, else embedded servers
   (``deploy.local.services``);
2. migrate, collect static files, build the tiny random-weight Gemma 4 model, register it as
   ``tiny-gemma4`` (pool ``tiny``), the ``admin`` superuser and the ``demo`` tenant;
3. start gunicorn, a Celery worker hosting vLLM on the CPU, and Celery beat as child processes
   (logs in ``.run/logs/``), check or create the demo key, wait for ``/readyz``;
4. print the base URL, the demo key, a curl line and the console login, then run until Ctrl-C,
   SIGINT or SIGTERM, and stop the children and the embedded servers it started.

Every variable of the children can be overridden from the environment (``PORT``, ``SECRET_KEY``,
``DJANGO_DEBUG``, ``WEB_CONCURRENCY``, ``ENGINE_*``...).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from deploy.local.launcher import Stack, http_status, port_open
from deploy.local.services import (
    REPO_ROOT,
    EmbeddedPostgres,
    EmbeddedRedis,
    LocalServices,
    ensure_services,
    pid_alive,
)

# UP_STATE_DIR: another folder for the state (the tests run a whole make up in a temporary one).
STATE_DIR = Path(os.environ.get("UP_STATE_DIR") or REPO_ROOT / ".run").resolve()
LOG_DIR = STATE_DIR / "logs"
# What the running make up started (pids, embedded servers), for the next run after a kill -9.
RUN_FILE = STATE_DIR / "up.json"
# The control plane's settings of this stack, for manage.py in another terminal (see manage.py).
SETTINGS_FILE = STATE_DIR / "settings.json"
CONFIG_DIR = REPO_ROOT / "platform" / "config"
MODEL_ID = "tiny-gemma4"
MODEL_DIR = STATE_DIR / "models" / MODEL_ID
POOL = "tiny"
CONTEXT_LENGTH = 2048
ADMIN_USER = "admin"
DEMO_TENANT = "demo"
STOP_TIMEOUT_S = 20.0
PROGRESS_EVERY_S = 10.0


class Shutdown(BaseException):
    """A stop was asked for (SIGINT/SIGTERM); a BaseException so that no step's error handling eats it."""


class StartError(Exception):
    """A step failed; the message says which and where to look."""


@dataclass
class Up:
    """What this run started: the stack's processes, the embedded servers, the run file."""

    stack: Stack
    services: LocalServices | None = None
    owns_run_file: bool = False

    def stop(self, hurry: Callable[[], bool]) -> None:
        """Stop the children (web first, the engine last), then the embedded servers we started."""
        for child in self.stack.children.values():
            if child.process is not None and child.poll() is None:
                print(f"stopping {child.name}...", flush=True)
        # SIGTERM to each child alone: gunicorn and Celery stop their own processes in order (a
        # worker lets its engine finish the requests in flight); their groups are killed after.
        for child in self.stack.stop_all(timeout=STOP_TIMEOUT_S, group=False, hurry=hurry):
            print(f"{child.name} did not stop in time: killed", flush=True)
        if self.owns_run_file:
            RUN_FILE.unlink(missing_ok=True)
        if self.services is not None and self.services.started:
            print("stopping " + ", ".join(server.name for server in self.services.started) + "...", flush=True)
            self.services.stop()


def main() -> int:
    stopping = {"asked": 0}

    def on_signal(signum: int, frame: object) -> None:
        stopping["asked"] += 1
        if stopping["asked"] == 1:
            raise Shutdown(signal.Signals(signum).name)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    up = Up(Stack(env={}, log_dir=LOG_DIR, port=0))
    code = 0
    try:
        _start(up)
        _serve(up.stack)
    except Shutdown as exc:
        print(f"\n{exc}: shutting down", flush=True)
    except StartError as exc:
        print(f"\nmake up failed: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        # From here on a signal only hurries the stop (a second Ctrl-C skips the graceful wait).
        stopping["asked"] = max(stopping["asked"], 1)
        up.stop(hurry=lambda: stopping["asked"] > 1)
        print("stopped", flush=True)
    return code


def _start(up: Up) -> None:
    """Bring the stack up, recording in ``up`` what was started as it goes (for the stop)."""
    stack = up.stack
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    port = stack.port = _port()
    left_running = _claim_run()
    up.owns_run_file = True
    _step("PostgreSQL and Redis")
    services = up.services = ensure_services(STATE_DIR)
    for server in services.started:
        print(f"  started embedded {server.name} (data in {STATE_DIR})")
    _adopt(services, left_running)
    _record_run(up)
    print(f"  DATABASE_URL={services['DATABASE_URL']}\n  REDIS_URL={services['REDIS_URL']}")
    env = stack.env = _child_env(services, port)
    os.environ.update(stack.env)  # the in-process Django steps below read the same settings
    _save_settings(stack.env)

    _step("database schema, static files")
    _django_setup()
    _manage("migrate", "--noinput", verbosity=0)
    _manage("collectstatic", "--noinput", verbosity=0)
    _step(f"tiny model in {_rel(MODEL_DIR)}")
    _run_logged("tinymodel", [sys.executable, "-m", "workers.tinymodel", str(MODEL_DIR)], stack.env)
    _manage(
        "registermodel",
        MODEL_ID,
        "--path",
        str(MODEL_DIR),
        "--pool",
        POOL,
        "--context-length",
        str(CONTEXT_LENGTH),
    )
    _step("admin user and demo tenant")
    admin_password = _secret_file("admin-password", os.environ.get("ADMIN_PASSWORD"))
    _ensure_superuser(ADMIN_USER, admin_password)
    _manage("createtenant", DEMO_TENANT, "--if-not-exists")
    from django.db import connections

    connections.close_all()

    _step(f"web on {stack.base_url}, Celery worker (vLLM, CPU) and beat")
    if port_open(port):
        raise StartError(f"port {port} is already in use: set PORT to a free port (PORT=8001 make up)")
    stack.start_web(wait=False, GUNICORN_BIND=env["GUNICORN_BIND"])
    stack.start_beat(STATE_DIR / "celerybeat-schedule")
    stack.start_worker("worker", env["WORKER_POOL"], model=env["SERVED_MODEL"], model_path=env["MODEL_PATH"])
    _record_run(up)
    _wait_for(stack, "/healthz", "the web server", timeout=60.0)
    demo_key = _ensure_demo_key(stack)
    _wait_for(stack, "/readyz", "the vLLM engine (30-90 s on first start)", timeout=_ready_timeout())
    _banner(stack, demo_key, admin_password)


def _serve(stack: Stack) -> None:
    """Run until a signal (raises Shutdown) or until a child dies."""
    while True:
        for child in stack.children.values():
            code = child.poll()
            if code is not None:
                raise StartError(
                    f"{child.name} exited with code {code}; last lines of {_rel(child.log_path)}:\n{child.log_tail()}"
                )
        time.sleep(1.0)


def _port() -> int:
    raw = os.environ.get("PORT", "8000").strip() or "8000"
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise StartError(f"PORT must be a TCP port number, got {raw!r}")
    return int(raw)


def _child_env(services: LocalServices, port: int) -> dict[str, str]:
    """The environment of the children: local-development defaults under whatever the user set."""
    defaults = {
        "SECRET_KEY": _secret_file("secret-key", None, nbytes=48),
        "DJANGO_DEBUG": "0",
        "ALLOWED_HOSTS": "127.0.0.1,localhost,[::1]",
        # The console is served over plain http on localhost here.
        "SESSION_COOKIE_SECURE": "0",
        "CSRF_COOKIE_SECURE": "0",
        "GUNICORN_BIND": f"{os.environ.get('HOST', '127.0.0.1')}:{port}",
        "GUNICORN_GRACEFUL_TIMEOUT": "10",
        # A local stack serves one developer: two web processes whatever the cores (each holds ~300 MB,
        # the served models' tokenizers among it), where a server starts one per core.
        "WEB_CONCURRENCY": "2",
        "ENGINE_PROFILE": "cpu",
        "SERVED_MODEL": MODEL_ID,
        "MODEL_PATH": str(MODEL_DIR),
        "WORKER_POOL": POOL,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    env = {**defaults, **os.environ, **services}
    env["PORT"] = str(port)
    env["DJANGO_SETTINGS_MODULE"] = "config.settings"
    return env


def _django_setup() -> None:
    try:
        import django

        django.setup()
    except Exception as exc:  # a configuration error names its variable: show it, not a traceback
        raise StartError(f"Django settings: {type(exc).__name__}: {exc}") from exc


def _manage(*args: str, verbosity: int = 1) -> str:
    """Run a management command in this process; return its output (also appended to setup.log)."""
    from django.core.management import call_command

    out = io.StringIO()
    try:
        call_command(*args, verbosity=verbosity, stdout=out, stderr=out)
    except Exception as exc:
        _append_log("setup", f"manage.py {shlex.join(args)}\n{out.getvalue()}\n{exc!r}\n")
        raise StartError(f"manage.py {args[0]}: {type(exc).__name__}: {exc}") from exc
    _append_log("setup", f"manage.py {shlex.join(args)}\n{out.getvalue()}")
    return out.getvalue()


def _run_logged(name: str, argv: list[str], env: dict[str, str]) -> None:
    result = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=False)
    _append_log("setup", f"{shlex.join(argv)}\n{result.stdout}{result.stderr}")
    if result.returncode != 0:
        raise StartError(f"{name} failed ({result.returncode}):\n{(result.stdout + result.stderr)[-3000:]}")


def _ensure_superuser(username: str, password: str) -> None:
    """Create the superuser, or reset its password to the saved one (the file may be newer than the user)."""
    from django.contrib.auth import get_user_model

    user_model = get_user_model()
    user = user_model._default_manager.filter(**{user_model.USERNAME_FIELD: username}).first()
    if user is None:
        os.environ.setdefault("DJANGO_SUPERUSER_PASSWORD", password)
        _manage("createsuperuser", "--noinput", "--username", username, "--email", f"{username}@localhost")
    elif not user.check_password(password) or not user.is_superuser:
        user.set_password(password)
        user.is_superuser = user.is_staff = user.is_active = True
        user.save()


def _ensure_demo_key(stack: Stack) -> str:
    """The saved demo key when it still authenticates (GET /v1/models answers 200), else a new one."""
    key_file = STATE_DIR / "demo-key"
    if key_file.exists():
        key = key_file.read_text().strip()
        status = http_status(stack.base_url + "/v1/models", {"Authorization": f"Bearer {key}"})
        if status == 200:
            print(f"  demo key: reusing {_rel(key_file)}")
            return key
        if status not in (401, 403):
            raise StartError(f"GET /v1/models answered {status} (see {_rel(LOG_DIR / 'web.log')})")
        print(f"  the saved demo key is refused ({status}): creating a new one")
    output = _manage("createkey", DEMO_TENANT, "--name", "make up demo key")
    from django.db import connections

    connections.close_all()
    key = output.strip().splitlines()[-1].strip()
    _write_private(key_file, key)
    return key


def _wait_for(stack: Stack, path: str, what: str, timeout: float) -> None:
    started = time.monotonic()
    last_report = started
    reported: set[str] = set()
    print(f"  waiting for {what}...", flush=True)
    while http_status(stack.base_url + path) != 200:
        _check_children(stack, what)
        elapsed = time.monotonic() - started
        if elapsed > timeout:
            raise StartError(f"{what} not ready after {elapsed:.0f} s: see {_rel(LOG_DIR)}/*.log")
        if time.monotonic() - last_report >= PROGRESS_EVERY_S:
            last_report = time.monotonic()
            print(
                f"  ... {elapsed:.0f} s ({path} not ready yet; tail -f {_rel(LOG_DIR / 'worker.log')})",
                flush=True,
            )
            # A child that logs an error but keeps running (an engine that failed to start in a
            # worker that stays up) would otherwise only show as a wait that never ends.
            # Not the web log: it records each of our own /readyz polls as a 503 error.
            for child in stack.children.values():
                if child.name == "web":
                    continue
                for line in child.errors():
                    if line not in reported:
                        reported.add(line)
                        print(f"  {child.name}: {line[:300]}", flush=True)
        time.sleep(0.5)
    print(f"  ready after {time.monotonic() - started:.0f} s", flush=True)


def _check_children(stack: Stack, what: str) -> None:
    for child in stack.children.values():
        code = child.poll()
        if code is not None:
            raise StartError(
                f"{child.name} exited with code {code} while waiting for {what}; "
                f"last lines of {_rel(child.log_path)}:\n{child.log_tail()}"
            )


def _ready_timeout() -> float:
    raw = os.environ.get("UP_READY_TIMEOUT", "600")
    try:
        return float(raw)
    except ValueError:
        raise StartError(f"UP_READY_TIMEOUT must be a number of seconds, got {raw!r}") from None


def _banner(stack: Stack, key: str, admin_password: str) -> None:
    body = json.dumps({"model": MODEL_ID, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32})
    curl = (
        f"curl {stack.base_url}/v1/chat/completions -H 'Authorization: Bearer {key}' "
        f"-H 'Content-Type: application/json' -d '{body}'"
    )
    print(
        "\n"
        "The platform is up (tiny random-weight model: its replies are gibberish).\n"
        f"  Base URL:  {stack.base_url}/v1\n"
        f"  API key:   {key}   (tenant {DEMO_TENANT!r}, saved in {_rel(STATE_DIR / 'demo-key')})\n"
        f"  Try:       {curl}\n"
        f"  Console:   {stack.base_url}/console/   login {ADMIN_USER} / {admin_password}\n"
        f"  Admin:     {stack.base_url}/admin/   (Django admin, same login)\n"
        f"  Logs:      {_rel(LOG_DIR)}/web.log, worker.log, beat.log\n"
        "Ctrl-C stops everything.\n",
        flush=True,
    )


# --- state files -------------------------------------------------------------------------------


def _secret_file(name: str, given: str | None, nbytes: int = 12) -> str:
    """``given`` when set, else the value saved in .run/<name>, else a new random one saved there."""
    if given:
        return given
    path = STATE_DIR / name
    if path.exists() and path.read_text().strip():
        return path.read_text().strip()
    value = secrets.token_urlsafe(nbytes)
    _write_private(path, value)
    return value


def _save_settings(env: dict[str, str]) -> None:
    """Write the variables the settings read (platform/config/), as this stack sets them, to SETTINGS_FILE: an
    operator's ``python manage.py createtenant`` in another terminal then talks to this stack's
    database and Redis and stores keys under the same HMAC key, with nothing exported by hand."""
    sources = "".join(path.read_text() for path in sorted(CONFIG_DIR.glob("*.py")))
    names = set(re.findall(r'env_\w+\(\s*"([A-Z][A-Z0-9_]*)"', sources))
    names |= {f"{name}_FILE" for name in names}
    settings = {name: env[name] for name in sorted(names) if name in env}
    _write_private(SETTINGS_FILE, json.dumps(settings, indent=1))


def _write_private(path: Path, value: str) -> None:
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_text(value + "\n")


def _append_log(name: str, text: str) -> None:
    with open(LOG_DIR / f"{name}.log", "a") as log:
        log.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n")


def _claim_run() -> list[str]:
    """Take the checkout for this run: one ``make up`` at a time (they would fight over the port).

    An earlier run killed without cleaning up (kill -9) left its children running: kill them. It
    may also have left the embedded servers it started running: return their names, so that this
    run stops them when it stops, as that run would have.
    """
    try:
        previous = json.loads(RUN_FILE.read_text())
    except (OSError, ValueError):
        previous = {}
    other = previous.get("pid")
    if other and other != os.getpid() and pid_alive(other) and "deploy.local.up" in _cmdline(other):
        raise StartError(f"make up is already running here (pid {other}); stop it first")
    for name, pid in previous.get("children", {}).items():
        cmdline = _cmdline(pid)
        if pid_alive(pid) and ("gunicorn" in cmdline or "celery" in cmdline):
            print(f"  killing the {name} (pid {pid}) left by an earlier run", flush=True)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
    RUN_FILE.write_text(json.dumps({"pid": os.getpid()}))
    return list(previous.get("services", []))


def _adopt(services: LocalServices, names: list[str]) -> None:
    """Count the embedded servers an earlier, killed run started as started by this one."""
    for server in (EmbeddedPostgres(STATE_DIR), EmbeddedRedis(STATE_DIR)):
        already = any(started.name == server.name for started in services.started)
        if server.name in names and not already and server.running_url() in services.values():
            print(f"  embedded {server.name}: left running by an earlier run, reusing it")
            services.started.append(server)


def _record_run(up: Up) -> None:
    record = {
        "pid": os.getpid(),
        "children": {child.name: child.process.pid for child in up.stack.children.values() if child.process},
        "services": [server.name for server in up.services.started] if up.services else [],
    }
    RUN_FILE.write_text(json.dumps(record))


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


# --- small helpers -----------------------------------------------------------------------------


def _step(text: str) -> None:
    print(f"==> {text}", flush=True)


def _rel(path: Path) -> str:
    try:
        return str(path.relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    sys.exit(main())
