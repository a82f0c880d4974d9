"""The gateway's one reader of the request streams per event loop (gateway/streams.py), against the
suite's real Redis, and through an outage played by a fake."""

import asyncio
from contextlib import aclosing, asynccontextmanager

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway import streams

pytestmark = pytest.mark.asyncio

# Far longer than any wait below: a test that needed the keep-alive to pass would time out instead.
KEEPALIVE_SECONDS = 120


@pytest.fixture
def reader(settings, redis_client, monkeypatch):
    settings.SSE_KEEPALIVE_SECONDS = KEEPALIVE_SECONDS
    # A read ends by itself only after the test: what serves a stream is a wake or a worker's entry.
    monkeypatch.setattr(streams, "READ_BLOCK_SECONDS", KEEPALIVE_SECONDS)
    return streams.StreamReader()


def _blocked_stream_reads(redis_client) -> int:
    """Connections to this test's Redis database blocked in an XREAD right now."""
    db = str(redis_client.connection_pool.connection_kwargs.get("db", 0))
    return sum(
        1
        for client in redis_client.client_list()
        if client["db"] == db and client["cmd"] == "xread" and "b" in client["flags"]
    )


async def _until(predicate, what: str) -> None:
    async with asyncio.timeout(60):
        while not predicate():
            await asyncio.sleep(0.01)
    assert predicate(), what


async def test_many_open_streams_are_read_by_one_blocked_connection(reader, redis_client):
    """The old design held one blocking XREAD (and one connection) per open stream."""
    keys = [f"req:s{i}:ev" for i in range(40)]
    readers = [aclosing(reader.batches(key)) for key in keys]
    opened = [await stack.__aenter__() for stack in readers]
    firsts = [asyncio.ensure_future(anext(batches)) for batches in opened]
    try:
        await _until(lambda: len(reader._subscriptions) == len(keys) and reader._reading, "all streams subscribed")
        await _until(lambda: _blocked_stream_reads(redis_client) == 1, "one blocked read")
        await asyncio.sleep(0.2)  # room for any other reader a regression would start
        assert _blocked_stream_reads(redis_client) == 1

        pipe = redis_client.pipeline()
        for i, key in enumerate(keys):
            pipe.xadd(key, {"t": "delta", "x": f"text {i}", "n": "1"})
        pipe.execute()
        async with asyncio.timeout(60):
            batches = await asyncio.gather(*firsts)
        assert [batch[0][1]["x"] for batch in batches] == [f"text {i}" for i in range(len(keys))]
    finally:
        for stack in readers:
            await stack.__aexit__(None, None, None)
    assert reader._subscriptions == {}


@asynccontextmanager
async def _a_stream_opened_during_a_blocked_read(
    reader, redis_client, blocked: str, opened: str, *, wake_counted_already: bool = False
):
    """The reader blocked on stream `blocked` alone, then stream `opened` subscribed, its start entry
    written: the pending first batches of both. `wake_counted_already`: the read in flight counts
    a wake as written that never went out (one cancelled on its way, say)."""
    async with aclosing(reader.batches(blocked)) as first:
        pending_blocked = asyncio.ensure_future(anext(first))
        await _until(lambda: _blocked_stream_reads(redis_client) == 1, "the reader blocks on the first stream")
        reader._woken = wake_counted_already
        async with aclosing(reader.batches(opened)) as second:
            pending_opened = asyncio.ensure_future(anext(second))
            redis_client.xadd(opened, {"t": "start", "w": "worker-1"})
            yield pending_blocked, pending_opened


@pytest.mark.parametrize("wake_counted_already", [False, True])
async def test_a_stream_opened_during_a_blocked_read_gets_its_entries_without_waiting_for_the_read(
    reader, redis_client, wake_counted_already
):
    """Also when the read in flight counts a wake that never came: the new stream gets its own."""
    async with _a_stream_opened_during_a_blocked_read(
        reader, redis_client, "req:first:ev", "req:second:ev", wake_counted_already=wake_counted_already
    ) as (pending_first, pending_second):
        # Without a wake, the read in flight (first stream only) would hold it for the keep-alive.
        async with asyncio.timeout(KEEPALIVE_SECONDS / 4):
            batch = await pending_second
        assert batch[0][1] == {"t": "start", "w": "worker-1"}
        assert not pending_first.done()
        redis_client.xadd("req:first:ev", {"t": "done", "u": "{}"})
        async with asyncio.timeout(60):
            assert (await pending_first)[0][1]["t"] == "done"


