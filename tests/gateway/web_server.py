"""The web tier under its real server (gunicorn + uvicorn worker, deploy/gunicorn.conf.py), one
process on a free port, for tests that need real sockets."""

import contextlib
import os
from pathlib import Path

import httpx
import psutil

from deploy.local.launcher import Child, free_port, web_command
from tests.e2e.stack import database_url, wait_until


@contextlib.contextmanager
def web_server(log_dir: Path, **env_overrides: str):
    """Yields (base_url, pid of the one worker process); every process of it is gone afterwards
    (a worker still waiting out its graceful timeout on an open stream must not hold the test
    database)."""
    with web_processes(log_dir, 1, **env_overrides) as (base_url, (pid,)):
        yield base_url, pid


@contextlib.contextmanager
def web_processes(log_dir: Path, processes: int, **env_overrides: str):
    """Yields (base_url, the pids of its `processes` worker processes), as `web_server` does."""
    from django.conf import settings

    port = free_port()
    env = dict(
        os.environ,
        DATABASE_URL=database_url(settings.DATABASES["default"]),
        GUNICORN_BIND=f"127.0.0.1:{port}",
        **{"WEB_CONCURRENCY": str(processes), **env_overrides},
    )
    master = Child("gunicorn", web_command(), log_dir / "gunicorn.log", env=env).start()
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _answers(base_url), f"gunicorn never answered; see {log_dir}/gunicorn.log", 180)
        master_process = psutil.Process(master.pid)
        wait_until(lambda: len(master_process.children()) == processes, f"gunicorn never ran {processes} workers", 120)
        yield base_url, [worker.pid for worker in master_process.children()]
    finally:
        master.stop(30, group=False)


def _answers(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/healthz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False
