"""The web processes' gunicorn worker class (config/gunicorn_worker.py) under real gunicorn.

A process whose threads all hold streams must leave a new connection to a process with a free
thread. Stock gthread accepts it anyway and queues it behind the streams: this test then fails
(the second process's requests do not all start).
"""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.e2e.stack import free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
WORKER_CLASS = "config.gunicorn_worker.StreamingThreadWorker"
THREADS = 2


def _started(folder: Path) -> list[int]:
    return [int(path.read_text()) for path in folder.glob("started-*")]


@pytest.fixture
def gunicorn(tmp_path):
    port = free_port()
    env = dict(os.environ, HOLD_DIR=str(tmp_path), PYTHONPATH=os.pathsep.join([str(ROOT / "platform"), str(ROOT)]))
    command = [sys.executable, "-m", "gunicorn", "tests.local.holding_app:app", "--bind", f"127.0.0.1:{port}",
               "--workers", "1", "--threads", str(THREADS), "--worker-class", WORKER_CLASS]  # fmt: skip
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        yield process, f"http://127.0.0.1:{port}", tmp_path
    finally:
        (tmp_path / "release").touch()
        process.send_signal(signal.SIGTERM)
        process.wait(30)


def _hold_requests(base_url: str, count: int, replies: list) -> list[threading.Thread]:
    def one():
        deadline = time.monotonic() + 60
        while True:
            try:
                replies.append(httpx.get(base_url, timeout=120).status_code)
                return
            except httpx.ConnectError:  # gunicorn not listening yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    threads = [threading.Thread(target=one) for _ in range(count)]
    for thread in threads:
        thread.start()
    return threads


def test_a_process_with_every_thread_busy_leaves_new_connections_to_one_with_free_threads(gunicorn):
    process, base_url, folder = gunicorn
    master = psutil.Process(process.pid)
    wait_until(lambda: len(master.children()) == 1, "gunicorn's first process never started")
    first = master.children()[0].pid
    replies = []
    # Fill every thread of the first process with a held request.
    clients = _hold_requests(base_url, THREADS, replies)
    wait_until(lambda: len(_started(folder)) == THREADS, "the first process did not take its requests")

    # More requests, then a second process (SIGTTIN): the requests must wait for it in the
    # listening socket's backlog and all start there, none queued in the busy first process.
    clients += _hold_requests(base_url, THREADS, replies)
    time.sleep(1)  # not a timed check: it gives the busy process every chance to take them
    process.send_signal(signal.SIGTTIN)
    wait_until(lambda: len(master.children()) == 2, "gunicorn did not start a second process")
    second = next(child.pid for child in master.children() if child.pid != first)
    wait_until(
        lambda: len(_started(folder)) == 2 * THREADS,
        f"a request waits for a thread of the busy process: started by pid {_started(folder)}",
    )
    assert sorted(_started(folder)) == sorted([first] * THREADS + [second] * THREADS)

    (folder / "release").touch()
    for client in clients:
        client.join(60)
    assert replies == [200] * (2 * THREADS)
