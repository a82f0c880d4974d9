"""A real S3-compatible server for the adapter store's tests: moto's standalone S3 server
(`python -m moto.server`, from the dev requirements), started as a process of its own on a free
loopback port. No MinIO server binary can be installed here (PyPI, Debian and npm carry only
clients); docker-compose and the chart run MinIO itself."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

ACCESS_KEY = "test-access-key"
SECRET_KEY = "test-secret-key"
START_SECONDS = 60


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def s3_server() -> Iterator[str]:
    """Run the server; yields its endpoint URL (http://127.0.0.1:PORT)."""
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_SECONDS
        while True:  # until it answers (or exits, or the bound passes)
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=5).close()
                break
            except (urllib.error.URLError, ConnectionError):
                if process.poll() is not None:
                    raise RuntimeError(f"the S3 server exited: {process.stderr.read().decode()[-2000:]}") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the S3 server did not answer within {START_SECONDS} s") from None
                time.sleep(0.1)
        yield endpoint
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
