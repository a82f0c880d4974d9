"""How a request's output is cut into chunks for its reader (tests/workers/engine_stream.py, no engine needed)."""

import threading
import time
from types import SimpleNamespace

from tests.workers.engine_stream import EngineStream, RequestBuffer


def _stream(flush_interval: float) -> tuple[RequestBuffer, EngineStream]:
    buffer = RequestBuffer("r-1", prompt_tokens=3, submitted_at=time.monotonic())
    host = SimpleNamespace(_forget=lambda request_id, buf: None)  # the stream only tells its host when it ends
    return buffer, EngineStream(host, buffer, flush_interval)


def test_the_first_text_goes_out_at_once_even_after_a_chunk_without_text():
    buffer, stream = _stream(flush_interval=5.0)
    buffer.push("", [7], False, None)  # a token whose text the detokenizer still holds back
    assert next(stream).text == ""

    buffer.push("Hello", [8], False, None)
    started = time.monotonic()
    assert next(stream).text == "Hello"
    assert time.monotonic() - started < 1.0  # not held for the 5 s interval


def test_after_the_first_text_output_is_coalesced_until_the_interval_or_the_end():
    buffer, stream = _stream(flush_interval=5.0)
    buffer.push("Hello", [8], False, None)
    assert next(stream).text == "Hello"

    buffer.push(" wide", [9], False, None)
    threading.Timer(0.3, lambda: buffer.push(" world", [10], True, "stop")).start()
    started = time.monotonic()
    last = next(stream)
    # One chunk with both pieces, released by the end rather than after 5 s.
    assert (last.text, last.token_count, last.finished) == (" wide world", 2, True)
    assert 0.25 < time.monotonic() - started < 2.0
