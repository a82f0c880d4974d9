"""PostgreSQL unreachable under traffic: the inference path keeps serving keys it has seen (their
records and limits from Redis, the catalog as last read), a key never seen gets a 503 in OpenAI's
shape, usage waits in `ledger:pending` and reaches the ledger once the database is back: none lost,
none counted twice.

This module's stack reaches PostgreSQL through a proxy the test cuts (tests/e2e/tcp_proxy.py): the
machine's PostgreSQL, which the test itself reads, stays up.
"""

import json
import threading
from urllib.parse import urlparse, urlunparse

import httpx
import psutil
import pytest
import redis

from contract import protocol
from tests.e2e.stack import database_url, wait_until, wait_usage_row
from tests.e2e.tcp_proxy import CuttableProxy

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

MODEL = "tiny-gemma4"
CLIENTS = 4
REQUESTS_PER_CLIENT = 6
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def postgres_proxy(django_db_setup):
    from django.conf import settings

    db = settings.DATABASES["default"]
    proxy = CuttableProxy((db["HOST"] or "127.0.0.1", int(db["PORT"] or 5432)))
    yield proxy
    proxy.close()


@pytest.fixture(scope="module")
def stack_database_url(django_db_setup, postgres_proxy):
    from django.conf import settings

    url = urlparse(database_url(settings.DATABASES["default"]))
    return urlunparse(url._replace(netloc=f"{url.netloc.rsplit('@', 1)[0]}@127.0.0.1:{postgres_proxy.port}"))


def _serving_process(stack, client_port: int) -> int:
    master = psutil.Process(stack.children["web"].pid)
    for worker in master.children():
        if any(conn.raddr and conn.raddr.port == client_port for conn in worker.net_connections(kind="tcp")):
            return worker.pid
    raise AssertionError(f"no web process holds the connection from port {client_port}")


def _every_web_process_serves(stack, headers: dict) -> None:
    """Send requests on fresh connections until every web process has served one: each then holds
    the model catalog (read per process) and has seen the key."""
    processes = {worker.pid for worker in psutil.Process(stack.children["web"].pid).children()}
    served: set[int] = set()
    for _ in range(60):
        with httpx.Client(base_url=stack.base_url, headers=headers, timeout=120) as client:
            body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200, response.read()
                port = response.extensions["network_stream"].get_extra_info("socket").getsockname()[1]
                served.add(_serving_process(stack, port))
                response.read()
        if served >= processes:
            return
    raise AssertionError(f"web processes {processes - served} never took a request")


def _one_request(stack, headers: dict, stream: bool) -> dict:
    body = {"model": MODEL, "prompt": "Go", "max_tokens": MAX_TOKENS, "ignore_eos": True}
    if not stream:
        reply = httpx.post(f"{stack.base_url}/v1/completions", json=body, headers=headers, timeout=120)
        return {"status": reply.status_code, "id": reply.headers.get("x-request-id"),
                "usage": reply.json().get("usage"), "error": reply.json().get("error")}  # fmt: skip
    seen: dict = {}
    body.update(stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", f"{stack.base_url}/v1/completions", json=body, headers=headers,
                      timeout=120) as response:  # fmt: skip
        seen.update(status=response.status_code, id=response.headers.get("x-request-id"), usage=None, error=None)
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                seen["usage"] = chunk.get("usage") or seen["usage"]
                seen["error"] = chunk.get("error") or seen["error"]
    return seen


def _load(stack, headers: dict) -> list[dict]:
    """CLIENTS clients at once, each sending REQUESTS_PER_CLIENT requests, streamed or not in turn."""
    results: list[list[dict]] = [[] for _ in range(CLIENTS)]

    def client(i: int) -> None:
        for n in range(REQUESTS_PER_CLIENT):
            try:
                results[i].append(_one_request(stack, headers, stream=(i + n) % 2 == 0))
            except httpx.HTTPError as exc:
                results[i].append({"transport_error": repr(exc)})

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    return [result for per_client in results for result in per_client]


def test_inference_rides_out_a_database_outage_and_writes_its_usage_once_after(tiny_stack, postgres_proxy, make_tenant):
    from ledger.models import UsageRecord
    from quotas.admission import resv_key
    from tenants.keys import key_prefix

    stack = tiny_stack
    client = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    alice, key = make_tenant("alice")
    _, unseen_key = make_tenant("bob")  # never used: nothing of it in Redis
    headers = {"Authorization": f"Bearer {key}"}
    _every_web_process_serves(stack, headers)

    postgres_proxy.cut()
    try:
        # As after the auth and limits caches' lifetimes: every request must reach for PostgreSQL.
        client.delete(f"auth:{key_prefix(key)}", f"quota:lim:{alice.id}")
        results = _load(stack, headers)
        never_seen = httpx.post(f"{stack.base_url}/v1/completions", headers={"Authorization": f"Bearer {unseen_key}"},
                                json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=120)  # fmt: skip

        assert postgres_proxy.refused > 0, "the stack never tried PostgreSQL: the outage tested nothing"
        failed = [r for r in results if r.get("status") != 200 or r.get("error") or "transport_error" in r]
        assert not failed, failed
        assert all(r["usage"]["completion_tokens"] == MAX_TOKENS for r in results), results
        assert never_seen.status_code == 503, never_seen.text
        assert never_seen.json()["error"]["code"] == "database_unavailable" and never_seen.headers["Retry-After"]
        # The usage waits in Redis; none of it reached the ledger (this process reads PostgreSQL directly).
        ids = [r["id"] for r in results]
        assert len(set(ids)) == len(ids) == CLIENTS * REQUESTS_PER_CLIENT
        assert all(client.hexists(protocol.LEDGER_PENDING, request_id) for request_id in ids)
        assert not UsageRecord.objects.filter(request_id__in=ids).exists()
        # Their reservations were settled all the same (in Redis): the quota does not wait for PostgreSQL.
        assert not any(client.exists(resv_key(request_id)) for request_id in ids)
    finally:
        postgres_proxy.restore()

    # Written once the database is back: one row per request, as told to its client.
    rows = {request_id: wait_usage_row(request_id, timeout=180) for request_id in ids}
    assert UsageRecord.objects.filter(request_id__in=ids).count() == len(ids)
    assert all(row.completion_tokens == MAX_TOKENS and row.status == "ok" for row in rows.values())
    wait_until(lambda: not any(client.hexists(protocol.LEDGER_PENDING, i) for i in ids), "usage left pending", 60)
    print(f"\n{len(ids)} requests served during the outage; {postgres_proxy.refused} connections refused")
