"""The OpenAI-compatible inference API: /v1/models, /v1/chat/completions, /v1/completions.

Plain Django views (no DRF on the hot path): authenticate → validate → refuse early what admission
would refuse → tokenize → wait for a worker → admit → enqueue → relay. Every failure is an
OpenAI-shaped error; bad input is always a 4xx.

The inference views are async: the blocking steps up to the enqueue run as one call on a gateway
thread (gateway/offload.py), and the relay runs on the event loop, so an open stream holds no thread.
"""

import asyncio
import functools
import json
import logging
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass

from asgiref.sync import iscoroutinefunction
from django import db
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.db import InterfaceError, OperationalError
from django.http import HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from catalog.models import ServedModel
from catalog.selectors import served_model_get, served_models_for
from config.database import DatabaseUnavailable
from config.redis_client import REDIS_UNAVAILABLE
from config.streaming import FinalPart
from gateway import dispatch, images, tokenization
from gateway.auth import authenticate
from gateway.dispatch import Delta, Done, Failed, Idle
from gateway.errors import (
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    OpenAIError,
    PayloadTooLarge,
    ServiceUnavailable,
    error_response,
)
from gateway.formats import ChoiceOutput, ChunkWriter, completion_body, model_entry
from gateway.offload import run_blocking
from gateway.validation import InferenceRequest, chat_request, completion_request, parse_json_body
from quotas.admission import quota_release
from quotas.gate import admission_check, admission_gate
from workers.protocol import RequestInput, Usage

log = logging.getLogger(__name__)


def openai_endpoint(*methods: str):
    """CSRF-exempt API view (sync or async) that allows `methods` and turns OpenAIError into its
    response (and an unreachable database or Redis into a 503, not a 500)."""

    def decorate(view):
        if iscoroutinefunction(view):

            @functools.wraps(view)
            async def wrapper(request, *args, **kwargs):
                try:
                    _check_method(request, methods)
                    return await view(request, *args, **kwargs)
                except (OpenAIError, DatabaseUnavailable, OperationalError, InterfaceError, *REDIS_UNAVAILABLE) as exc:
                    return _error_response(request, exc)

        else:

            @functools.wraps(view)
            def wrapper(request, *args, **kwargs):
                try:
                    _check_method(request, methods)
                    return view(request, *args, **kwargs)
                except (OpenAIError, DatabaseUnavailable, OperationalError, InterfaceError, *REDIS_UNAVAILABLE) as exc:
                    return _error_response(request, exc)

        return csrf_exempt(wrapper)

    return decorate


def _check_method(request, methods: tuple[str, ...]) -> None:
    if request.method not in methods:
        raise MethodNotAllowed(f"Method {request.method} is not allowed here; use {', '.join(methods)}.")


def _error_response(request, exc: Exception) -> HttpResponse:
    if isinstance(exc, OpenAIError):
        return error_response(exc)
    # A backing service is down or saturated (a Redis restart, a database pool timeout): the client
    # may retry; nothing was enqueued, or what was is settled by the ledger.
    log.warning("%s %s: backing service unavailable: %s", request.method, request.path, exc)
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
async def models_list(request):
    return await run_blocking(_models_list, request)


@openai_endpoint("GET")
async def model_detail(request, model_id: str):
    return await run_blocking(_model_detail, request, model_id)


def _models_list(request) -> JsonResponse:
    principal, limits = authenticate(request)
    data = [model_entry(m) for m in served_models_for(principal=principal, limits=limits)]
    return JsonResponse({"object": "list", "data": data})


def _model_detail(request, model_id: str) -> JsonResponse:
    principal, limits = authenticate(request)
    model = served_model_get(principal=principal, limits=limits, model_id=model_id)
    return JsonResponse(model_entry(model))


@openai_endpoint("POST")
async def chat_completions(request):
    return await _inference(request, chat_request)


@openai_endpoint("POST")
async def completions(request):
    return await _inference(request, completion_request)


@openai_endpoint("GET", "POST", "PUT", "PATCH", "DELETE")
def not_found(request, path: str = ""):
    raise NotFound(f"Unknown endpoint: {request.method} {request.path}", code="unknown_url")


def _read_body(request) -> dict:
    declared = request.META.get("CONTENT_LENGTH")
    if declared and declared.isdigit() and int(declared) > settings.MAX_REQUEST_BYTES:
        raise PayloadTooLarge(f"The request body exceeds {settings.MAX_REQUEST_BYTES} bytes.", code="payload_too_large")
    try:
        raw = request.body
    except RequestDataTooBig:
        raise PayloadTooLarge(
            f"The request body exceeds {settings.MAX_REQUEST_BYTES} bytes.", code="payload_too_large"
        ) from None
    return parse_json_body(raw)


