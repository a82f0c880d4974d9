"""A request's slot is let go only once its end is in Redis, also when the engine ends it while the
relay's previous write (without that end) is on its way: the slot bounds what the worker runs, and
a drain waits for the requests still in flight before the pod stops."""

import asyncio
import os
import uuid

from contract import protocol
from contract.protocol import RequestInput, Usage
from workers.relay import EventRelay, RelayedRequest, relay_client


class _ClientEndingDuringTheWrite:
    """The relay's real client; while its first pipeline is on its way, `during_first_write` runs
    (here: the engine ends the request)."""

    def __init__(self, client, during_first_write):
        self.client, self.during_first_write, self.writes = client, during_first_write, 0

    def pipeline(self, **kwargs):
        pipe, outer = self.client.pipeline(**kwargs), self
        execute = pipe.execute

        async def execute_with_hook(**kw):
            outer.writes += 1
            if outer.writes == 1:
                outer.during_first_write()
            return await execute(**kw)

        pipe.execute = execute_with_hook
        return pipe

    def __getattr__(self, name):
        return getattr(self.client, name)


def _ended(redis_client, rid: str) -> bool:
    return any(fields["t"] == "done" for _, fields in redis_client.xrange(protocol.events_key(rid)))


def test_a_request_that_ends_during_a_write_is_let_go_only_after_the_write_of_its_end(redis_client):
    request = RequestInput(
        request_id=f"cmpl-{uuid.uuid4().hex[:12]}", model="m", prompt_token_ids=[1, 2], params={"max_tokens": 2},
        tenant_id=1, key_id=1, enqueued_at=0.0,
    )  # fmt: skip

    async def scenario():
        jobs = []
        client = _ClientEndingDuringTheWrite(
            relay_client(os.environ["REDIS_URL"]),
            during_first_write=lambda: jobs[0].push("b", [8], True, "length"),
        )
        relay = EventRelay(None, client, worker="w-release", flush_interval=0.02, flush_events_per_second=250)
        # The flusher's state, without its background tasks: the test runs each flush itself.
        relay._wake, relay._urgent, relay._flushing = asyncio.Event(), asyncio.Event(), asyncio.Lock()
        job = RelayedRequest(request, Usage(request.request_id, 1, 1, "m", worker="w-release"), relay)
        jobs.append(job)
        job.push("a", [7], False, None)

        await relay.flush([job])  # the start and the first text; the request ends meanwhile
        let_go_early = job.done.done()
        written_before_its_end = _ended(redis_client, request.request_id)
        await relay.flush([job])  # its last text and its end
        await client.client.aclose()
        return let_go_early, written_before_its_end, job.done.done()

    let_go_early, written_before_its_end, let_go_at_last = asyncio.run(scenario())

    assert not written_before_its_end
    assert not let_go_early  # its slot would have come free with its end not yet in Redis
    assert let_go_at_last and _ended(redis_client, request.request_id)