async def test_a_stream_opened_during_a_read_that_ends_by_itself_costs_no_wake(reader, redis_client, monkeypatch):
    """Under load reads end every few milliseconds: a new stream joins the next one, unwoken."""
    monkeypatch.setattr(streams, "WAKE_DELAY_SECONDS", KEEPALIVE_SECONDS)  # only the read's own end can serve it
    async with _a_stream_opened_during_a_blocked_read(reader, redis_client, "req:busy:ev", "req:new:ev") as (
        pending_busy,
        pending_new,
    ):
        redis_client.xadd("req:busy:ev", {"t": "delta", "x": "a", "n": "1"})  # ends the read in flight
        async with asyncio.timeout(60):
            batch = await pending_new
        assert batch[0][1] == {"t": "start", "w": "worker-1"}
        assert (await pending_busy)[0][1]["x"] == "a"
        assert not redis_client.exists(reader._wake_key)


async def test_a_stream_a_wake_missed_waits_no_longer_than_one_read_block(reader, redis_client, monkeypatch, caplog):
    """Should a wake miss whatever the cause (here: none is ever written), the next read includes
    the stream once the read in flight ends by its own timeout, and the miss is logged."""
    monkeypatch.setattr(streams, "WAKE_DELAY_SECONDS", KEEPALIVE_SECONDS)
    monkeypatch.setattr(streams, "READ_BLOCK_SECONDS", 0.2)
    async with aclosing(reader.batches("req:quiet:ev")) as quiet:
        pending_quiet = asyncio.ensure_future(anext(quiet))
        await _until(lambda: _blocked_stream_reads(redis_client) == 1, "the reader blocks on the quiet stream")
        async with aclosing(reader.batches("req:late:ev")) as late:
            pending_late = asyncio.ensure_future(anext(late))
            redis_client.xadd("req:late:ev", {"t": "start", "w": "worker-1"})
            async with asyncio.timeout(60):
                batch = await pending_late
            assert batch[0][1] == {"t": "start", "w": "worker-1"}
            assert not redis_client.exists(reader._wake_key)  # served by the next read, not a wake
        redis_client.xadd("req:quiet:ev", {"t": "done", "u": "{}"})
        async with asyncio.timeout(60):
            assert (await pending_quiet)[0][1]["t"] == "done"
    missed = [record.getMessage() for record in caplog.records if "no wake ended the read" in record.getMessage()]
    assert missed and "req:late:ev" in missed[0]


class _SlowPipelines:
    """The suite's Redis client, whose pipelines take a moment before they send (a connection being
    checked out and tested, say); `sending` is set once one has begun."""

    def __init__(self, client) -> None:
        self.client, self.sending = client, asyncio.Event()

    def __getattr__(self, name):
        return getattr(self.client, name)

    def pipeline(self, **kwargs):
        pipe = self.client.pipeline(**kwargs)
        execute = pipe.execute

        async def slow_execute(*args, **kw):
            self.sending.set()
            await asyncio.sleep(0.05)
            return await execute(*args, **kw)

        pipe.execute = slow_execute
        return pipe


async def test_the_last_stream_closed_by_a_task_cancelled_meanwhile_still_wakes_the_reader(
    reader, redis_client, monkeypatch
):
    """The server cancels a response's task once its body is sent (config/asgi.py), possibly while
    the stream's generator closes: the wake that lets the reader stop must go out all the same. Left
    unsent, the read blocked on a finished stream, and a stream opened meanwhile in that process
    waited for it (a 5.0 s request on an H100, docs/gpu.md)."""
    slow = _SlowPipelines(streams.get_async_redis())
    monkeypatch.setattr(streams, "get_async_redis", lambda: slow)
    batches = reader.batches("req:only:ev")
    pending = asyncio.ensure_future(anext(batches))
    await _until(lambda: _blocked_stream_reads(redis_client) == 1, "the reader blocks on the stream")
    redis_client.xadd("req:only:ev", {"t": "done", "u": "{}"})
    async with asyncio.timeout(60):
        assert (await pending)[0][1]["t"] == "done"
    closing = asyncio.ensure_future(batches.aclose())
    async with asyncio.timeout(60):
        await slow.sending.wait()  # the wake is on its way
    closing.cancel()
    await _until(lambda: reader._task.done(), "the reader stops: its read was woken")


