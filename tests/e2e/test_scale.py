"""The serving path at scale, end to end: a burst of 1,000 requests, and one pool of two workers.

Both check outcomes, never timings: every request of a burst ends (served, or refused with a
status a client can retry on), the ledger holds each served request once with the usage the client
was told; a pool's requests spread over its workers, and the streams of a lost worker continue on
the other one.
"""

import asyncio
import json
import signal

import httpx
import pytest
import redis

from contract import protocol
from tests.e2e.stack import PausedEngine, engine_processes, requests_in_flight, wait_until, wait_usage_row

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

BURST = 1000
PAIR_POOL, PAIR_MODEL, PAIR_SLOTS = "pair", "tiny-pair", 4


async def _burst(stack, key: str, count: int) -> list[httpx.Response]:
    body = {"model": "tiny-gemma4", "prompt": "Hi", "max_tokens": 2, "ignore_eos": True}
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=0)
    async with httpx.AsyncClient(
        base_url=stack.base_url, headers={"Authorization": f"Bearer {key}"}, limits=limits, timeout=600
    ) as client:
        return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(count)))


def test_a_burst_of_1000_requests_all_end_and_each_served_one_is_billed_once(tiny_stack, make_tenant):
    from ledger.models import UsageRecord

    tenant, key = make_tenant("burst")
    responses = asyncio.run(_burst(tiny_stack, key, BURST))

    statuses = {response.status_code for response in responses}
    print("burst statuses:", {status: sum(r.status_code == status for r in responses) for status in statuses})
    assert statuses <= {200, 429, 503}, [r.text for r in responses if r.status_code not in (200, 429, 503)][:3]
    for response in responses:
        if response.status_code != 200:
            assert response.headers.get("retry-after"), response.text
            assert "error" in response.json()
    served = {response.json()["id"]: response.json()["usage"] for response in responses if response.status_code == 200}
    assert served, "no request of the burst was served"
    for request_id in served:
        wait_usage_row(request_id, timeout=120)
    rows = {row.request_id: row for row in UsageRecord.objects.filter(tenant=tenant, request_id__in=served)}
    assert rows.keys() == served.keys()  # once each: request_id is unique in the ledger
    for request_id, usage in served.items():
        row = rows[request_id]
        assert (row.status, row.prompt_tokens, row.completion_tokens) == (
            "ok", usage["prompt_tokens"], usage["completion_tokens"],
        )  # fmt: skip


def test_a_model_worker_runs_its_requests_in_slots_that_hold_no_thread(tiny_stack, make_tenant):
    """Started with `--pool threads`, as every deployment starts it, a worker that serves a model runs
    its requests' tasks in RequestPool (workers/requestpool.py), with only its few blocking-task
    threads started, where the threads pool starts one per slot; a burst wider than its slots is
    served; at log level INFO it logs no line per request task."""
    from workers.requestpool import BLOCKING_TASK_THREADS

    _, key = make_tenant("slots")
    responses = asyncio.run(_burst(tiny_stack, key, 100))
    assert {response.status_code for response in responses} <= {200, 429, 503}
    assert any(response.status_code == 200 for response in responses)

    worker_log = (tiny_stack.log_dir / "e2e.log").read_text()
    assert "--pool threads --concurrency 64" in worker_log and "--loglevel INFO" in worker_log
    assert "concurrency: 64 (requestpool)" in worker_log  # Celery's banner names the pool's module
    assert f"started its {BLOCKING_TASK_THREADS} task threads" in worker_log
    assert "workers.generate[" not in worker_log


def _stream_lines(stack, key: str, request_ids: dict, index: int) -> list[str]:
    body = {
        "model": PAIR_MODEL,
        "prompt": "Go",
        "max_tokens": 64,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{stack.base_url}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {key}"}, timeout=120) as response:  # fmt: skip
        assert response.status_code == 200, response.read()
        request_ids[index] = response.headers["x-request-id"]
        return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


def _serving_worker(client, request_id: str) -> str:
    start = next(f for _, f in client.xrange(protocol.events_key(request_id)) if f["t"] == "start")
    return start["w"]


def test_a_pool_spreads_over_two_workers_and_the_streams_of_a_lost_one_continue_on_the_other(
    live_stack, make_tenant
):
    from concurrent.futures import ThreadPoolExecutor

    stack = live_stack
    stack.register_model(PAIR_MODEL, pool=PAIR_POOL)
    _, key = make_tenant("pair")
    client = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    for name in ("a", "b"):
        stack.start_worker(name=f"pair-{name}", pool=PAIR_POOL, concurrency=PAIR_SLOTS)
    try:
        wait_until(lambda: len(_ready(client)) == 2, "the two workers never became ready", timeout=600)
        survivor = PausedEngine(engine_processes(stack, "pair-a"))
        doomed = PausedEngine(engine_processes(stack, "pair-b"))
        survivor.suspend()
        doomed.suspend()
        request_ids: dict[int, str] = {}
        with ThreadPoolExecutor(2 * PAIR_SLOTS) as clients:
            streams = [clients.submit(_stream_lines, stack, key, request_ids, i) for i in range(2 * PAIR_SLOTS)]
            # A worker runs at most its slots: all eight in flight means both workers took four.
            wait_until(lambda: requests_in_flight(stack, PAIR_POOL) == 2 * PAIR_SLOTS,
                       "the pool never ran all eight requests", timeout=120)  # fmt: skip
            wait_until(lambda: len(request_ids) == 2 * PAIR_SLOTS, "not every stream opened")
            served_by = {i: _serving_worker(client, rid) for i, rid in request_ids.items()}
            stack.stop("pair-b", sig=signal.SIGKILL)
            survivor.resume()
            outcomes = {i: stream.result(timeout=300) for i, stream in enumerate(streams)}
    finally:
        for name in ("pair-a", "pair-b"):
            if name in stack.children:
                stack.stop(name, sig=signal.SIGKILL)

    assert sorted(served_by.values()).count(served_by[0]) == PAIR_SLOTS  # four and four
    survivor_name = next(name for name in served_by.values() if name.startswith("pair-a@"))
    for i, lines in outcomes.items():
        assert lines[-1] == "[DONE]"
        final = json.loads(lines[-2])
        assert "error" not in final and final["usage"]["completion_tokens"] == 64, lines[-3:]
        row = wait_usage_row(request_ids[i])
        assert row.status == "ok" and row.completion_tokens == 64
        if served_by[i] != survivor_name:  # continued on the survivor: its one row names both
            assert row.worker == f"{served_by[i]},{survivor_name}"


def _ready(client) -> list[str]:
    names = client.zrange(protocol.pool_workers_key(PAIR_POOL), 0, -1)
    return [name for name in names if client.hget(protocol.worker_key(name), "state") == "ready"]
