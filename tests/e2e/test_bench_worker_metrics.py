"""The GPU bench's worker wrapper (benchmarks/gpu/worker_metrics.py) serves the engine's steps of a
real worker: Celery and vLLM's CPU engine in one process, read over HTTP as the platform stage does."""

import json
import time

import httpx
import pytest

from benchmarks.gpu.measure import engine_steps
from benchmarks.gpu.worker_metrics import behind_metrics, read_step_token_counts
from tests.e2e.stack import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

POOL = "metered"
MODEL = "tiny-metered"
MAX_TOKENS = 8


def test_the_wrapped_worker_serves_requests_and_the_steps_its_engine_ran_for_them(live_stack, make_tenant):
    stack = live_stack
    stack.register_model(MODEL, pool=POOL)
    _, key = make_tenant("metered")
    port = free_port()
    # The cpu profile turns vLLM's statistics off; the GPU profiles keep them on, as here.
    stack.start_worker("metered", POOL, concurrency=4, wrap=lambda argv: behind_metrics(argv, port),
                       ENGINE_ARGS_JSON=json.dumps({"disable_log_stats": False}))  # fmt: skip
    try:
        stack.wait_ready(pool=POOL)
        before = read_step_token_counts(port)
        body = {"model": MODEL, "prompt": "Count the steps", "max_tokens": MAX_TOKENS, "ignore_eos": True}
        reply = httpx.post(f"{stack.base_url}/v1/completions", json=body,
                           headers={"Authorization": f"Bearer {key}"}, timeout=120)  # fmt: skip
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == MAX_TOKENS
        # The engine's client records a step's statistics beside handing its outputs on: wait for
        # the last of them rather than race it.
        deadline, steps = time.monotonic() + 60, None
        while time.monotonic() < deadline:
            steps = engine_steps(before, read_step_token_counts(port), streams=1)
            if steps and steps["steps"] >= MAX_TOKENS:
                break
            time.sleep(0.2)
    finally:
        stack.stop("metered")
    assert before is not None, "the wrapper served no histogram of tokens per step"
    # One step per generated token at least (the first also computes the prompt), and the steps
    # with more tokens than the one stream: the prompt's.
    assert steps is not None and steps["steps"] >= MAX_TOKENS, steps
    assert steps["steps_over_streams"] >= 1, steps
