"""The OpenAI-compatible inference API over HTTP: /v1/models, /v1/chat/completions, /v1/completions.

Plain Django views (no DRF on the hot path) that speak HTTP only: an inference view runs the
request's steps (gateway/lifecycle.py: authenticate, validate, admit, route, enqueue, relay, finish
and settle, record) and renders what they give as a JSON reply or an SSE stream. Every failure
becomes an OpenAI-shaped error response in one place, `openai_endpoint`; bad input is always a 4xx.

The inference views are async: the blocking steps run as one call on a gateway thread
(gateway/offload.py), and the relay runs on the event loop, so an open stream holds no thread.
"""

import functools
import json
import logging
from contextlib import aclosing

from asgiref.sync import iscoroutinefunction
from django.db import InterfaceError, OperationalError
from django.http import HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from catalog.selectors import served_model_get, served_models_for
from config.database import DatabaseUnavailable
from config.streaming import FinalPart
from contract.outage import REDIS_UNAVAILABLE
from contract.protocol import Usage
from gateway import lifecycle
from gateway.auth import authenticate
from gateway.dispatch import Delta, Done, Failed, Idle
from gateway.errors import (
    BadGateway,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    OpenAIError,
    ServiceUnavailable,
    error_response,
)
from gateway.formats import ChoiceOutput, ChunkWriter, completion_body, model_entry
from gateway.lifecycle import Enqueued
from gateway.offload import run_blocking
from gateway.validation import chat_request, completion_request

log = logging.getLogger(__name__)


def openai_endpoint(*methods: str):
    """CSRF-exempt API view (sync or async) that allows `methods` and turns OpenAIError into its
    response (and an unreachable database or Redis into a 503, not a 500)."""

    def decorate(view):
        if iscoroutinefunction(view):

            @functools.wraps(view)
            async def wrapper(http_request, *args, **kwargs):
                try:
                    _check_method(http_request, methods)
                    return await view(http_request, *args, **kwargs)
                except (OpenAIError, DatabaseUnavailable, OperationalError, InterfaceError, *REDIS_UNAVAILABLE) as exc:
                    return _error_response(http_request, exc)

        else:

            @functools.wraps(view)
            def wrapper(http_request, *args, **kwargs):
                try:
                    _check_method(http_request, methods)
                    return view(http_request, *args, **kwargs)
                except (OpenAIError, DatabaseUnavailable, OperationalError, InterfaceError, *REDIS_UNAVAILABLE) as exc:
                    return _error_response(http_request, exc)

        return csrf_exempt(wrapper)

    return decorate


def _check_method(http_request, methods: tuple[str, ...]) -> None:
    if http_request.method not in methods:
        raise MethodNotAllowed(f"Method {http_request.method} is not allowed here; use {', '.join(methods)}.")


def _error_response(http_request, exc: Exception) -> HttpResponse:
    if isinstance(exc, OpenAIError):
        return error_response(exc)
    # A backing service is down or saturated (a Redis restart, a database pool timeout): the client
    # may retry; nothing was enqueued, or what was is settled by the ledger.
    log.warning("%s %s: backing service unavailable: %s", http_request.method, http_request.path, exc)
    return error_response(
        ServiceUnavailable(
            "The service is temporarily unavailable; try again shortly.",
            code="service_unavailable",
            headers={"Retry-After": "2"},
        )
    )


# Async views that run their (blocking) work on a gateway thread: /v1/* requests run no blocking
# code on asgiref's shared sync thread (config/asgi.py).
@openai_endpoint("GET")
async def models_list(http_request):
    return await run_blocking(_models_list, http_request)


@openai_endpoint("GET")
async def model_detail(http_request, model_id: str):
    return await run_blocking(_model_detail, http_request, model_id)


def _models_list(http_request) -> JsonResponse:
    principal, limits = authenticate(http_request)
    data = [model_entry(m) for m in served_models_for(principal=principal, limits=limits)]
    return JsonResponse({"object": "list", "data": data})


def _model_detail(http_request, model_id: str) -> JsonResponse:
    principal, limits = authenticate(http_request)
    model = served_model_get(principal=principal, limits=limits, model_id=model_id)
    return JsonResponse(model_entry(model))


@openai_endpoint("POST")
async def chat_completions(http_request):
    return await _inference(http_request, chat_request)


@openai_endpoint("POST")
async def completions(http_request):
    return await _inference(http_request, completion_request)


@openai_endpoint("GET", "POST", "PUT", "PATCH", "DELETE")
def not_found(http_request, path: str = ""):
    raise NotFound(f"Unknown endpoint: {http_request.method} {http_request.path}", code="unknown_url")


async def _inference(http_request, parse) -> HttpResponse:
    enqueued = await lifecycle.start(http_request, parse)
    if enqueued.inference.stream:
        response = _EventStreamResponse(_stream(enqueued))
    else:
        response = await _collect(enqueued)
    response["X-Request-Id"] = enqueued.request.request_id
    for name, value in enqueued.headers.items():
        response[name] = value
    return response