async def test_a_stream_reads_what_was_written_before_it_opened_and_nothing_twice(reader, redis_client):
    redis_client.xadd("req:early:ev", {"t": "start", "w": "w"})
    async with aclosing(reader.batches("req:early:ev")) as batches:
        assert [fields["t"] for _, fields in await anext(batches)] == ["start"]
        redis_client.xadd("req:early:ev", {"t": "delta", "x": "a", "n": "1"})
        assert [fields["t"] for _, fields in await anext(batches)] == ["delta"]


async def test_a_quiet_stream_yields_an_empty_batch_after_the_keepalive(settings, redis_client):
    settings.SSE_KEEPALIVE_SECONDS = 0.05
    async with aclosing(streams.StreamReader().batches("req:quiet:ev")) as batches:
        assert await anext(batches) == []


class _RestartingRedis:
    """XREAD of a Redis that restarts: `failures` reads fail (a blocked read fails as it is woken),
    then the read answers with the entries past the stream's id, blocking until there are some."""

    def __init__(self, entries: list):
        self.entries, self.failures, self.reads = entries, 0, []
        self.changed = asyncio.Event()
        self.wakes = 0

    def pipeline(self, transaction):
        return _WakePipeline(self)

    def restart(self, failures: int, *new_entries) -> None:
        self.failures = failures
        self.entries.extend(new_entries)
        self.changed.set()

    async def xread(self, streams_, block, count):
        self.reads.append(dict(streams_))
        after = streams_["req:x:ev"]
        while True:
            if self.failures:
                self.failures -= 1
                raise RedisConnectionError(
                    "Error while reading from 127.0.0.1:6379 : (104, 'Connection reset by peer')"
                )
            fresh = [(entry_id, fields) for entry_id, fields in self.entries if entry_id > after]
            if fresh:
                return [("req:x:ev", fresh)]
            if self.wakes:
                self.wakes -= 1
                wake_key = next(key for key in streams_ if key != "req:x:ev")
                return [(wake_key, [("1-0", {"w": "1"})])]
            self.changed.clear()
            try:
                async with asyncio.timeout(block / 1000):
                    await self.changed.wait()
            except TimeoutError:
                return None  # as Redis answers a read that blocked for its whole time


class _WakePipeline:
    def __init__(self, redis: _RestartingRedis):
        self.redis = redis

    def xadd(self, *args, **kwargs):
        self.redis.wakes += 1

    def expire(self, *args):
        pass

    async def execute(self):
        self.redis.changed.set()


async def test_a_stream_rides_out_a_redis_restart_and_resumes_where_it_was(monkeypatch, settings):
    settings.SSE_KEEPALIVE_SECONDS = KEEPALIVE_SECONDS
    redis = _RestartingRedis(entries=[("1-0", {"t": "delta", "x": "a", "n": "1"})])
    monkeypatch.setattr(streams, "get_async_redis", lambda: redis)
    monkeypatch.setattr(streams, "OUTAGE_RETRY_SECONDS", 0)
    async with aclosing(streams.StreamReader().batches("req:x:ev")) as batches:
        assert await anext(batches) == [("1-0", {"t": "delta", "x": "a", "n": "1"})]
        redis.restart(2, ("2-0", {"t": "delta", "x": "b", "n": "1"}))  # the next two reads fail
        assert [await anext(batches), await anext(batches)] == [None, None]
        assert await anext(batches) == [("2-0", {"t": "delta", "x": "b", "n": "1"})]  # nothing lost or repeated
    assert [read["req:x:ev"] for read in redis.reads[:4]] == ["0-0", "1-0", "1-0", "1-0"]


async def test_a_stream_gives_up_on_a_redis_that_stays_down(monkeypatch, settings):
    settings.SSE_KEEPALIVE_SECONDS = KEEPALIVE_SECONDS
    redis = _RestartingRedis(entries=[])
    redis.failures = 10**6
    monkeypatch.setattr(streams, "get_async_redis", lambda: redis)
    monkeypatch.setattr(streams, "OUTAGE_RETRY_SECONDS", 0.01)
    monkeypatch.setattr(streams, "RELAY_OUTAGE_SECONDS", 0.1)
    with pytest.raises(RedisConnectionError):
        async with aclosing(streams.StreamReader().batches("req:x:ev")) as batches:
            async for batch in batches:
                assert batch is None
