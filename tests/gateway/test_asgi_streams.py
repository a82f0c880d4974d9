"""The web tier under its real server (gunicorn + uvicorn worker, deploy/gunicorn.conf.py): open
streams hold no thread.

The test plays the worker's part over Redis (contract/protocol.py): it claims each request's input,
writes its events and finishes it when the test says so. The server has fewer gateway threads than
the test opens streams; every stream must still be served at once, and the process must not grow a
thread per stream.
"""

import array
import fcntl
import json
import termios
import threading
import time

import httpx
import psutil
import pytest

from contract import protocol
from contract.protocol import Usage
from tests.e2e.stack import wait_until
from tests.gateway.web_server import web_server

pytestmark = pytest.mark.django_db(transaction=True)

POOL = "asgi-test"
WORKER = "asgi-test-worker"
GATEWAY_THREADS = 2
STREAMS = 6  # per batch: three times the gateway's threads


@pytest.fixture
def server(tiny_model_dir, redis_client, make_tenant, tmp_path):
    """The web tier, one process with GATEWAY_THREADS threads; yields (url, key, pid)."""
    from django.core.management import call_command

    _, key = make_tenant("streamer")
    call_command(
        "registermodel", "tiny-gemma4", "--path", str(tiny_model_dir), "--pool", POOL, "--context-length", "2048"
    )
    _pretend_a_ready_worker(redis_client)
    env = dict(DATABASE_POOL="1", GATEWAY_THREADS=str(GATEWAY_THREADS), SSE_KEEPALIVE_SECONDS="1")
    with web_server(tmp_path, **env) as (base_url, pid):
        yield base_url, key, pid


def _pretend_a_ready_worker(redis_client) -> None:
    # A heartbeat far in the future stays fresh for the whole test.
    redis_client.zadd(protocol.pool_workers_key(POOL), {WORKER: time.time() + 3600})
    redis_client.hset(protocol.worker_key(WORKER), mapping={"pool": POOL, "state": "ready", "slots": 64})


