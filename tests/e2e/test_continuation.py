"""A worker lost mid-stream while another worker of its pool is ready: its requests continue there,
on the same streams, and the clients see one unbroken response each."""

import json
import signal
import threading

import httpx
import pytest
import redis

from contract import protocol
from tests.e2e.stack import (
    PausedEngine,
    engine_processes,
    relayed,
    settled,
    wait_until,
    wait_usage_row,
)

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

POOL = "pair"
MODEL = "tiny-pair"
STREAMS = 4
MAX_TOKENS = 1500


class _Stream(threading.Thread):
    """One streamed completion read to its end on a thread of its own: its id and its events."""

    def __init__(self, stack, key: str) -> None:
        super().__init__(daemon=True)
        self.url, self.key = f"{stack.base_url}/v1/completions", key
        self.request_id: str | None = None
        self.events: list[str] = []
        self.id_known = threading.Event()

    def run(self) -> None:
        body = {"model": MODEL, "prompt": "Go", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
                "logprobs": 0, "stream_options": {"include_usage": True}}  # fmt: skip
        with httpx.stream("POST", self.url, json=body, headers={"Authorization": f"Bearer {self.key}"},
                          timeout=httpx.Timeout(60, read=120)) as response:  # fmt: skip
            assert response.status_code == 200, response.read()
            self.request_id = response.headers["x-request-id"]
            self.id_known.set()
            self.events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


def test_streams_of_a_killed_worker_continue_on_another_worker_exactly_once(live_stack, make_tenant):
    stack = live_stack
    stack.register_model(MODEL, pool=POOL)
    _, key = make_tenant("alice")
    client = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    stack.start_worker(name="first", pool=POOL, concurrency=8)
    stack.start_worker(name="second", pool=POOL, concurrency=8)
    try:
        stack.wait_ready(pool=POOL, count=2)
        # The second worker drains while the streams start, so the route step gives every one to
        # the first; it is back (ready) before the first dies. Both engines start before anything
        # is paused: an engine starting beside a paused one could starve the first worker's
        # heartbeat on a busy machine, and it would be given up before the second could take over.
        _set_draining(client, "second-pod", True)
        streams = _four_streams_generating_on_a_paused_engine(stack, key, client)
        _set_draining(client, "second-pod", False)
        stack.stop("first", sig=signal.SIGKILL)  # its whole process group, the paused engine too
        for stream in streams:
            stream.join(timeout=600)
            assert not stream.is_alive(), "a stream never ended"
    finally:
        for name in ("first", "second"):
            if name in stack.children:
                stack.stop(name, sig=signal.SIGKILL)
    for stream in streams:
        _assert_one_unbroken_response(stream, client)


def _set_draining(client, pod: str, draining: bool) -> None:
    """Ask the worker of ``pod`` to drain (or to serve again) and wait until its heartbeat says so."""
    if draining:
        client.sadd(protocol.pool_drain_key(POOL), pod)
    else:
        client.srem(protocol.pool_drain_key(POOL), pod)
    wanted = "draining" if draining else "ready"

    def reached() -> bool:
        names = client.zrange(protocol.pool_workers_key(POOL), 0, -1)
        records = [client.hgetall(protocol.worker_key(name)) for name in names]
        return any(record.get("pod") == pod and record.get("state") == wanted for record in records)

    wait_until(reached, f"the worker of {pod} never reported {wanted}", 60)


def _four_streams_generating_on_a_paused_engine(stack, key: str, client) -> list[_Stream]:
    """Start STREAMS streams on the pool's only worker, let its engine run until each has relayed
    tokens, and pause it again (so none can finish before its worker is killed)."""
    engine = PausedEngine(engine_processes(stack, "first"))
    engine.suspend()
    streams = [_Stream(stack, key) for _ in range(STREAMS)]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.id_known.wait(60), "no reply headers in 60 s"
        wait_until(relayed(client, "start", stream.request_id), "the worker never took a request", 60)
    with engine.resumed():
        for stream in streams:
            wait_until(relayed(client, "delta", stream.request_id), "the engine generated nothing", 120)
    assert not any(relayed(client, "done", stream.request_id)() for stream in streams), (
        "a request ended before its worker could be killed"
    )
    return streams


def _assert_one_unbroken_response(stream: _Stream, client) -> None:
    assert stream.events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in stream.events[:-1]]
    assert not [chunk for chunk in chunks if "error" in chunk], chunks[-3:]
    choices = [choice for chunk in chunks for choice in chunk.get("choices", [])]
    # Every token once: one logprob entry per generated token, across both workers.
    tokens = sum(len(choice["logprobs"]["tokens"]) for choice in choices if choice.get("logprobs"))
    assert tokens == MAX_TOKENS
    assert [choice["finish_reason"] for choice in choices if choice.get("finish_reason")] == ["length"]
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == MAX_TOKENS
    row = wait_usage_row(stream.request_id)
    assert (row.status, row.prompt_tokens, row.completion_tokens) == ("ok", usage["prompt_tokens"], MAX_TOKENS)
    assert "first" in row.worker and "second" in row.worker  # both workers named in its one row
    wait_until(settled(client, stream.request_id), "the request's reservation was never released")
