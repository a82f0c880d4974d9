"""One reader of the request event streams per event loop: a single blocking XREAD for all of them.

A worker writes what all its requests produced since its last flush in one MULTI/EXEC. With one
blocking XREAD per open stream, that flush woke every stream's coroutine with its own Redis reply:
a round trip, a reply to parse and a connection held per open stream, so the gateway's cost per
token grew with the number of streams. Here one reader task per event loop (one per web process)
blocks on the streams of every request it relays at once, wakes once per flush, and hands each
subscription its new entries; a stream holds no connection of its own.

A subscription added while the reader is blocked must not wait long for that read to end: the
reader also watches a wake stream of its own, which is written to when the read in flight has not
ended by itself within WAKE_DELAY_SECONDS of a new subscription and still leaves one out. Under load
a read ends every few milliseconds (each worker flush), so most new streams cost no wake and no
extra read; and a new request's first event cannot come sooner than a worker has claimed and
started it. Should a wake ever miss all the same, no read blocks longer than READ_BLOCK_SECONDS:
the next one includes every stream, and the miss is logged.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
import weakref
from collections.abc import AsyncIterator

from django.conf import settings

from config.redis_client import get_async_redis
from contract.outage import REDIS_UNAVAILABLE

log = logging.getLogger(__name__)

# While Redis is unreachable, subscribers hear of it this often; past RELAY_OUTAGE_SECONDS they raise.
OUTAGE_RETRY_SECONDS = 0.5
RELAY_OUTAGE_SECONDS = 30.0
# Entries read per stream and per read (the rest come with the next read).
READ_COUNT = 256
WAKE_KEY_SECONDS = 300
WAKE_DELAY_SECONDS = 0.005
# The longest a stream left out of the read in flight can wait for the next one (an idle web
# process reads once per this interval).
READ_BLOCK_SECONDS = 1.0

Entry = tuple[str, dict]


class _Outage:
    """Put in a subscription's queue when a read failed because Redis is unreachable."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Broken(_Outage):
    """Put in a subscription's queue when a read failed otherwise: its stream ends with the error."""


class _Subscription:
    def __init__(self, key: str) -> None:
        self.key = key
        self.last_id = "0-0"
        self.queue: asyncio.Queue[list[Entry] | _Outage] = asyncio.Queue()


