"""Every request the gateway relays ends within a bound, even when a worker took it and never
started it (gateway/dispatch.py `relay`).

The test plays the worker's part over Redis (contract/protocol.py), with the worker's own claim script
(workers/claims.py, through `tests.claiming`), and drives the gateway's relay on a short keep-alive
interval. A relay that never ends fails the test at HUNG_AFTER seconds.
"""

import asyncio
import threading
import time
from contextlib import aclosing

import pytest

from catalog.models import ServedModel
from contract import protocol
from contract.protocol import RequestInput, Usage
from gateway import dispatch
from gateway.dispatch import Done, Failed
from tests.claiming import claim_request

POOL = "bounds"
HUNG_AFTER = 20.0


@pytest.fixture(autouse=True)
def short_bounds(settings):
    settings.SSE_KEEPALIVE_SECONDS = 0.05  # the relay checks for a stall this often
    settings.WORKER_HEARTBEAT_TIMEOUT = 0.2  # the test's live workers heartbeat an hour ahead
    settings.QUEUE_TIMEOUT_SECONDS = 300.0
    settings.WORKER_START_TIMEOUT_SECONDS = 300.0
    return settings


def _model() -> ServedModel:
    return ServedModel(model_id="tiny-bounds", pool=POOL)


def _enqueued(redis_client) -> RequestInput:
    """A request as the gateway stores it for its pool (without the Celery message)."""
    request = RequestInput(
        request_id=f"req-{time.monotonic_ns()}",
        model="tiny-bounds",
        prompt_token_ids=[2, 3, 4],
        params={"max_tokens": 4},
        tenant_id=7,
        key_id=9,
        enqueued_at=time.time(),
    )
    redis_client.set(protocol.input_key(request.request_id), request.dumps())
    return request


def _heartbeat(redis_client, identity: str, *, fresh: bool) -> None:
    # Far in the future stays fresh for the whole test; an hour ago is long gone.
    seen = time.time() + (3600 if fresh else -3600)
    redis_client.zadd(protocol.pool_workers_key(POOL), {identity: seen})
    redis_client.hset(protocol.worker_key(identity), mapping={"pool": POOL, "state": "ready", "slots": 4})


def _final_event(request: RequestInput, on_first_delta=None) -> Done | Failed:
    """The relay's last event; fails the test if the relay is still waiting after HUNG_AFTER seconds.
    ``on_first_delta`` is called once the relay has yielded its first text."""

    calls = [on_first_delta] if on_first_delta else []

    async def relayed():
        async with aclosing(dispatch.relay(request, _model())) as batches:
            async for events in batches:
                if calls and any(isinstance(event, dispatch.Delta) for event in events):
                    calls.pop()()
                if isinstance(events[-1], Done | Failed):
                    return events[-1]
        raise AssertionError("the relay ended without a final event")

    try:
        return asyncio.run(asyncio.wait_for(relayed(), HUNG_AFTER))
    except TimeoutError:
        pytest.fail(f"the relay of {request.request_id} still waited after {HUNG_AFTER}s")


def _pending_usage(redis_client, request: RequestInput) -> Usage:
    return Usage.loads(redis_client.hget(protocol.LEDGER_PENDING, request.request_id))


def test_a_request_claimed_by_a_worker_that_died_before_starting_it_is_queued_again_for_another(redis_client):
    _heartbeat(redis_client, "worker@pod-a#live", fresh=True)  # the pool still has a ready worker
    _heartbeat(redis_client, "worker@pod-b#dead", fresh=False)
    request = _enqueued(redis_client)
    assert claim_request(redis_client, request.request_id, "worker@pod-b#dead") is not None
    continuing = _ContinuingWorker(redis_client, request, "worker@pod-a#live", tokens=4)

    # The claimer's heartbeat is gone: no need to wait for the (300 s) claim-to-start bound.
    assert isinstance(_final_event(request), Done)

    attempt = continuing.attempt
    assert (attempt.attempt, attempt.prompt_token_ids, attempt.params["max_tokens"]) == (1, [2, 3, 4], 4)
    assert (attempt.continued_tokens, attempt.earlier_workers) == (0, "worker@pod-b#dead")
    assert continuing.queue == protocol.worker_queue_name("worker@pod-a#live")
    assert not redis_client.hexists(protocol.LEDGER_PENDING, request.request_id)  # the continuing worker's
    # A claimer that is only stalled (not dead) stops the request if it ever starts it.
    assert redis_client.exists(protocol.cancel_key(request.request_id))


