"""A WSGI app for the gunicorn worker test: each request says it started, then holds its thread
until the test releases it (a file appears), like an SSE stream relaying a long generation."""

import os
import time
import uuid
from pathlib import Path


def app(environ, start_response):
    folder = Path(os.environ["HOLD_DIR"])
    (folder / f"started-{uuid.uuid4().hex}").write_text(str(os.getpid()))
    deadline = time.monotonic() + 120
    while not (folder / "release").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [str(os.getpid()).encode()]