class _Client(threading.Thread):
    """One streamed completion; records its chunks as they arrive."""

    def __init__(self, base_url: str, key: str):
        super().__init__(daemon=True)
        self.base_url, self.key = base_url, key
        self.texts: list[str] = []
        self.lines: list[str] = []
        self.first_text = threading.Event()
        self.leave = threading.Event()  # set: close the connection after the next chunk
        self.error: str | None = None

    def run(self) -> None:
        body = {"model": "tiny-gemma4", "prompt": "Go", "max_tokens": 8, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        try:
            with httpx.stream("POST", f"{self.base_url}/v1/completions", json=body, timeout=120,
                              headers={"Authorization": f"Bearer {self.key}"}) as response:  # fmt: skip
                for line in response.iter_lines():
                    self.lines.append(line)
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if chunk.get("choices") and chunk["choices"][0].get("text"):
                            self.texts.append(chunk["choices"][0]["text"])
                            self.first_text.set()
                    if self.leave.is_set():
                        return  # leaving the block closes the connection mid-stream
        except httpx.HTTPError as exc:
            self.error = repr(exc)


def _claim_new_requests(redis_client, claimed: set[str]) -> None:
    """What a worker does when it takes a request: delete its input, announce itself, send a delta."""
    for key in redis_client.scan_iter(match="req:*:in"):
        rid = key.split(":")[1]
        if rid in claimed or not redis_client.delete(key):
            continue
        claimed.add(rid)
        events = protocol.events_key(rid)
        redis_client.xadd(events, {"t": "start", "w": WORKER})
        redis_client.xadd(events, {"t": "delta", "x": "Hi", "n": 1})


def _open_streams(base_url, key, redis_client, claimed: set[str]) -> list[_Client]:
    """STREAMS more streams, each claimed by the test's worker and relaying its first tokens."""
    clients = [_Client(base_url, key) for _ in range(STREAMS)]
    for client in clients:
        client.start()
    wanted = len(claimed) + STREAMS

    def all_claimed() -> bool:
        _claim_new_requests(redis_client, claimed)
        return len(claimed) == wanted

    wait_until(all_claimed, "the gateway did not enqueue every request", 60)
    for client in clients:
        assert client.first_text.wait(60), client.error
    return clients


def _finish(redis_client, rid: str) -> None:
    usage = Usage(request_id=rid, tenant_id=0, key_id=0, model="tiny-gemma4", prompt_tokens=2, completion_tokens=1,
                  finish_reason="stop", worker=WORKER, finished_at=time.time())  # fmt: skip
    redis_client.xadd(protocol.events_key(rid), {"t": "done", "u": usage.dumps()})


def test_open_streams_hold_no_thread(server, redis_client):
    base_url, key, pid = server
    process = psutil.Process(pid)
    claimed: set[str] = set()

    first = _open_streams(base_url, key, redis_client, claimed)
    threads_at_first_batch = process.num_threads()
    second = _open_streams(base_url, key, redis_client, claimed)

    # Twice GATEWAY_THREADS * 3 streams are open and relaying at once, and the second batch added
    # no thread per stream (a thread-per-stream server grows by STREAMS here).
    assert all(client.is_alive() for client in first + second)
    threads_at_second_batch = process.num_threads()
    print(
        f"worker threads: {threads_at_first_batch} with {STREAMS} streams, {threads_at_second_batch} with {2 * STREAMS}"
    )
    assert threads_at_second_batch - threads_at_first_batch < STREAMS
    for rid in claimed:
        _finish(redis_client, rid)
    for client in first + second:
        client.join(60)
        assert client.error is None
        assert _last_event(client) == "data: [DONE]"
        assert client.texts == ["Hi"]


def test_a_client_that_leaves_mid_stream_stops_its_request(server, redis_client):
    base_url, key, _ = server
    claimed: set[str] = set()
    leaving, *others = _open_streams(base_url, key, redis_client, claimed)

    leaving.leave.set()  # the next keep-alive comment (every second) wakes it to leave
    leaving.join(30)

    # The gateway noticed at once (no token is coming) and told the worker to stop: a cancel key.
    wait_until(lambda: _cancelled(redis_client, claimed) == 1,
               "the gateway did not stop the request of the client that left", 30)  # fmt: skip
    for rid in claimed:
        _finish(redis_client, rid)
    for other in others:
        other.join(60)
        assert _last_event(other) == "data: [DONE]"
    assert _cancelled(redis_client, claimed) == 1


def _last_event(client: _Client) -> str:
    return [line for line in client.lines if line][-1]


def _cancelled(redis_client, rids) -> int:
    return sum(redis_client.exists(protocol.cancel_key(rid)) for rid in rids)


def test_a_client_that_stops_reading_then_leaves_stops_its_request(server, redis_client):
    """The client reads the opening chunk, then nothing while keep-alives arrive, then closes (with
    unread data its kernel resets the connection): the gateway must notice, and not before."""
    base_url, key, _ = server
    claimed: set[str] = set()
    body = {"model": "tiny-gemma4", "messages": [{"role": "user", "content": "Go"}], "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {key}"}) as response:  # fmt: skip
        lines = response.iter_lines()  # held: a dropped line iterator closes the connection
        next(line for line in lines if line.startswith("data: {"))
        wait_until(lambda: _claim_new_requests(redis_client, claimed) or claimed, "never enqueued")
        (rid,) = claimed
        # Keep-alives pile up unread; the request is still on while the client is connected.
        socket = response.extensions["network_stream"].get_extra_info("socket")
        wait_until(lambda: _unread_bytes(socket) > 0, "no keep-alive arrived", 30)
        assert not redis_client.exists(protocol.cancel_key(rid)), "stopped while its client was still connected"
    wait_until(lambda: redis_client.exists(protocol.cancel_key(rid)), "the gateway did not stop the request", 30)


def _unread_bytes(sock) -> int:
    waiting = array.array("i", [0])
    fcntl.ioctl(sock.fileno(), termios.FIONREAD, waiting)
    return waiting[0]
