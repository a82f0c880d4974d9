"""The worker's relay (workers/relay.py) on the real engine (CPU, tiny model) and real Redis.

What it must hold: every request in flight is relayed from the engine's event loop, several
requests per pipelined write, with no thread per request; streams are complete and in order; a
cancelled request stops and is billed for what it generated; a refused one still ends; a burst on
a worker with default settings never runs out of Redis connections.
"""

import asyncio
import dataclasses
import json
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor, wait

import pytest

from contract import protocol
from contract.protocol import RequestInput, Usage
from tests.workers.engine_stream import open_stream
from workers.relay import EventRelay, relay_client

pytestmark = pytest.mark.engine

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def _request(prompt_ids, max_tokens: int, **params) -> RequestInput:
    return RequestInput(
        request_id=f"cmpl-{uuid.uuid4().hex[:12]}",
        model="tiny-gemma4",
        prompt_token_ids=list(prompt_ids),
        params=dict(GREEDY, max_tokens=max_tokens, **params),
        tenant_id=1,
        key_id=1,
        enqueued_at=0.0,
        cache_salt="tenant-1",
    )


class _RecordingClient:
    """The relay's real async client, recording which thread runs each pipeline and what it holds."""

    def __init__(self, client):
        self.client, self.pipelines = client, []

    def pipeline(self, **kwargs):
        pipe, record = self.client.pipeline(**kwargs), self.pipelines
        execute = pipe.execute

        async def recorded_execute(**kw):
            keys = {args[1] for args, _ in pipe.command_stack if args[0] == "XADD"}
            record.append((threading.get_ident(), keys))
            return await execute(**kw)

        pipe.execute = recorded_execute
        return pipe

    def __getattr__(self, name):
        return getattr(self.client, name)


@pytest.fixture
def relay(engine_host, redis_client):
    relay = EventRelay(
        engine_host,
        _RecordingClient(relay_client(os.environ["REDIS_URL"])),
        worker="w-test",
        flush_interval=0.02,
        flush_events_per_second=250,
    )
    relay.start()
    yield relay
    asyncio.run_coroutine_threadsafe(relay.stop(), engine_host.loop).result(timeout=30)


def _events(redis_client, rid: str) -> list[dict]:
    return [fields for _, fields in redis_client.xrange(protocol.events_key(rid))]


def _check_stream(events: list[dict]) -> Usage:
    """A stream is start, deltas, done; its deltas add up to the usage it reports."""
    assert events[0] == {"t": "start", "w": "w-test"}
    assert events[-1]["t"] == "done"
    assert {event["t"] for event in events[1:-1]} <= {"delta"}
    usage = Usage.loads(events[-1]["u"])
    assert sum(int(event["n"]) for event in events[1:-1]) == usage.completion_tokens
    return usage


def test_requests_in_flight_are_relayed_from_the_engine_loop_several_per_write(
    relay, engine_host, chat_prompt_ids, redis_client
):
    chunks = open_stream(engine_host, "ref", chat_prompt_ids, dict(GREEDY, max_tokens=48))
    reference = "".join(chunk.text for chunk in chunks)
    threads_before = threading.active_count()
    requests = [_request(chat_prompt_ids, 48) for _ in range(24)]
    futures = [relay.run(request) for request in requests]  # no thread per request: futures only
    assert threading.active_count() <= threads_before
    wait(futures, timeout=300)
    for future in futures:
        future.result()

    loop_thread = engine_host._thread.ident
    assert {thread for thread, _ in relay.client.pipelines} == {loop_thread}
    assert max(len(keys) for _, keys in relay.client.pipelines) >= 2  # requests share writes
    # One pipeline per flush (a flush retried through a Redis stall runs its pipeline again), far
    # fewer than the requests' events.
    assert relay.flushes <= len(relay.client.pipelines) < 24 * 48
    pending = redis_client.hgetall(protocol.LEDGER_PENDING)
    for request in requests:
        events = _events(redis_client, request.request_id)
        usage = _check_stream(events)
        assert "".join(event.get("x", "") for event in events) == reference
        assert (usage.status, usage.finish_reason, usage.completion_tokens) == ("ok", "length", 48)
        assert usage.prompt_tokens == len(chat_prompt_ids)
        assert Usage.loads(pending[request.request_id]) == usage
        assert redis_client.ttl(protocol.events_key(request.request_id)) > 0


def test_a_cancelled_request_stops_and_is_billed_for_what_it_generated(relay, chat_prompt_ids, redis_client):
    request = _request(chat_prompt_ids, 1900)
    future = relay.run(request)
    key = protocol.events_key(request.request_id)
    # The first delta is in Redis: the request is generating. Then the gateway sets the cancel key.
    deadline, seen, last_id = time.monotonic() + 120, [], "0-0"
    while not any(fields["t"] == "delta" for _, fields in seen):
        assert time.monotonic() < deadline, "no delta in 120 s"
        reply = redis_client.xread({key: last_id}, block=1000)  # within the client's socket timeout
        if reply:
            seen = reply[0][1]
            last_id = seen[-1][0]
    redis_client.set(protocol.cancel_key(request.request_id), 1)
    future.result(timeout=120)

    usage = _check_stream(_events(redis_client, request.request_id))
    assert (usage.status, usage.finish_reason) == ("cancelled", "abort")
    assert 0 < usage.completion_tokens < 1900