def test_a_request_started_by_a_lost_worker_continues_from_the_tokens_already_sent(redis_client, short_bounds):
    short_bounds.WORKER_HEARTBEAT_TIMEOUT = 0.0  # the first quiet keep-alive interval checks the worker
    _heartbeat(redis_client, "worker@pod-a#dies", fresh=True)
    _heartbeat(redis_client, "worker@pod-b#live", fresh=True)
    request = _enqueued(redis_client)
    claim_request(redis_client, request.request_id, "worker@pod-a#dies")
    events = protocol.events_key(request.request_id)
    redis_client.xadd(events, {"t": "start", "w": "worker@pod-a#dies"})
    redis_client.xadd(events, {"t": "delta", "x": "Hi", "n": 1, "k": "17"})
    continuing = _ContinuingWorker(redis_client, request, "worker@pod-b#live", tokens=3)

    # The worker dies once its token is relayed.
    assert isinstance(_final_event(request, lambda: _heartbeat(redis_client, "worker@pod-a#dies", fresh=False)), Done)

    attempt = continuing.attempt
    assert (attempt.prompt_token_ids, attempt.params["max_tokens"], attempt.continued_tokens) == ([2, 3, 4, 17], 3, 1)
    assert attempt.prompt_tokens == 3  # the prompt billed is the client's, the token sent is completion
    assert protocol.attempt_id(attempt) == f"{request.request_id}~1"
    assert redis_client.exists(protocol.cancel_key(request.request_id))  # the lost attempt stops if it lives


def test_with_continuations_off_a_request_of_a_lost_worker_ends_as_worker_lost(redis_client, short_bounds):
    short_bounds.WORKER_HEARTBEAT_TIMEOUT = 0.0
    short_bounds.MAX_CONTINUATIONS = 0
    _heartbeat(redis_client, "worker@pod-a#dies", fresh=True)
    _heartbeat(redis_client, "worker@pod-b#live", fresh=True)
    request = _enqueued(redis_client)
    claim_request(redis_client, request.request_id, "worker@pod-a#dies")
    events = protocol.events_key(request.request_id)
    redis_client.xadd(events, {"t": "start", "w": "worker@pod-a#dies"})
    redis_client.xadd(events, {"t": "delta", "x": "Hi", "n": 1, "k": "17"})

    failure = _final_event(request, lambda: _heartbeat(redis_client, "worker@pod-a#dies", fresh=False))

    assert isinstance(failure, Failed) and failure.code == "worker_lost"
    usage = _pending_usage(redis_client, request)
    assert (usage.status, usage.prompt_tokens, usage.completion_tokens) == ("worker_lost", 3, 1)
    assert not redis_client.exists(protocol.input_key(f"{request.request_id}~1"))


class _ContinuingWorker(threading.Thread):
    """Plays the worker that takes a request's continuation: waits (bounded) for the next attempt's
    input, claims it and writes its events, `tokens` new tokens and its end."""

    def __init__(self, redis_client, request: RequestInput, identity: str, *, tokens: int) -> None:
        super().__init__(daemon=True)
        self.redis, self.request, self.identity, self.tokens = redis_client, request, identity, tokens
        self.attempt: RequestInput | None = None
        self.queue: str | None = None
        self.start()

    def run(self) -> None:
        aid = f"{self.request.request_id}~1"
        deadline = time.monotonic() + HUNG_AFTER
        while not self.redis.exists(protocol.input_key(aid)):
            assert time.monotonic() < deadline, "no continuation was enqueued"
            time.sleep(0.01)
        self.queue = next(key for key in self.redis.keys("worker.*") if self.redis.llen(key))
        self.attempt = RequestInput.loads(claim_request(self.redis, aid, self.identity))
        usage = Usage(request_id=self.request.request_id, tenant_id=7, key_id=9, model="tiny-bounds",
                      prompt_tokens=3, completion_tokens=4, finish_reason="length", worker=self.identity)  # fmt: skip
        events = protocol.events_key(aid)
        self.redis.xadd(events, {"t": "start", "w": self.identity})
        self.redis.xadd(events, {"t": "delta", "x": "x" * self.tokens, "n": self.tokens})
        self.redis.xadd(events, {"t": "done", "u": usage.dumps()})


def test_a_request_claimed_by_a_live_worker_that_never_starts_it_ends_at_the_start_bound(redis_client, short_bounds):
    short_bounds.WORKER_START_TIMEOUT_SECONDS = 0.3
    _heartbeat(redis_client, "worker@pod-a#stuck", fresh=True)
    request = _enqueued(redis_client)
    claim_request(redis_client, request.request_id, "worker@pod-a#stuck")

    failure = _final_event(request)

    assert isinstance(failure, Failed) and failure.code == "worker_lost"
    assert _pending_usage(redis_client, request).status == "worker_lost"
    assert redis_client.exists(protocol.cancel_key(request.request_id))


