"""Graceful drain and the worker probe: what Kubernetes runs in a GPU worker's pod."""

import json
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.e2e.stack import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

POOL = "draining"
MODEL = "tiny-drain"
POD = "drain-pod"


def pod_command(stack, module: str, **env) -> subprocess.CompletedProcess:
    env = dict(stack.env, WORKER_POOL=POOL, POD_NAME=POD, **env)
    return subprocess.run(
        [sys.executable, "-m", module], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_the_probe_follows_the_engine_and_a_drain_waits_for_in_flight_streams(live_stack, make_tenant):
    stack = live_stack
    stack.register_model(MODEL, pool=POOL)
    _, key = make_tenant("alice")
    assert pod_command(stack, "workers.probe").returncode == 1  # no worker yet
    stack.start_worker(name="drain", pool=POOL, concurrency=4)
    try:
        stack.wait_ready(pool=POOL)
        assert pod_command(stack, "workers.probe").returncode == 0

        finished, streaming = {}, threading.Event()

        def long_request():
            # Streamed, so the test knows when the worker is generating (the first token arrived).
            body = {"model": MODEL, "prompt": "Go", "max_tokens": 1900, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            with httpx.stream("POST", f"{stack.base_url}/v1/completions", json=body, timeout=120,
                              headers={"Authorization": f"Bearer {key}"}) as response:  # fmt: skip
                finished["status"] = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        streaming.set()
                        chunk = json.loads(line[6:])
                        finished["usage"] = chunk.get("usage") or finished.get("usage")
                        finished["error"] = chunk.get("error") or finished.get("error")
            finished["at"] = time.monotonic()
            streaming.set()

        client = threading.Thread(target=long_request)
        client.start()
        assert streaming.wait(60), "the request never started streaming"
        drain = pod_command(stack, "workers.drain", DRAIN_TIMEOUT_SECONDS="90")
        drained_at = time.monotonic()
        client.join(60)
        assert drain.returncode == 0 and "drained" in drain.stdout, drain.stdout + drain.stderr
        # The in-flight request finished normally, and the drain waited for it.
        assert "at" in finished, "the stream had not ended 60 s after the drain"
        assert finished["status"] == 200 and finished["error"] is None, finished
        assert finished["usage"]["completion_tokens"] == 1900
        assert drained_at >= finished["at"]
        # A draining pod is still healthy, but takes no new work: the pool has no ready worker.
        assert pod_command(stack, "workers.probe").returncode == 0
        refused = httpx.post(
            f"{stack.base_url}/v1/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": MODEL, "prompt": "Hi", "max_tokens": 4},
            timeout=30,
        )
        assert refused.status_code == 503
    finally:
        stack.stop("drain")