class StreamReader:
    """The event loop's reader: `batches(key)` yields a stream's new entries as they come."""

    def __init__(self) -> None:
        self._subscriptions: dict[str, _Subscription] = {}
        self._wake_key = f"gw:wake:{uuid.uuid4().hex}"
        self._wake_id = "0-0"
        self._reading = False  # a blocking read is in flight
        self._read_keys: frozenset[str] = frozenset()  # ... the streams it reads
        self._woken = False  # ... and a wake was already written for it
        self._wake_timer: asyncio.TimerHandle | None = None  # ... or is due (a new stream waits)
        self._task: asyncio.Task | None = None
        self._wakes: set[asyncio.Task] = set()

    async def batches(self, key: str) -> AsyncIterator[list[Entry] | None]:
        """The stream's new entries: [] after a quiet keep-alive interval, None every
        OUTAGE_RETRY_SECONDS while Redis is unreachable; past RELAY_OUTAGE_SECONDS the error is raised.

        A Redis restart is ridden out: reading resumes after the last entry seen, so nothing is
        lost or repeated."""
        if key in self._subscriptions:
            raise RuntimeError(f"{key} is already being read")
        subscription = self._subscriptions[key] = _Subscription(key)
        try:
            self._start_or_wake_soon()
            outage_since = None
            while True:
                try:
                    async with asyncio.timeout(settings.SSE_KEEPALIVE_SECONDS):
                        item = await subscription.queue.get()
                except TimeoutError:
                    outage_since = None  # an outage reports itself more often than this
                    yield []
                    continue
                if isinstance(item, _Broken):
                    raise item.error
                if isinstance(item, _Outage):
                    outage_since = outage_since or time.monotonic()
                    if time.monotonic() - outage_since > RELAY_OUTAGE_SECONDS:
                        raise item.error
                    yield None
                    continue
                outage_since = None
                yield item
        finally:
            self._subscriptions.pop(key, None)
            if not self._subscriptions:
                # The read in flight is for nobody: let the reader stop. Shielded: a response task
                # cancelled while this closes (a client that left) must not leave the wake unsent,
                # the read blocked on finished streams, and a stream opened meanwhile waiting.
                # (A response whose body is sent is let finish: config/asgi.py.)
                await asyncio.shield(self._wake_in_background())

    def _start_or_wake_soon(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())
        elif self._reading and self._wake_timer is None:
            # The read in flight does not include the new stream: end it unless it ends by itself.
            self._wake_timer = asyncio.get_running_loop().call_later(WAKE_DELAY_SECONDS, self._wake_late)

    def _wake_late(self) -> None:
        self._wake_timer = None
        if not self._left_out():
            return  # a read that includes every stream began meanwhile
        # Whether or not a wake was written for this read already: the new stream must not depend
        # on one written for another reason.
        self._wake_in_background(always=True)

    def _wake_in_background(self, *, always: bool = False) -> asyncio.Task:
        task = asyncio.ensure_future(self._wake(always=always))
        self._wakes.add(task)  # the loop keeps only a weak reference
        task.add_done_callback(self._wakes.discard)
        return task

    def _left_out(self) -> list[str]:
        """The streams subscribed to that the read in flight does not include."""
        return [key for key in self._subscriptions if key not in self._read_keys] if self._reading else []

    async def _wake(self, *, always: bool = False) -> None:
        """End the blocking read in flight, if any (one wake per read unless `always`)."""
        if self._reading and (always or not self._woken):
            self._woken = True
            pipe = get_async_redis().pipeline(transaction=False)
            pipe.xadd(self._wake_key, {"w": 1}, maxlen=1, approximate=False)
            pipe.expire(self._wake_key, WAKE_KEY_SECONDS)  # outlives every read; gone with the process
            try:
                await pipe.execute()
            except REDIS_UNAVAILABLE:
                pass  # the reader is failing too; its next read includes the new stream

    async def _run(self) -> None:
        redis = get_async_redis()
        block_ms = int(READ_BLOCK_SECONDS * 1000)
        while self._subscriptions:
            streams = {sub.key: sub.last_id for sub in self._subscriptions.values()}
            self._read_keys = frozenset(streams)
            streams[self._wake_key] = self._wake_id
            self._reading, self._woken = True, False
            try:
                reply = await redis.xread(streams, block=block_ms, count=READ_COUNT)
            except REDIS_UNAVAILABLE as exc:
                self._tell_all(_Outage(exc))
                await asyncio.sleep(OUTAGE_RETRY_SECONDS)
                continue
            except Exception as exc:
                # Not expected (a key of another type, a protocol error): the streams read now
                # end with it rather than wait forever.
                log.exception("reading the request streams failed")
                self._tell_all(_Broken(exc))
                self._subscriptions.clear()
                continue
            else:
                if not reply:  # the read timed out: a stream it left out waited for a wake that never came
                    _log_missed_wake(self._left_out())
            finally:
                self._reading = False
                if self._wake_timer is not None:  # the next read includes the new streams
                    self._wake_timer.cancel()
                    self._wake_timer = None
            for key, entries in reply or ():
                if key == self._wake_key:
                    self._wake_id = entries[-1][0]
                    continue
                sub = self._subscriptions.get(key)
                if sub is not None and entries:
                    sub.last_id = entries[-1][0]
                    sub.queue.put_nowait(entries)

    def _tell_all(self, item: _Outage) -> None:
        for sub in self._subscriptions.values():
            sub.queue.put_nowait(item)


def _log_missed_wake(left_out: list[str]) -> None:
    """A read ended by its own timeout while it left streams out: no wake came for them."""
    if not left_out:
        return
    log.warning(
        "%d new stream(s) waited up to %.1f s for a read: no wake ended the read in flight that left them out (%s)",
        len(left_out), READ_BLOCK_SECONDS, ", ".join(left_out[:4]),
    )  # fmt: skip


# Readers belong to the event loop that runs them (the ASGI server has one per process; tests may
# run several in turn). Weak keys: a closed loop's reader goes with it.
_readers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, StreamReader] = weakref.WeakKeyDictionary()


def stream_reader() -> StreamReader:
    """The running event loop's reader (call from a coroutine)."""
    loop = asyncio.get_running_loop()
    reader = _readers.get(loop)
    if reader is None:
        reader = _readers[loop] = StreamReader()
    return reader
