"""A worker's Redis calls wait out an outage (contract/outage.py `through_outage`): claiming
requests (workers/claims.py) and the relay's writes (workers/relay.py), which a lost reply never
doubles."""

import asyncio
import os

import pytest
import redis

from contract import outage, protocol
from contract.outage import through_outage
from contract.protocol import RequestInput, Usage
from workers import claims
from workers.claims import ClaimBatcher
from workers.relay import EventRelay, RelayedRequest, relay_client


def _flaky(failures: int, result="written"):
    calls = []

    async def call():
        calls.append(1)
        if len(calls) <= failures:
            raise redis.ConnectionError("Error while reading from 127.0.0.1:6379 : (104, 'Connection reset by peer')")
        return result

    return call, calls


@pytest.mark.asyncio
async def test_a_call_is_retried_until_redis_is_back(monkeypatch):
    monkeypatch.setattr(outage, "OUTAGE_BACKOFF_SECONDS", (0.001, 0.001))
    call, calls = _flaky(failures=3)
    assert await through_outage(call, seconds=30, what="testing") == "written"
    assert len(calls) == 4


@pytest.mark.asyncio
async def test_a_call_gives_up_after_its_bound():
    call, calls = _flaky(failures=10**6)
    with pytest.raises(redis.ConnectionError):
        await through_outage(call, seconds=0.2, what="testing")
    assert 2 <= len(calls) < 10  # backed off, not spun


@pytest.mark.asyncio
async def test_other_errors_are_not_retried():
    async def call():
        raise redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value")

    with pytest.raises(redis.ResponseError):
        await through_outage(call, seconds=30, what="testing")


@pytest.mark.asyncio
async def test_claims_asked_for_during_an_outage_are_made_once_redis_is_back(redis_client, monkeypatch):
    monkeypatch.setattr(outage, "OUTAGE_BACKOFF_SECONDS", (0.001, 0.001))
    redis_client.set(protocol.input_key("cmpl-outage"), "{}")
    real, failures = claims.claim_requests, []

    async def claim_after_an_outage(client, rids, worker):
        if len(failures) < 3:
            failures.append(1)
            raise redis.ConnectionError("Connection refused")
        return await real(client, rids, worker)

    monkeypatch.setattr(claims, "claim_requests", claim_after_an_outage)
    client = relay_client(os.environ["REDIS_URL"])
    try:
        batcher = ClaimBatcher(client, "w-test")
        inputs = await asyncio.wait_for(asyncio.gather(batcher.claim("cmpl-outage"), batcher.claim("cmpl-gone")), 30)
        assert inputs == ["{}", None]
        # An outage past the bound: the claim fails (its task with it) rather than waiting forever.
        batcher.retry_seconds = 0
        failures.clear()
        with pytest.raises(redis.ConnectionError):
            await asyncio.wait_for(batcher.claim("cmpl-other"), 30)
    finally:
        await client.aclose()

    assert redis_client.get(protocol.claim_key("cmpl-outage")) == "w-test"
    assert batcher.batches == 1


class _ReplyLostOnce:
    """An async client whose first EXEC reaches Redis but whose reply is lost (a restart between)."""

    def __init__(self, client):
        self.client, self.lost = client, False

    def pipeline(self, **kwargs):
        pipe, outer = self.client.pipeline(**kwargs), self
        execute = pipe.execute

        async def losing_execute(**kw):
            result = await execute(**kw)
            if not outer.lost:
                outer.lost = True
                raise redis.ConnectionError("Connection closed by server.")
            return result

        pipe.execute = losing_execute
        return pipe

    def __getattr__(self, name):
        return getattr(self.client, name)


@pytest.mark.asyncio
async def test_a_flush_retried_after_its_reply_was_lost_is_written_once(redis_client, monkeypatch):
    monkeypatch.setattr(outage, "OUTAGE_BACKOFF_SECONDS", (0.001, 0.001))
    relay = EventRelay(
        None, _ReplyLostOnce(relay_client(os.environ["REDIS_URL"])), worker="w-test",
        flush_interval=0.02, flush_events_per_second=0,
    )  # fmt: skip
    await relay._start()
    request = RequestInput(
        request_id="cmpl-lost", model="m", prompt_token_ids=[2, 3, 4], params={}, tenant_id=1, key_id=1, enqueued_at=0.0
    )
    job = RelayedRequest(request, Usage(request_id=request.request_id, tenant_id=1, key_id=1, model="m"), relay)
    try:
        job.push("Hello", [5], False, None)
        await asyncio.wait_for(relay.flush([job]), 30)  # its reply is lost: retried, refused as a duplicate
        job.push(" world", [6], True, "length")
        await asyncio.wait_for(relay.flush([job]), 30)
    finally:
        await relay.stop()

    events = [fields for _, fields in redis_client.xrange(protocol.events_key(request.request_id))]
    assert [(event["t"], event.get("x")) for event in events] == [
        ("start", None), ("delta", "Hello"), ("delta", " world"), ("done", None),
    ]  # fmt: skip
    assert Usage.loads(redis_client.hget(protocol.LEDGER_PENDING, request.request_id)).completion_tokens == 2
    assert job.done.done()


@pytest.mark.asyncio
async def test_overlapping_flushes_write_each_entry_once_and_in_order(redis_client):
    """The flusher and a second flush of the same request at once: one waits for the other, and the
    done entry (with the usage) is written once."""
    relay = EventRelay(
        None, relay_client(os.environ["REDIS_URL"]), worker="w-test", flush_interval=0.02, flush_events_per_second=0
    )
    await relay._start()
    request = RequestInput(
        request_id="cmpl-overlap", model="m", prompt_token_ids=[2], params={}, tenant_id=1, key_id=1, enqueued_at=0.0
    )
    job = RelayedRequest(request, Usage(request_id=request.request_id, tenant_id=1, key_id=1, model="m"), relay)
    try:
        job.push("Hi", [5], True, "stop")  # wakes the flusher too
        await asyncio.wait_for(asyncio.gather(relay.flush([job]), relay.flush([job])), 30)
        await asyncio.wait_for(job.done, 30)
    finally:
        await relay.stop()

    events = [fields for _, fields in redis_client.xrange(protocol.events_key(request.request_id))]
    assert [(event["t"], event.get("x")) for event in events] == [("start", None), ("delta", "Hi"), ("done", None)]
