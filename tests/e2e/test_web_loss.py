"""A web process killed mid-stream: the client sees its connection cut at once (no hang), the worker
stops the request once the dead process's lease on it lapses (no one reads it any more), its usage
reaches the ledger exactly once as generated, its quota reservation is released, and the web tier
serves the next request from a new process."""

import json
import signal

import httpx
import psutil
import pytest
import redis

from tests.e2e.stack import engine_paused, wait_until, wait_usage_row
from workers import protocol

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

MODEL = "tiny-gemma4"
MAX_TOKENS = 1900


def _web_process_serving(stack, client_port: int) -> psutil.Process:
    """The gunicorn worker whose socket is connected to the client's local port."""
    master = psutil.Process(stack.procs["gunicorn"].pid)
    for worker in master.children():
        if any(conn.raddr and conn.raddr.port == client_port for conn in worker.net_connections(kind="tcp")):
            return worker
    raise AssertionError(f"no web process holds the connection from port {client_port}")


def _ended(client, request_id: str) -> bool:
    return any(fields["t"] == "done" for _, fields in client.xrange(protocol.events_key(request_id)))


def test_a_web_process_killed_mid_stream_stops_its_request_and_bills_what_was_generated(tiny_stack, make_tenant):
    from ledger.models import UsageRecord

    stack = tiny_stack
    client = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    _, key = make_tenant("wendy")
    stack.manage("setquota", "wendy", "--concurrency", "1")  # a leaked reservation refuses the next request
    body = {"model": MODEL, "prompt": "Go", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
    cut = None
    with httpx.stream("POST", f"{stack.base_url}/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {key}"}) as response:  # fmt: skip
        assert response.status_code == 200, response.read()
        request_id = response.headers["x-request-id"]
        client_port = response.extensions["network_stream"].get_extra_info("socket").getsockname()[1]
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                break
        with engine_paused(stack):  # generation holds still while the worker notices
            _web_process_serving(stack, client_port).send_signal(signal.SIGKILL)
            try:
                for _ in lines:  # the rest of the stream: cut short
                    pass
            except httpx.TransportError as exc:
                cut = exc
            wait_until(lambda: not client.exists(protocol.reader_key(request_id)), "the lease never lapsed", 60)
            wait_until(lambda: _ended(client, request_id), "the worker did not stop the request", 30)
    assert cut is not None, "the stream went on after its web process was killed"

    # The worker stopped it when the lease lapsed: billed for what it generated, once.
    row = wait_usage_row(request_id, timeout=120)
    assert row.status == "cancelled" and 0 < row.completion_tokens < MAX_TOKENS
    assert UsageRecord.objects.filter(request_id=request_id).count() == 1

    # The reservation was released (concurrency 1) and a new web process serves the next request.
    def next_request_served() -> bool:
        try:
            reply = httpx.post(f"{stack.base_url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                               json=dict(body, stream=False, max_tokens=4), timeout=60)  # fmt: skip
        except httpx.TransportError:
            return False
        assert reply.status_code in (200, 429), reply.text
        return reply.status_code == 200

    wait_until(next_request_served, "the next request was never served", 60)
