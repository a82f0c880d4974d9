"""A thread's view of one engine request: ``open_stream(host, ...)`` submits a request to an
``EngineHost`` and returns its chunks as an iterator, for tests that drive the engine directly.

The product hands a request's outputs to a sink on the engine's event loop (``EngineHost.submit``,
workers/relay.py); this reader is a sink too. Coalesced: at most one ``EngineChunk``
per ``flush_interval``, the first and the last chunk without delay; the loop only appends to a
buffer and wakes the reader when it waits for output or the request ends.

Typical use::

    host = EngineHost(model_path, profile="cpu")
    host.start()                                  # blocks until the engine is ready
    with open_stream(host, "req-1", prompt_ids, {"max_tokens": 64}) as chunks:
        for chunk in chunks:                      # closing early aborts the request
            ...
    host.shutdown()
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from workers.engine import EngineHost


def open_stream(
    host: EngineHost,
    request_id: str,
    prompt_token_ids: list[int],
    params: Mapping[str, Any] | None = None,
    flush_interval: float = 0.02,
    multi_modal_data: Mapping[str, Any] | None = None,
) -> EngineStream:
    """Submit a request now and return its chunks (see ``EngineChunk``), for a reader thread.

    Raises like ``EngineHost.submit``; errors the engine reports later are raised by the iteration.
    """
    buf = RequestBuffer(request_id, len(prompt_token_ids), time.monotonic())
    host.submit(request_id, prompt_token_ids, params, buf, multi_modal_data=multi_modal_data)
    return EngineStream(host, buf, flush_interval)


def abort(host: EngineHost, request_id: str) -> None:
    """Abort a request in the engine (no-op if unknown or finished); its stream ends with ``abort``."""
    loop, engine = host.loop, host._engine
    if loop is None or engine is None or loop.is_closed():
        return
    with contextlib.suppress(RuntimeError):  # the loop stopped meanwhile
        asyncio.run_coroutine_threadsafe(engine.abort(request_id), loop)


def unfinished_requests(host: EngineHost) -> int:
    """Requests the engine still tracks (submitted, not finished or aborted)."""
    loop, engine = host.loop, host._engine
    if loop is None or engine is None:
        return 0

    async def count() -> int:
        return engine.get_num_unfinished_requests()

    return asyncio.run_coroutine_threadsafe(count(), loop).result(timeout=10)


@dataclass(frozen=True, slots=True)
class EngineChunk:
    """New output of one request since the previous chunk.

    ``text``/``token_ids``/``token_count`` are the new completion text and tokens in this chunk;
    ``completion_tokens`` is the running total. ``ttft`` (seconds from submission to the first
    token) is set on every chunk from the first one with tokens on; ``decode_time`` (first token to
    finish) and ``finish_reason`` (``stop``, ``length`` or ``abort``) on the final chunk only.
    """

    text: str
    token_count: int
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    ttft: float | None
    completion_tokens: int
    token_ids: tuple[int, ...] = ()
    decode_time: float | None = None


class RequestBuffer:
    """What the engine produced for one request and the reader has not taken yet.

    Written on the event loop thread, read on the consumer thread, under ``cond``.
    """

    __slots__ = (
        "request_id",
        "prompt_tokens",
        "submitted_at",
        "cond",
        "texts",
        "token_ids",
        "finished",
        "finish_reason",
        "error",
        "first_token_at",
        "finished_at",
        "completion_tokens",
        "taken",
        "abandoned",
        "reader_waiting",
    )

    def __init__(self, request_id: str, prompt_tokens: int, submitted_at: float) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.submitted_at = submitted_at
        self.cond = threading.Condition(threading.Lock())
        self.texts: list[str] = []
        self.token_ids: list[int] = []
        self.finished = False
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.completion_tokens = 0
        self.taken = False  # the final chunk has been handed out
        self.abandoned = False  # the reader closed the stream
        self.reader_waiting = False  # the reader sleeps until output arrives (not until its deadline)

    def prefilled(self, prompt_tokens: int, cached_tokens: int = 0) -> None:
        with self.cond:
            self.prompt_tokens = prompt_tokens

    def push(
        self, text: str, token_ids: list[int], finished: bool, finish_reason: str | None, index: int = 0,
        logprobs: list | None = None,
    ) -> None:  # fmt: skip
        """One choice's new output (a reader of ``stream`` reads single-choice requests)."""
        now = time.monotonic()
        with self.cond:
            if self.finished:
                return
            if token_ids and self.first_token_at is None:
                self.first_token_at = now
            if text:
                self.texts.append(text)
            self.token_ids.extend(token_ids)
            self.completion_tokens += len(token_ids)
            if finished:
                self.finished, self.finish_reason, self.finished_at = True, finish_reason, now
            # Wake the reader only when it waits for output, or for the end: while it sleeps until
            # its flush deadline it wakes by itself, and an early wake-up is a thread switch for
            # nothing (it only goes back to sleep).
            if finished or (self.reader_waiting and (text or token_ids)):
                self.cond.notify()

    def end(self, finish_reason: str | None, error: BaseException | None = None) -> None:
        """Finish the request (idempotent): after an error, a cancellation or a shutdown."""
        with self.cond:
            if self.finished:
                return
            self.finished, self.finish_reason, self.error = True, finish_reason, error
            self.finished_at = time.monotonic()
            self.cond.notify()

    def has_pending(self) -> bool:
        return bool(self.texts or self.token_ids)

    def drain(self) -> EngineChunk:
        """Everything pending as one chunk. Caller holds ``cond``."""
        text, token_ids = "".join(self.texts), tuple(self.token_ids)
        self.texts.clear()
        self.token_ids.clear()
        ttft = None if self.first_token_at is None else self.first_token_at - self.submitted_at
        decode_time = None
        if self.finished and self.first_token_at is not None and self.finished_at is not None:
            decode_time = self.finished_at - self.first_token_at
        return EngineChunk(
            text=text,
            token_count=len(token_ids),
            finished=self.finished,
            finish_reason=self.finish_reason if self.finished else None,
            prompt_tokens=self.prompt_tokens,
            ttft=ttft,
            completion_tokens=self.completion_tokens,
            token_ids=token_ids,
            decode_time=decode_time,
        )