@dataclass
class _Enqueued:
    """A request admitted and handed to its pool: what the relay needs."""

    job: RequestInput
    model: ServedModel
    spec: InferenceRequest
    headers: dict[str, str]


async def _inference(request, parse) -> HttpResponse:
    enqueued = await _admit(request, parse)
    job, model, spec = enqueued.job, enqueued.model, enqueued.spec
    if spec.stream:
        response = _EventStreamResponse(_stream(job, model, spec))
    else:
        response = await _collect(job, model, spec)
    response["X-Request-Id"] = job.request_id
    for name, value in enqueued.headers.items():
        response[name] = value
    return response


# Tasks started by a request that outlive it; the event loop keeps only weak references to tasks.
_background: set[asyncio.Task] = set()


async def _admit(request, parse) -> _Enqueued:
    """Run the blocking steps up to the enqueue (ORM, Redis, tokenizer) as one call on a gateway thread.

    A cancelled view (the client went away) cannot stop that thread: the call runs to its end
    regardless, and a request it enqueued is then abandoned rather than generated for nobody."""
    step = asyncio.ensure_future(run_blocking(_admit_and_enqueue, request, parse))
    try:
        return await asyncio.shield(step)
    except asyncio.CancelledError:
        step.add_done_callback(_abandon_if_enqueued)
        raise


def _abandon_if_enqueued(step: asyncio.Future) -> None:
    if step.cancelled() or step.exception() is not None:
        return  # nothing was enqueued (or what was is released by its own error path)
    task = asyncio.ensure_future(_abandon(step.result().job))
    _background.add(task)
    task.add_done_callback(_background.discard)


