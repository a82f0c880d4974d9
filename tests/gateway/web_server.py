"""The web tier under its real server (gunicorn + uvicorn worker, deploy/gunicorn.conf.py), one
process on a free port, for tests that need real sockets."""

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import psutil

from tests.e2e.stack import database_url, free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def web_server(log_dir: Path, **env_overrides: str):
    """Yields (base_url, pid of the one worker process); every process of it is gone afterwards
    (a worker still waiting out its graceful timeout on an open stream must not hold the test
    database)."""
    from django.conf import settings

    port = free_port()
    env = dict(
        os.environ,
        DATABASE_URL=database_url(settings.DATABASES["default"]),
        PYTHONPATH=os.pathsep.join([str(ROOT / "platform"), str(ROOT)]),
        GUNICORN_BIND=f"127.0.0.1:{port}",
        WEB_CONCURRENCY="1",
        **env_overrides,
    )
    log = open(log_dir / "gunicorn.log", "ab")  # noqa: SIM115
    master = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "-c", "deploy/gunicorn.conf.py"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _answers(base_url), f"gunicorn never answered; see {log_dir}/gunicorn.log", 180)
        (worker,) = psutil.Process(master.pid).children()
        yield base_url, worker.pid
    finally:
        master.terminate()
        try:
            master.wait(30)
        except subprocess.TimeoutExpired:
            master.kill()
            master.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(master.pid, signal.SIGKILL)
        log.close()


def _answers(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/healthz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False