def test_a_request_the_engine_refuses_still_ends_with_an_error_and_its_usage(relay, chat_prompt_ids, redis_client):
    request = _request(chat_prompt_ids, 8, temperature=-1.0)
    relay.run(request).result(timeout=60)

    events = _events(redis_client, request.request_id)
    assert [event["t"] for event in events] == ["start", "error", "done"]
    # The engine refused the client's parameters: the gateway answers 400, not a server error.
    assert events[1]["c"] == "request_rejected" and "temperature" in events[1]["m"]
    usage = Usage.loads(events[-1]["u"])
    assert (usage.status, usage.completion_tokens) == ("error", 0)
    assert redis_client.hexists(protocol.LEDGER_PENDING, request.request_id)


def test_an_input_with_fields_this_version_does_not_know_ends_at_once_as_a_server_error(
    relay, chat_prompt_ids, redis_client
):
    """A newer gateway's input during a rolling upgrade: refused now (the client may retry), not run
    without what the new fields ask for, and not left to the gateway's start timeout."""
    stored = json.loads(_request(chat_prompt_ids, 8).dumps())
    request = RequestInput.loads(json.dumps({**stored, "a_future_option": 1}))
    relay.run(request).result(timeout=60)

    events = _events(redis_client, request.request_id)
    assert [event["t"] for event in events] == ["start", "error", "done"]
    assert events[1]["c"] == "engine_error" and "a_future_option" in events[1]["m"]
    assert Usage.loads(events[-1]["u"]).completion_tokens == 0


def test_a_burst_on_a_worker_with_default_settings_never_runs_out_of_redis_connections(
    engine_host, chat_prompt_ids, redis_client
):
    """300 requests through 160 task threads (a Celery worker with --concurrency 160): redis-py's
    default pool (100 connections) raised "Too many connections" here when each thread relayed its
    own request. Now the threads make no Redis call: the engine's loop claims and relays for them."""
    from workers.serving import WorkerRuntime

    slots = 160
    runtime = WorkerRuntime(
        node="w-burst", model="tiny-gemma4", model_path="unused", pool="tiny", profile="cpu", slots=slots,
        engine=engine_host,
    )  # fmt: skip
    runtime.relay.start()
    requests = [_request(chat_prompt_ids[:8], 4) for _ in range(300)]
    for request in requests:
        redis_client.set(protocol.input_key(request.request_id), request.dumps())
    try:
        with ThreadPoolExecutor(max_workers=slots) as tasks:
            results = [tasks.submit(runtime.run_request, request.request_id) for request in requests]
            for result in results:
                result.result(timeout=600)  # raises the task's error, a pool error included
    finally:
        asyncio.run_coroutine_threadsafe(runtime.relay.stop(), engine_host.loop).result(timeout=30)

    assert runtime.in_flight == 0
    assert {redis_client.get(protocol.claim_key(request.request_id)) for request in requests} == {runtime.name}
    pending = redis_client.hgetall(protocol.LEDGER_PENDING)
    for request in requests:
        usage = Usage.loads(pending[request.request_id])
        assert (usage.status, usage.completion_tokens, usage.worker) == ("ok", 4, runtime.name)


def test_a_task_whose_request_the_gateway_took_back_runs_nothing(engine_host, redis_client):
    from workers.serving import WorkerRuntime

    runtime = WorkerRuntime(
        node="w-late", model="tiny-gemma4", model_path="unused", pool="tiny", profile="cpu", slots=4, engine=engine_host
    )
    runtime.relay.start()
    try:
        runtime.run_request("cmpl-taken-back")  # no input: the gateway deleted it when it gave up
    finally:
        asyncio.run_coroutine_threadsafe(runtime.relay.stop(), engine_host.loop).result(timeout=30)

    assert runtime.in_flight == 0 and runtime.relay.claims.batches == 1
    assert not redis_client.exists(protocol.events_key("cmpl-taken-back"), protocol.claim_key("cmpl-taken-back"))


