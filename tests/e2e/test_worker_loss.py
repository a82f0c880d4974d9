"""A worker that dies mid-request ends the stream with an explicit error event, within bounded time."""

import json
import signal
import subprocess
import time

import httpx
import pytest
import redis

from tests.e2e.stack import ROOT, PausedEngine, engine_processes, run_to_first_tokens, wait_usage_row

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

DOOMED_POOL = "doomed"
MODEL = "tiny-doomed"


def test_a_worker_killed_mid_stream_ends_the_stream_with_an_error_and_records_usage(live_stack, make_tenant):
    stack = live_stack
    stack.register_model(MODEL, pool=DOOMED_POOL)
    _, key = make_tenant("alice")
    stack.start_worker(name="doomed", pool=DOOMED_POOL, concurrency=4)
    try:
        stack.wait_ready(pool=DOOMED_POOL)
        for _ in range(3):
            outcome = _stream_and_kill_the_worker(stack, key)
            if outcome is not None:
                break
        else:
            raise AssertionError("every request ended before the test could kill its worker")
    finally:
        if "doomed" in stack.children:
            stack.stop("doomed", sig=signal.SIGKILL)
    events, ended_after = outcome
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "worker_lost" and error["type"] == "server_error"
    # Heartbeat timeout is 12 s in the stack, keep-alive 1 s: the end comes well within 30 s.
    assert ended_after < 30, f"the stream hung for {ended_after:.1f}s after the worker died"
    request_id = json.loads(events[0])["id"]
    row = wait_usage_row(request_id)
    assert row.status == "worker_lost" and 0 < row.completion_tokens < 1900


def _stream_and_kill_the_worker(stack, key: str) -> tuple[list[str], float] | None:
    """Stream a long completion and SIGKILL its worker while it generates: (the events, seconds from
    the kill to the stream's end), or None when the request had ended before the kill.

    The engine is paused except while it makes the request's first tokens, and the kill lands while
    it is paused: left running until this process had read a few events, a fast engine (1.4 ms a
    token) finished all 1,900 tokens first in three attempts in a row on a loaded 2-core machine
    (CI, 2026-12-04). Even the short run can finish the request when this process gets no CPU for
    seconds: such an attempt is seen by its done entry and repeated, once its usage is recorded."""
    client = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    body = {"model": MODEL, "prompt": "Go", "max_tokens": 1900, "ignore_eos": True, "stream": True}
    engine = PausedEngine(engine_processes(stack, "doomed"))
    engine.suspend()
    with httpx.stream("POST", f"{stack.base_url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                      json=body, timeout=60) as response:  # fmt: skip
        assert response.status_code == 200
        request_id = response.headers["x-request-id"]
        lines = response.iter_lines()  # held: a dropped line iterator closes the connection
        if run_to_first_tokens(engine, client, request_id):
            engine.resume()
            for _ in lines:  # the rest of the stream: the gateway records its usage before the last part
                pass
            wait_usage_row(request_id)
            return None
        stack.stop("doomed", sig=signal.SIGKILL)  # its whole process group, the paused engine too
        killed_at = time.monotonic()
        events = [line[6:] for line in lines if line.startswith("data: ")]
        return events, time.monotonic() - killed_at


def test_a_worker_whose_engine_cannot_start_exits_with_an_error(live_stack, tmp_path):
    env = live_stack.worker_env("broken", pool="broken", model_path=str(tmp_path / "no-model-here"))
    output = _run_broken_worker(live_stack, env)
    assert "the engine failed to start" in output


def test_a_worker_refusing_its_settings_exits_with_an_error_rather_than_serve_nothing(live_stack):
    """A setting refused while the worker builds its runtime, before any engine starts: Celery would
    log and swallow the error of its start-up signal and keep a worker up that never serves."""
    env = dict(live_stack.worker_env("broken", pool="broken"), WORKER_ENGINE_STREAM_INTERVAL="0")
    output = _run_broken_worker(live_stack, env)
    assert "the engine failed to start: WORKER_ENGINE_STREAM_INTERVAL must be >= 1" in output


def _run_broken_worker(stack, env: dict) -> str:
    """Run a worker that cannot serve; its output, once it has exited with status 3."""
    result = subprocess.run(
        stack.worker_command("broken", pool="broken", concurrency=2),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 3, result.stderr[-2000:]
    return result.stderr + result.stdout