def _admit_and_enqueue(request, parse) -> _Enqueued:
    """Authenticate, validate, refuse early, tokenize, wait for a worker, admit and enqueue (blocking;
    on a gateway thread, whose database connection `run_blocking` gives back at the end).

    Cheap refusals come before the expensive steps: a request over its limits costs no tokenization
    and is never counted as demand for its pool (`pool:<pool>:waiting`, which the operator scales on).
    Raises the OpenAIError to answer; on success the request is in its pool's queue and settled
    through the ledger from here on."""
    principal, limits = authenticate(request)
    spec: InferenceRequest = parse(_read_body(request))
    model = served_model_get(principal=principal, limits=limits, model_id=spec.model)
    images.check_model(model, spec.messages)
    check = functools.partial(
        admission_check, principal=principal, limits=limits, implicit_max_tokens=spec.max_tokens is None,
        prompt_param=_prompt_param(spec), choices=spec.n,
    )  # fmt: skip
    # First with a lower bound of the prompt's size (no tokenizing), then with the exact size.
    prompt_at_least = tokenization.prompt_tokens_at_least(model.path, messages=spec.messages, prompt=spec.prompt)
    # Every choice of n may generate max_tokens: admission reserves them all.
    bound_max_tokens = _max_tokens(spec, model.context_length, prompt_at_least, at_least=True)
    # The pool's ready workers are read in the same round trip (one wait for Redis fewer).
    ready = check(
        prompt_tokens=prompt_at_least, max_tokens=bound_max_tokens * spec.n, at_least=True, ready_pool=model.pool
    )
    prepared = images.prepare(model, spec.messages) if spec.kind == "chat" else []
    prompt_ids = _prompt_ids(model, spec)
    # Each image's placeholder token becomes the image's tokens in the engine: counted here too.
    prompt_tokens = images.prompt_tokens(prompt_ids, prepared)
    max_tokens = _max_tokens(spec, model.context_length, prompt_tokens)
    # What can never fit is refused at its exact size. The quota counters are asked again only for a
    # request about to wait for its pool (counted as demand meanwhile); with a worker ready, the
    # reservation below is the exact check: one Lua call fewer on the hot path.
    check(prompt_tokens=prompt_tokens, max_tokens=max_tokens * spec.n, counters=not ready)
    if not ready:
        # A waiting request holds its gateway thread, not a PostgreSQL connection.
        db.connection.close()
        ready = dispatch.await_worker(model)
    request_id = f"{'chatcmpl' if spec.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    admitted_at = time.time()
    # The exact reservation (429, nothing enqueued; a check above may have been overtaken by other
    # requests) and the pool's fair share; settled through the ledger from here on.
    admitted = admission_gate(
        principal=principal, limits=limits, model=model, request_id=request_id, prompt_tokens=prompt_tokens,
        max_tokens=max_tokens * spec.n, implicit_max_tokens=spec.max_tokens is None, choices=spec.n,
        ready_workers=ready,
    )  # fmt: skip
    job = RequestInput(
        request_id=request_id,
        model=model.model_id,
        prompt_token_ids=prompt_ids,
        params=_engine_params(spec, admitted.max_tokens // spec.n),
        tenant_id=principal.tenant_id,
        key_id=principal.key_id,
        enqueued_at=admitted_at,
        # Keeps one tenant from probing another's prompts through the shared prefix cache.
        cache_salt=f"tenant-{principal.tenant_id}",
        adapter_id=model.adapter.pk if model.adapter else 0,
        adapter_digest=model.adapter.digest if model.adapter else "",
        tool_mode=spec.tool_mode,
        tool_name=spec.tool_name or "",
        images=[image.wire() for image in prepared],
    )
    try:
        dispatch.enqueue(job, model)
    except BaseException:
        quota_release(request_id=request_id)
        raise
    return _Enqueued(job, model, spec, dict(admitted.headers))


def _engine_params(spec: InferenceRequest, max_tokens: int) -> dict:
    """The engine's parameters for the request (workers/engine.py REQUEST_KEYS); `max_tokens` per choice."""
    params = dict(spec.sampling, max_tokens=max_tokens)
    if spec.n > 1:
        params["n"] = spec.n
    if spec.logprobs is not None:
        params["logprobs"] = spec.logprobs
    if spec.structured is not None:
        params["structured_outputs"] = spec.structured
    if spec.tool_mode == "auto":
        # The model's tool-call markers are special tokens: keep them in the text, for the parser.
        params["skip_special_tokens"] = False
    return params


def _prompt_param(spec: InferenceRequest) -> str:
    return "messages" if spec.kind == "chat" else "prompt"


def _prompt_ids(model: ServedModel, spec: InferenceRequest) -> list[int]:
    tokenization.check_logit_bias(model.path, spec.sampling.get("logit_bias"))
    if spec.kind == "chat":
        return tokenization.chat_prompt_ids(model.path, spec.messages, spec.tools)
    return tokenization.completion_prompt_ids(model.path, spec.prompt)


def _max_tokens(spec: InferenceRequest, context_length: int, prompt_tokens: int, *, at_least: bool = False) -> int:
    """The completion's length to reserve; 400 if the prompt and max_tokens cannot fit the context.
    `at_least`: `prompt_tokens` is a lower bound of the prompt's size."""
    room = context_length - prompt_tokens
    counted = f"at least {prompt_tokens}" if at_least else str(prompt_tokens)
    if room < 1:
        raise InvalidRequest(
            f"This model's maximum context length is {context_length} tokens; the prompt has {counted}.",
            param=_prompt_param(spec),
            code="context_length_exceeded",
        )
    if spec.max_tokens is None:
        return room
    if spec.max_tokens > room:
        requested = f"at least {prompt_tokens + spec.max_tokens}" if at_least else prompt_tokens + spec.max_tokens
        raise InvalidRequest(
            f"This model's maximum context length is {context_length} tokens. You requested "
            f"{requested} tokens ({counted} in the prompt, {spec.max_tokens} for the "
            "completion). Reduce the prompt or the completion length.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return spec.max_tokens


def _failure_error(failure: Failed) -> OpenAIError:
    if failure.code == "no_worker_available":
        return ServiceUnavailable(failure.message, code=failure.code, headers={"Retry-After": "5"})
    if failure.code == "request_rejected":  # the engine refused the request's parameters
        return InvalidRequest(failure.message, code=failure.code)
    error = OpenAIError(failure.message, code=failure.code)
    error.status, error.type = 502, "server_error"
    return error


async def _collect(job: RequestInput, model, spec: InferenceRequest) -> HttpResponse:
    """The non-streamed reply. Its usage goes into the ledger before the reply is returned, so the
    tenant's quota is settled by the time the client reads it."""
    try:
        outcome = await _collected(job, model)
    except BaseException:
        # The client went away (the view task is cancelled) or relaying failed: stop the request.
        await _abandon(job)
        raise
    if isinstance(outcome, Failed):
        # Settled now too, as a stream that ends with an error is: the periodic flush is only the safety net.
        await _record(job)
        return error_response(_failure_error(outcome))
    outputs, usage = outcome
    body = completion_body(spec.kind, job.request_id, int(job.enqueued_at), model.model_id, outputs, usage)
    await _record(job)
    return HttpResponse(json.dumps(body), content_type="application/json")


async def _collected(job: RequestInput, model) -> tuple[list[ChoiceOutput], Usage] | Failed:
    """The request's choices (whole text, logprobs, tool calls) and usage, or its failure."""
    outputs = [ChoiceOutput() for _ in range(job.params.get("n", 1))]
    async with aclosing(dispatch.relay(job, model)) as batches:
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
                    if job.params.get("logprobs") is not None:
                        for output in outputs:
                            output.logprobs = output.logprobs or []
                    return outputs, event.usage
                elif isinstance(event, Failed):
                    return event
    raise AssertionError("relay ended without a final event")


async def _abandon(job: RequestInput) -> None:
    """Stop the request on its worker; shielded, so a second cancellation of the view task (the
    server shutting down) cannot cut it off half way. Never raises for an unreachable Redis."""
    try:
        await asyncio.shield(_abandon_logged(job))
    except asyncio.CancelledError:
        pass  # the shielded call goes on by itself


async def _abandon_logged(job: RequestInput) -> None:
    try:
        await dispatch.abandon(job)
    except REDIS_UNAVAILABLE:
        # The worker cannot be told to stop: it finishes the request and bills all of it.
        log.warning("request %s: could not stop it on its worker (Redis unavailable)", job.request_id)


class _EventStreamResponse(StreamingHttpResponse):
    """An SSE reply whose frame generator is closed as soon as the server stops consuming the reply.

    Django's ASGI handler closes only the outer generator it iterates (`__aiter__`), not the one
    given here: a stream cut while the server waits on a slow client's socket would otherwise run
    its `finally` (the request's abandon) only when the garbage collector finalizes it."""

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


async def _stream(job: RequestInput, model, spec: InferenceRequest):
    """The SSE frames of a streamed reply (an async generator that StreamingHttpResponse consumes):
    one part per read of the request's events, and its last part a `FinalPart`, which the server
    sends with the end of the body (config/asgi.py): on one core every socket write wakes the client.

    A client that goes away ends it early: Django cancels the response task (CancelledError at the
    current await) or closes the generator (GeneratorExit at a yield); either way the `finally`
    abandons the request. A finished request's usage goes into the ledger before its last part is
    sent, so its quota is settled by the time the client reads the end of the reply."""
    writer = ChunkWriter(spec.kind, job.request_id, int(job.enqueued_at), model.model_id, spec.include_usage)
    # The opening chunk goes out with the first frame: one socket write fewer per request.
    opening = writer.opening(spec.n)
    finished = False
    try:
        async with aclosing(dispatch.relay(job, model)) as batches:
            async for events in batches:
                frames = [_frame(writer, event) for event in events]
                part = opening + b"".join(frames)
                if isinstance(events[-1], Done | Failed):
                    finished = True
                    await _record(job)
                    yield FinalPart(part)
                    return
                if part != opening:
                    yield part
                    opening = b""
    except REDIS_UNAVAILABLE:
        # Headers are out: end the stream with an error event rather than a cut connection. The
        # worker records the usage itself; the periodic flush writes it (no fast path without Redis).
        log.warning("request %s: Redis failed while relaying its stream", job.request_id, exc_info=True)
        interrupted = ServiceUnavailable("The token stream was interrupted; try again.", code="stream_interrupted")
        yield FinalPart(opening + writer.error(interrupted.body()))
    finally:
        if not finished:
            await _abandon(job)


def _frame(writer: ChunkWriter, event) -> bytes:
    if isinstance(event, Delta):
        return writer.delta(event.text, event.index, event.logprobs) if event.text or event.logprobs else b""
    if isinstance(event, Idle):
        return writer.keepalive()  # keeps proxies from timing the connection out
    if isinstance(event, Done):
        return writer.closing(event.usage, event.choices)
    return writer.error(_failure_error(event).body())


async def _record(job: RequestInput) -> None:
    """The ledger's fast path for a finished request; an unreachable Redis leaves it to the periodic
    flush (the worker's usage entry is durable) rather than cost the client a reply it was generated."""
    try:
        await dispatch.record(job.request_id)
    except REDIS_UNAVAILABLE:
        log.warning("request %s: its usage is left to the periodic flush (Redis unavailable)", job.request_id)
