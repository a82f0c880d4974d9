"""A streamed reply costs the server one socket write per read of its events, and its last part goes
out with the end of the body: on a busy core each write wakes the client."""

import asyncio
import json

from django.http import StreamingHttpResponse

from config.streaming import FinalPart
from tests.gateway import relaying


def _usage(request_id: str):
    from contract.protocol import Usage

    return Usage(request_id=request_id, tenant_id=1, key_id=1, model="m", prompt_tokens=1, completion_tokens=3,
                 finish_reason="length")  # fmt: skip


def test_the_events_of_one_read_are_one_part_and_the_last_part_follows_the_usage_record(monkeypatch):
    from gateway import dispatch, lifecycle, views
    from gateway.validation import chat_request

    recorded = []

    async def relay(job, model):
        yield [dispatch.Delta("Hel", 1), dispatch.Delta("lo", 1)]
        yield [dispatch.Idle()]
        yield [dispatch.Delta("!", 1), dispatch.Done(_usage(job.request_id))]

    monkeypatch.setattr(dispatch, "relay", relay)
    monkeypatch.setattr(lifecycle, "record", relaying.async_append(recorded))
    spec = chat_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True})

    async def parts():
        seen = []
        async for part in views._stream(relaying.enqueued("chatcmpl-parts", spec)):
            seen.append((part, list(recorded)))
        return seen

    seen = asyncio.run(parts())

    assert [type(part) for part, _ in seen] == [bytes, bytes, FinalPart]
    first, keepalive, last = (part.decode() for part, _ in seen)
    first_events = [json.loads(line[6:]) for line in first.splitlines() if line.startswith("data: ")]
    # The opening chunk (the assistant's role) and both deltas of the first read.
    assert [e["choices"][0]["delta"].get("content") for e in first_events] == ["", "Hel", "lo"]
    assert keepalive == ": keep-alive\n\n"
    last_events = [line[6:] for line in last.splitlines() if line.startswith("data: ")]
    assert json.loads(last_events[0])["choices"][0]["delta"]["content"] == "!"
    assert json.loads(last_events[1])["choices"][0]["finish_reason"] == "length"
    assert last_events[-1] == "[DONE]"
    # Settled before the last part is handed to the server: a client that sends its next request as
    # soon as the reply ends finds its concurrency slot free.
    assert seen[-1][1] == ["chatcmpl-parts"]
    assert seen[0][1] == []


def _a_request_whose_usage_record_finds_redis_down(monkeypatch, settings) -> None:
    """The relay yields "ok" and the end; the ledger's fast path then finds Redis unreachable."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    from gateway import dispatch, lifecycle

    async def relay(job, model):
        yield [dispatch.Delta("ok", 1), dispatch.Done(_usage(job.request_id))]

    def ledger_flush(request_ids):
        raise RedisConnectionError("Connection refused")

    settings.LEDGER_BATCH_SECONDS = 0  # the row is written at once, on a gateway thread
    monkeypatch.setattr(dispatch, "relay", relay)
    monkeypatch.setattr(lifecycle, "ledger_flush", ledger_flush)


def test_a_usage_record_that_finds_redis_down_still_ends_the_reply(monkeypatch, settings):
    from gateway import views
    from gateway.validation import completion_request

    _a_request_whose_usage_record_finds_redis_down(monkeypatch, settings)
    spec = completion_request({"model": "m", "prompt": "hi", "stream": True})

    async def parts():
        return [part async for part in views._stream(relaying.enqueued("cmpl-norecord", spec))]

    (part,) = asyncio.run(parts())
    assert isinstance(part, FinalPart)
    assert part.decode().endswith("data: [DONE]\n\n")  # the periodic flush settles it from the worker's entry


def test_a_non_streamed_reply_whose_usage_record_finds_redis_down_is_still_returned(monkeypatch, settings):
    from gateway import views
    from gateway.validation import completion_request

    _a_request_whose_usage_record_finds_redis_down(monkeypatch, settings)
    spec = completion_request({"model": "m", "prompt": "hi"})

    response = asyncio.run(views._collect(relaying.enqueued("cmpl-collected", spec)))

    assert response.status_code == 200
    assert json.loads(response.content)["choices"][0]["text"] == "ok"


async def _sent(response) -> list[dict]:
    from config.asgi import InferenceASGIHandler

    messages = []

    async def send(message):
        messages.append(message)

    await InferenceASGIHandler().send_response(response, send)
    return messages


def test_the_inference_handler_sends_a_final_part_as_the_end_of_the_body():
    from gateway.views import _EventStreamResponse

    async def frames():
        yield b"data: 1\n\n"
        yield FinalPart(b"data: [DONE]\n\n")

    messages = asyncio.run(_sent(_EventStreamResponse(frames())))

    assert messages[0]["type"] == "http.response.start"
    assert (b"Content-Type", b"text/event-stream") in messages[0]["headers"]
    assert [(m["body"], m["more_body"]) for m in messages[1:]] == [(b"data: 1\n\n", True), (b"data: [DONE]\n\n", False)]


def test_a_streamed_body_without_a_final_part_ends_with_an_empty_message():
    async def parts():
        yield b"a"
        yield b"b"

    messages = asyncio.run(_sent(StreamingHttpResponse(parts())))

    assert [(m.get("body", b""), m.get("more_body", False)) for m in messages[1:]] == [
        (b"a", True), (b"b", True), (b"", False)
    ]  # fmt: skip


async def _respond(frames, disconnect_after: str):
    """The inference handler's response to a request whose view returns an SSE reply of `frames`,
    behind a server that reports the client gone once it has sent the message `disconnect_after`
    ("first part" or, as uvicorn does for every response, "end of body"); the response, which the
    handler then closes."""
    from config.asgi import InferenceASGIHandler
    from gateway.views import _EventStreamResponse

    handler = InferenceASGIHandler()
    gone = asyncio.Event()

    async def send(message):
        if message["type"] == "http.response.body":
            if disconnect_after == "first part" or not message.get("more_body", False):
                gone.set()

    async def receive():
        await gone.wait()
        return {"type": "http.disconnect"}

    async def get_response(request):
        return _EventStreamResponse(frames())

    handler.run_get_response = get_response
    return await handler._respond_unless_disconnected(None, receive, send)


def test_a_response_whose_body_is_sent_finishes_closing_though_the_server_reports_the_client_gone():
    """Once a response's body is out, uvicorn answers the disconnect listener with `http.disconnect`
    while the response may still be closing its stream (the stream reader's wake): not a client
    leaving, so not cancelled."""
    closed = []

    async def frames():
        try:
            yield b"data: 1\n\n"
            yield FinalPart(b"data: [DONE]\n\n")
        finally:
            await asyncio.sleep(0.05)  # a cleanup that waits, as a stream's close may on Redis
            closed.append(True)

    asyncio.run(_respond(frames, disconnect_after="end of body"))

    assert closed == [True]


def test_a_client_that_leaves_mid_body_cancels_the_response():
    cancelled = []

    async def frames():
        yield b"data: 1\n\n"
        try:
            await asyncio.Event().wait()  # the next tokens, which never come
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        yield FinalPart(b"data: [DONE]\n\n")

    asyncio.run(_respond(frames, disconnect_after="first part"))

    assert cancelled == [True]