def test_each_of_n_choices_is_relayed_with_its_index_logprobs_and_finish_reason(relay, chat_prompt_ids, redis_client):
    request = _request(chat_prompt_ids, 6, n=3, logprobs=2, temperature=1.0, seed=3)
    relay.run(request).result(timeout=60)

    events = _events(redis_client, request.request_id)
    usage = _check_stream(events)
    deltas = [event for event in events if event["t"] == "delta"]
    assert {int(event["i"]) for event in deltas} == {0, 1, 2}
    for index in range(3):
        mine = [event for event in deltas if int(event["i"]) == index]
        logprobs = [entry for event in mine for entry in json.loads(event.get("l", "[]"))]
        assert sum(int(event["n"]) for event in mine) == len(logprobs) == 6
        assert all(len(top) == 2 and logprob <= 0 for _, logprob, top in logprobs)
    assert usage.completion_tokens == 18
    assert json.loads(events[-1]["c"]) == [{"finish_reason": "length"}] * 3


def test_a_forced_tool_call_is_held_back_and_parsed_into_the_done_entry(relay, chat_prompt_ids, redis_client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    request = _request(chat_prompt_ids, 40, structured_outputs={"json": schema})
    request.params.pop("ignore_eos")  # the grammar ends the output with the object
    request.tool_mode, request.tool_name = "named", "check"
    relay.run(request).result(timeout=60)

    events = _events(redis_client, request.request_id)
    usage = _check_stream(events)
    assert "".join(event.get("x", "") for event in events) == ""  # no content: it is all the call
    [end] = json.loads(events[-1]["c"])
    assert end["finish_reason"] == "tool_calls" and usage.finish_reason == "stop"
    [call] = end["tool_calls"]
    assert call["name"] == "check" and isinstance(json.loads(call["arguments"])["ok"], bool)


def test_a_requests_end_settles_its_quota_in_the_same_write_also_after_redis_lost_the_script(
    relay, chat_prompt_ids, redis_client, make_tenant
):
    from quotas.admission import quota_admit, tenant_scope
    from quotas.limits import limits_for
    from quotas.services import tenant_quota_set

    tenant, _ = make_tenant("relay-settle")
    tenant_quota_set(tenant=tenant, concurrency=4, budget_tokens=10_000)
    key_id = tenant.api_keys.get().id
    requests = [_request(chat_prompt_ids, 8) for _ in range(2)]
    for request in requests:
        request.tenant_id, request.key_id = tenant.id, key_id
        quota_admit(request_id=request.request_id, tenant_id=tenant.id, key_id=key_id,
                    limits=limits_for(tenant_id=tenant.id, key_id=key_id), prompt_tokens=len(chat_prompt_ids),
                    max_tokens=8, implicit_max_tokens=False)  # fmt: skip
    in_flight = f"{tenant_scope(tenant.id)}:conc"
    assert redis_client.zcard(in_flight) == 2

    relay.run(requests[0]).result(timeout=120)
    redis_client.script_flush()  # as after a Redis restart: the worker's next settle finds no script
    relay.run(requests[1]).result(timeout=120)

    for request in requests:  # settled by the worker, with no gateway involved
        assert not redis_client.exists(f"resv:{request.request_id}")
    assert redis_client.zcard(in_flight) == 0
    budget_used = [int(value) for value in redis_client.mget(redis_client.keys(f"{tenant_scope(tenant.id)}:bud:*"))]
    assert budget_used == [2 * (len(chat_prompt_ids) + 8)]  # the reservations replaced by the usage


def test_a_settle_that_finds_redis_gone_after_the_end_was_written_leaves_it_to_the_ledger(
    relay, chat_prompt_ids, redis_client, monkeypatch
):
    from redis.exceptions import ConnectionError as RedisConnectionError

    async def redis_gone(*args, **kwargs):
        raise RedisConnectionError("Connection refused")

    monkeypatch.setattr(relay.client, "eval", redis_gone, raising=False)  # the settle's reload
    redis_client.script_flush()  # the flush's settle answers NOSCRIPT
    request = _request(chat_prompt_ids, 4)

    relay.run(request).result(timeout=120)  # the request still ends well

    usage = _check_stream(_events(redis_client, request.request_id))
    assert Usage.loads(redis_client.hget(protocol.LEDGER_PENDING, request.request_id)) == usage  # for the ledger


def test_a_repeated_prompt_reports_the_tokens_the_prefix_cache_served(relay, redis_client):
    # Longer than a few KV blocks, and drawn fresh so no earlier test cached it.
    prompt = [int(token) for token in uuid.uuid4().int.to_bytes(16, "big")] * 24
    first, again = _request(prompt, 4), _request(prompt, 4)
    other_tenant = dataclasses.replace(_request(prompt, 4), cache_salt="tenant-2")
    usages = []
    for request in (first, again, other_tenant):
        relay.run(request).result(timeout=120)
        usages.append(_check_stream(_events(redis_client, request.request_id)))
    assert usages[0].cached_tokens == 0
    assert 0 < usages[1].cached_tokens < usages[1].prompt_tokens == len(prompt)
    assert usages[2].cached_tokens == 0  # another tenant's salt: its own cache entries only
    pending = Usage.loads(redis_client.hget(protocol.LEDGER_PENDING, again.request_id))
    assert pending.cached_tokens == usages[1].cached_tokens