def test_a_request_whose_input_is_gone_without_a_recorded_claimer_ends_at_the_start_bound(redis_client, short_bounds):
    short_bounds.WORKER_START_TIMEOUT_SECONDS = 0.3
    _heartbeat(redis_client, "worker@pod-a#old", fresh=True)
    request = _enqueued(redis_client)
    redis_client.getdel(protocol.input_key(request.request_id))  # a claim that records no claimer

    failure = _final_event(request)

    assert isinstance(failure, Failed) and failure.code == "worker_lost"
    assert _pending_usage(redis_client, request).worker == ""


def test_a_request_started_by_a_worker_that_came_back_under_the_same_node_name_is_not_continued_without_its_ids(
    redis_client, short_bounds
):
    """The node `worker@pod-a` restarted: its new incarnation heartbeats, the one that started the
    request does not. The tokens relayed came without their ids, so nothing can go on from them."""
    short_bounds.WORKER_HEARTBEAT_TIMEOUT = 0.0  # the first quiet keep-alive interval checks the worker
    _heartbeat(redis_client, "worker@pod-a#before", fresh=True)
    _heartbeat(redis_client, "worker@pod-a#after", fresh=True)
    request = _enqueued(redis_client)
    claim_request(redis_client, request.request_id, "worker@pod-a#before")
    redis_client.xadd(protocol.events_key(request.request_id), {"t": "start", "w": "worker@pod-a#before"})
    redis_client.xadd(protocol.events_key(request.request_id), {"t": "delta", "x": "Hi", "n": 1})

    # It restarts once its token is relayed.
    failure = _final_event(request, lambda: _heartbeat(redis_client, "worker@pod-a#before", fresh=False))

    assert isinstance(failure, Failed) and failure.code == "worker_lost"
    usage = _pending_usage(redis_client, request)
    assert (usage.worker, usage.completion_tokens) == ("worker@pod-a#before", 1)


def test_a_claimed_request_that_starts_within_the_bound_relays_normally(redis_client, short_bounds):
    short_bounds.WORKER_START_TIMEOUT_SECONDS = 0.3
    _heartbeat(redis_client, "worker@pod-a#live", fresh=True)
    request = _enqueued(redis_client)
    claim_request(redis_client, request.request_id, "worker@pod-a#live")
    usage = Usage(request_id=request.request_id, tenant_id=7, key_id=9, model="tiny-bounds", prompt_tokens=3,
                  completion_tokens=1, finish_reason="stop", worker="worker@pod-a#live")  # fmt: skip
    events = protocol.events_key(request.request_id)
    redis_client.xadd(events, {"t": "start", "w": "worker@pod-a#live"})
    redis_client.xadd(events, {"t": "delta", "x": "Hi", "n": 1})
    redis_client.xadd(events, {"t": "done", "u": usage.dumps()})

    assert _final_event(request) == Done(usage)
    assert not redis_client.exists(protocol.cancel_key(request.request_id))


def test_a_request_no_worker_claimed_is_taken_back_at_the_queue_timeout(redis_client, short_bounds):
    short_bounds.QUEUE_TIMEOUT_SECONDS = 0.2
    _heartbeat(redis_client, "worker@pod-a#busy", fresh=True)
    request = _enqueued(redis_client)

    failure = _final_event(request)

    assert isinstance(failure, Failed) and failure.code == "no_worker_available"
    assert not redis_client.exists(protocol.input_key(request.request_id))
    assert _pending_usage(redis_client, request).status == "cancelled"


def test_a_queued_requests_input_expires_after_its_queue_deadline_so_a_late_task_runs_nothing(
    redis_client, short_bounds
):
    """The task itself carries no expiry (Celery would parse one per message on the worker's consumer
    thread): the request's input outlives the gateway's queue deadline by a margin, then expires, and
    a worker that takes the task after that claims nothing."""
    import json

    short_bounds.QUEUE_TIMEOUT_SECONDS = 0.2
    request = RequestInput(request_id=f"req-{time.monotonic_ns()}", model="tiny-bounds", prompt_token_ids=[2, 3],
                           params={}, tenant_id=7, key_id=9, enqueued_at=time.time())  # fmt: skip
    redis_client.delete(protocol.queue_name(POOL))
    dispatch.enqueue(request, _model())

    (message,) = redis_client.lrange(protocol.queue_name(POOL), 0, -1)
    assert json.loads(message)["headers"]["expires"] is None
    ttl_ms = redis_client.pttl(protocol.input_key(request.request_id))
    deadline_ms = 1000 * (0.2 + dispatch.INPUT_TTL_AFTER_QUEUE_DEADLINE_SECONDS)
    assert deadline_ms - 5000 < ttl_ms <= deadline_ms
    redis_client.pexpire(protocol.input_key(request.request_id), 1)  # what that much later looks like
    while redis_client.exists(protocol.input_key(request.request_id)):
        time.sleep(0.01)
    assert claim_request(redis_client, request.request_id, "worker@pod-a#late") is None
    redis_client.delete(protocol.queue_name(POOL))