def _failure_error(failure: Failed) -> OpenAIError:
    if failure.code == "no_worker_available":
        return ServiceUnavailable(failure.message, code=failure.code, headers={"Retry-After": "5"})
    if failure.code == "request_rejected":  # the engine refused the request's parameters
        return InvalidRequest(failure.message, code=failure.code)
    return BadGateway(failure.message, code=failure.code)


async def _collect(enqueued: Enqueued) -> HttpResponse:
    """The non-streamed reply. Its usage is in the ledger's hands before the reply is returned
    (`lifecycle.relay`), so the tenant's quota is settled by the time the client reads it."""
    outcome = await _collected(enqueued)
    if isinstance(outcome, Failed):
        return error_response(_failure_error(outcome))
    outputs, usage = outcome
    request = enqueued.request
    body = completion_body(
        enqueued.inference.kind, request.request_id, int(request.enqueued_at), enqueued.model.model_id, outputs, usage
    )
    return HttpResponse(json.dumps(body), content_type="application/json")


async def _collected(enqueued: Enqueued) -> tuple[list[ChoiceOutput], Usage] | Failed:
    """The request's choices (whole text, logprobs, tool calls) and usage, or its failure."""
    params = enqueued.request.params
    outputs = [ChoiceOutput() for _ in range(params.get("n", 1))]
    async with aclosing(lifecycle.relay(enqueued)) as batches:
        async for events in batches:
            for event in events:
                if isinstance(event, Delta):
                    output = outputs[event.index]
                    output.texts.append(event.text)
                    if event.logprobs is not None:
                        output.logprobs = (output.logprobs or []) + event.logprobs
                elif isinstance(event, Done):
                    for output, end in zip(outputs, event.choices or (), strict=False):
                        output.finish_reason, output.tool_calls = end.get("finish_reason"), end.get("tool_calls")
                    if params.get("logprobs") is not None:
                        for output in outputs:
                            output.logprobs = output.logprobs or []
                    return outputs, event.usage
                elif isinstance(event, Failed):
                    return event
    raise AssertionError("relay ended without a final event")


class _EventStreamResponse(StreamingHttpResponse):
    """An SSE reply whose frame generator is closed as soon as the server stops consuming the reply.

    Django's ASGI handler closes only the outer generator it iterates (`__aiter__`), not the one
    given here: a stream cut while the server waits on a slow client's socket would otherwise run
    its cleanup (the request's abandon, gateway/lifecycle.py) only when the garbage collector
    finalizes it."""

    def __init__(self, frames):
        super().__init__(frames, content_type="text/event-stream")
        self._frames = frames
        self["Cache-Control"] = "no-cache"
        self["X-Accel-Buffering"] = "no"  # no proxy buffering of the token stream

    async def __aiter__(self):
        # The frames themselves: Django's own iteration would copy each into plain bytes, losing
        # the last one's FinalPart type.
        async with aclosing(self._frames):
            async for part in self._frames:
                yield part


async def _stream(enqueued: Enqueued):
    """The SSE frames of a streamed reply (an async generator that StreamingHttpResponse consumes):
    one part per batch of the request's events, and its last part a `FinalPart`, which the server
    sends with the end of the body (config/asgi.py): on one core every socket write wakes the client.
    How a stream ends, and what each end does to the request: gateway/lifecycle.py."""
    request, inference = enqueued.request, enqueued.inference
    writer = ChunkWriter(
        inference.kind, request.request_id, int(request.enqueued_at), enqueued.model.model_id, inference.include_usage
    )
    # The opening chunk goes out with the first frame: one socket write fewer per request.
    opening = writer.opening(inference.n)
    try:
        async with aclosing(lifecycle.relay(enqueued)) as batches:
            async for events in batches:
                part = opening + b"".join([_frame(writer, event) for event in events])
                if isinstance(events[-1], Done | Failed):
                    yield FinalPart(part)
                    return
                if part != opening:
                    yield part
                    opening = b""
    except REDIS_UNAVAILABLE:
        # Headers are out: end the stream with an error event rather than a cut connection. The
        # worker records the usage itself; the periodic flush writes it (no fast path without Redis).
        log.warning("request %s: Redis failed while relaying its stream", request.request_id, exc_info=True)
        interrupted = ServiceUnavailable("The token stream was interrupted; try again.", code="stream_interrupted")
        yield FinalPart(opening + writer.error(interrupted.body()))


def _frame(writer: ChunkWriter, event) -> bytes:
    if isinstance(event, Delta):
        return writer.delta(event.text, event.index, event.logprobs) if event.text or event.logprobs else b""
    if isinstance(event, Idle):
        return writer.keepalive()  # keeps proxies from timing the connection out
    if isinstance(event, Done):
        return writer.closing(event.usage, event.choices)
    return writer.error(_failure_error(event).body())
