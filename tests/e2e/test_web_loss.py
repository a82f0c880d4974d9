"""A web process killed mid-stream: the client sees its connection cut at once (no hang), the worker
stops the request once the dead process's lease on it lapses (no one reads it any more), its usage
reaches the ledger exactly once as generated, its quota reservation is released, and the web tier
serves the next request from a new process."""

import functools
import signal

import httpx
import psutil
import pytest
import redis

from contract import protocol
from tests.e2e.stack import engine_paused, relayed, run_to_first_tokens, settled, wait_until, wait_usage_row

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

MODEL = "tiny-gemma4"
MAX_TOKENS = 1900


def _web_process_serving(stack, client_port: int) -> psutil.Process:
    """The gunicorn worker whose socket is connected to the client's local port."""
    master = psutil.Process(stack.children["web"].pid)
    for worker in master.children():
        if any(conn.raddr and conn.raddr.port == client_port for conn in worker.net_connections(kind="tcp")):
            return worker
    raise AssertionError(f"no web process holds the connection from port {client_port}")


def _lease_lapsed(client, request_id: str) -> bool:
    return not client.exists(protocol.reader_key(request_id))


def _kill_the_web_process_mid_stream(stack, client, key: str, body: dict, attempts: int = 5):
    """Stream a completion and SIGKILL the web process serving it while the request generates;
    return the request id and the transport error the client saw (None: the stream went on).

    The engine runs only until the request's first tokens are relayed, then stays paused until the
    worker has noticed the lapsed lease and stopped the request: left running, the engine can
    generate the whole answer while this process gets no CPU on a busy machine (CI, 2026-12-06:
    the stream had ended before the kill). An attempt whose request ended all the same is seen by
    its done entry and repeated with a new request, once the finished one is settled (the tenant
    may run one request at a time)."""
    for _ in range(attempts):
        cut = None
        with engine_paused(stack) as engine:
            with httpx.stream("POST", f"{stack.base_url}/v1/completions", json=body, timeout=120,
                              headers={"Authorization": f"Bearer {key}"}) as response:  # fmt: skip
                assert response.status_code == 200, response.read()
                request_id = response.headers["x-request-id"]
                client_port = response.extensions["network_stream"].get_extra_info("socket").getsockname()[1]
                lines = response.iter_lines()  # held: a dropped line iterator closes the connection
                if not run_to_first_tokens(engine, client, request_id):
                    _web_process_serving(stack, client_port).send_signal(signal.SIGKILL)
                    try:
                        for _ in lines:  # the rest of the stream: cut short
                            pass
                    except httpx.TransportError as exc:
                        cut = exc
                    wait_until(functools.partial(_lease_lapsed, client, request_id), "the lease never lapsed", 60)
                    wait_until(relayed(client, "done", request_id), "the worker did not stop the request", 30)
                    return request_id, cut
        wait_usage_row(request_id)
        wait_until(settled(client, request_id), "the finished request was never settled")
    raise AssertionError(f"the engine finished the request before its web process was killed, {attempts} times")


def test_a_web_process_killed_mid_stream_stops_its_request_and_bills_what_was_generated(tiny_stack, make_tenant):
    from ledger.models import UsageRecord

    stack = tiny_stack
    client = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    _, key = make_tenant("wendy")
    stack.manage("setquota", "wendy", "--concurrency", "1")  # a leaked reservation refuses the next request
    body = {"model": MODEL, "prompt": "Go", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
    request_id, cut = _kill_the_web_process_mid_stream(stack, client, key, body)
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