class EngineStream(Iterator[EngineChunk]):
    """The chunks of one request, for one consumer thread.

    Closing it (``close()``, leaving its ``with`` block, or dropping it) before the final chunk
    aborts the request in the engine.
    """

    def __init__(self, host: EngineHost, buffer: RequestBuffer, flush_interval: float) -> None:
        self._host = host
        self._buffer = buffer
        self._flush_interval = flush_interval
        self._last_emit: float | None = None
        self._closed = False

    @property
    def request_id(self) -> str:
        return self._buffer.request_id

    def __iter__(self) -> EngineStream:
        return self

    def __next__(self) -> EngineChunk:
        buf = self._buffer
        if self._closed or buf.taken:
            raise StopIteration
        with buf.cond:
            while not buf.has_pending() and not buf.finished:
                buf.reader_waiting = True
                buf.cond.wait()
            buf.reader_waiting = False
            self._wait_flush_deadline()
            error = buf.error
            chunk = buf.drain()
            buf.taken = chunk.finished
        if chunk.text or self._last_emit is not None:
            # Coalescing starts from the first text sent: a first chunk of tokens whose text the
            # detokenizer still holds back (a partial character or word) must not make the first
            # visible text wait a whole interval (clients measure time to first text).
            self._last_emit = time.monotonic()
        if chunk.finished:
            self._host._forget(buf.request_id, buf)
        if error is not None:
            raise error
        return chunk

    def _wait_flush_deadline(self) -> None:
        """Let output accumulate until ``flush_interval`` after the previous chunk (caller holds
        the condition). Chunks up to the first text, and the final one, go out at once."""
        if self._last_emit is None:
            return
        buf = self._buffer
        deadline = self._last_emit + self._flush_interval
        while not buf.finished:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            buf.cond.wait(remaining)

    def close(self) -> None:
        """Stop reading; aborts the request if it has not finished."""
        if self._closed:
            return
        self._closed = True
        with self._buffer.cond:
            self._buffer.abandoned = True
            unfinished = not self._buffer.finished
        if unfinished:
            abort(self._host, self.request_id)
        self._host._forget(self.request_id, self._buffer)

    def __enter__(self) -> EngineStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit there is nothing left to abort
            self.close()
