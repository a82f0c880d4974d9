"""A worker killed between claiming a request and starting it: the request ends as `worker_lost`
as soon as its claimer stops heartbeating (not at the queue or start timeout), its usage reaches the
ledger exactly once, and its quota reservation is released.

The window is hit by state, not by timing: the worker runs `tests.e2e.held_claims`, which claims
requests and announces each claim, then holds it; the test kills the worker once the claim is
announced. The same holds when the worker comes back at once under its old name (`held@<host>`, as
a restarted pod or `make up` would): its new process has a new identity, so it does not keep the
old process's request alive.
"""

import json
import signal
import time

import httpx
import pytest
import redis

from contract import protocol
from tests.e2e.held_claims import HELD_KEY
from tests.e2e.stack import wait_until, wait_usage_row

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

HELD_POOL = "held"
HELD_MODEL = "tiny-held"


def test_a_worker_killed_after_claiming_a_request_ends_it_as_worker_lost_once(tiny_stack, make_tenant):
    _claimed_then_killed(tiny_stack, make_tenant, "alice", restarted=False)


def test_a_worker_back_under_its_old_name_does_not_keep_the_lost_request_alive(tiny_stack, make_tenant):
    _claimed_then_killed(tiny_stack, make_tenant, "bob", restarted=True)


def _claimed_then_killed(tiny_stack, make_tenant, tenant: str, *, restarted: bool) -> None:
    from ledger.models import UsageRecord

    stack = tiny_stack
    client = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    stack.register_model(HELD_MODEL, pool=HELD_POOL)
    _, key = make_tenant(tenant)
    stack.manage("setquota", tenant, "--concurrency", "1")  # a leaked reservation refuses the next request
    headers = {"Authorization": f"Bearer {key}"}
    stack.start_worker(name="held", pool=HELD_POOL, concurrency=2, app="tests.e2e.held_claims")
    try:
        stack.wait_ready(pool=HELD_POOL)
        body = {"model": HELD_MODEL, "prompt": "Go", "max_tokens": 16, "stream": True}
        with httpx.stream("POST", f"{stack.base_url}/v1/completions", json=body, headers=headers,
                          timeout=120) as response:  # fmt: skip
            assert response.status_code == 200, response.read()
            request_id = response.headers["x-request-id"]
            lines = response.iter_lines()  # held: a dropped line iterator closes the connection
            wait_until(lambda: client.sismember(HELD_KEY, request_id), "the worker never claimed the request", 120)
            claimer = client.get(protocol.claim_key(request_id))
            assert claimer and claimer.startswith("held@"), claimer
            assert not client.exists(protocol.events_key(request_id)), "the held request started"
            stack.stop("held", sig=signal.SIGKILL)
            if restarted:
                # Back at once under the same node name, heartbeating before the old beat goes stale.
                stack.start_worker(name="held", pool=HELD_POOL, concurrency=2, app="tests.e2e.held_claims")
                node = claimer.split("#")[0]
                wait_until(  # the same node name heartbeats again, under another identity
                    lambda: node in _heartbeating_nodes(stack, exclude=claimer), "the worker never came back", 600
                )
            events = [line[6:] for line in lines if line.startswith("data: ")]
    finally:
        if "held" in stack.children:
            stack.stop("held", sig=signal.SIGKILL)

    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    # Ended by the claimer's lost heartbeat (WORKER_HEARTBEAT_TIMEOUT, 12 s here), not by the
    # claim-to-start bound or the queue timeout, whose messages differ.
    assert (error["code"], error["type"]) == ("worker_lost", "server_error"), error
    assert error["message"] == "The worker that took this request was lost before starting it."

    row = wait_usage_row(request_id, timeout=60)
    assert (row.status, row.worker, row.completion_tokens) == ("worker_lost", claimer, 0)
    assert UsageRecord.objects.filter(request_id=request_id).count() == 1
    assert not client.hexists(protocol.LEDGER_PENDING, request_id)

    # The reservation was released (concurrency 1): the next request is served by the pool's live worker.
    after = httpx.post(f"{stack.base_url}/v1/completions", headers=headers, timeout=120,
                       json={"model": "tiny-gemma4", "prompt": "Hi", "max_tokens": 4})  # fmt: skip
    assert after.status_code == 200, after.text


def _heartbeating_nodes(stack, *, exclude: str) -> set[str]:
    """The node names of the held pool's workers that heartbeat now, but for identity `exclude`."""
    client = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    fresh = protocol.fresh_workers(client, HELD_POOL, since=time.time() - 30)
    return {identity.split("#")[0] for identity in fresh if identity != exclude}
