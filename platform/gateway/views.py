"""The OpenAI-compatible inference API: /v1/models, /v1/chat/completions, /v1/completions.

Plain Django views (no DRF on the hot path): authenticate → validate → tokenize → wait for a worker
→ enqueue → relay. Every failure is an OpenAI-shaped error; bad input is always a 4xx.
"""

import functools
import json
import logging
import time
import uuid

from django import db
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.db import InterfaceError, OperationalError
from django.http import HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from catalog.selectors import served_model_get, served_models_for
from config.redis_client import REDIS_UNAVAILABLE
from gateway import dispatch, tokenization
from gateway.auth import authenticate
from gateway.dispatch import Delta, Done, Failed, Idle
from gateway.errors import (
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    OpenAIError,
    PayloadTooLarge,
    ServiceUnavailable,
)
from gateway.formats import ChunkWriter, completion_body
from gateway.validation import InferenceRequest, chat_request, completion_request, parse_json_body
from quotas.admission import quota_release
from quotas.gate import admission_gate
from workers.protocol import RequestInput

log = logging.getLogger(__name__)


def openai_endpoint(*methods: str):
    """CSRF-exempt API view that allows `methods` and turns OpenAIError into its response (and an
    unreachable database or Redis into a 503, not a 500)."""

    def decorate(view):
        @csrf_exempt
        @functools.wraps(view)
        def wrapper(request, *args, **kwargs):
            try:
                if request.method not in methods:
                    raise MethodNotAllowed(f"Method {request.method} is not allowed here; use {', '.join(methods)}.")
                return view(request, *args, **kwargs)
            except OpenAIError as error:
                return error.response()
            except (OperationalError, InterfaceError, *REDIS_UNAVAILABLE) as exc:
                # A backing service is down or saturated (a Redis restart, a database pool timeout):
                # the client may retry; nothing was enqueued, or what was is settled by the ledger.
                log.warning("%s %s: backing service unavailable: %s", request.method, request.path, exc)
                return ServiceUnavailable(
                    "The service is temporarily unavailable; try again shortly.",
                    code="service_unavailable",
                    headers={"Retry-After": "2"},
                ).response()

        return wrapper

    return decorate


@openai_endpoint("GET")
def models_list(request):
    principal = authenticate(request)
    data = [
        {"id": m.model_id, "object": "model", "created": int(m.created_at.timestamp()), "owned_by": "gemma-platform"}
        for m in served_models_for(principal)
    ]
    return JsonResponse({"object": "list", "data": data})


@openai_endpoint("GET")
def model_detail(request, model_id: str):
    principal = authenticate(request)
    model = served_model_get(principal, model_id)
    return JsonResponse(
        {
            "id": model.model_id,
            "object": "model",
            "created": int(model.created_at.timestamp()),
            "owned_by": "gemma-platform",
        }
    )


@openai_endpoint("POST")
def chat_completions(request):
    return _inference(request, chat_request)


@openai_endpoint("POST")
def completions(request):
    return _inference(request, completion_request)


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


def _inference(request, parse) -> HttpResponse:
    principal = authenticate(request)
    spec: InferenceRequest = parse(_read_body(request))
    model = served_model_get(principal, spec.model)
    if spec.kind == "chat":
        prompt_ids = tokenization.chat_prompt_ids(model.path, spec.messages)
    else:
        prompt_ids = tokenization.completion_prompt_ids(model.path, spec.prompt)
    max_tokens = _max_tokens(spec, model.context_length, len(prompt_ids))
    # Give the database connection back before anything that can wait (a pool scaling from zero, the
    # pool's fair share): a request waiting for a slot while holding one of the process's few pooled
    # connections starved the requests that needed one to finish (their ledger write), until the
    # pool's timeout turned them into 500s (benchmarks: 128 requests for 64 worker slots).
    db.connection.close()
    ready = dispatch.await_worker(model)
    request_id = f"{'chatcmpl' if spec.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    admitted_at = time.time()
    # Quotas (429, nothing enqueued) and the pool's fair share; settled through the ledger from here on.
    admitted = admission_gate(
        principal=principal, model=model, request_id=request_id, prompt_tokens=len(prompt_ids),
        max_tokens=max_tokens, implicit_max_tokens=spec.max_tokens is None, ready_workers=ready,
    )  # fmt: skip
    job = RequestInput(
        request_id=request_id,
        model=model.model_id,
        prompt_token_ids=prompt_ids,
        params=dict(spec.sampling, max_tokens=admitted.max_tokens),
        tenant_id=principal.tenant_id,
        key_id=principal.key_id,
        enqueued_at=admitted_at,
        # Keeps one tenant from probing another's prompts through the shared prefix cache.
        cache_salt=f"tenant-{principal.tenant_id}",
    )
    try:
        dispatch.enqueue(job, model)
    except BaseException:
        quota_release(request_id=request_id)
        raise
    # Relaying can take minutes: give the database connection back to the pool meanwhile (the quota
    # limits may have needed one again).
    db.connection.close()
    if spec.stream:
        response = StreamingHttpResponse(_stream(job, model, spec), content_type="text/event-stream")
        response["Cache-Control"] = "no-cache"
        response["X-Accel-Buffering"] = "no"  # no proxy buffering of the token stream
    else:
        response = _collect(job, model, spec)
    response["X-Request-Id"] = job.request_id
    for name, value in admitted.headers.items():
        response[name] = value
    return response


def _max_tokens(spec: InferenceRequest, context_length: int, prompt_tokens: int) -> int:
    room = context_length - prompt_tokens
    param = "messages" if spec.kind == "chat" else "prompt"
    if room < 1:
        raise InvalidRequest(
            f"This model's maximum context length is {context_length} tokens; the prompt has {prompt_tokens}.",
            param=param,
            code="context_length_exceeded",
        )
    if spec.max_tokens is None:
        return room
    if spec.max_tokens > room:
        raise InvalidRequest(
            f"This model's maximum context length is {context_length} tokens. You requested "
            f"{prompt_tokens + spec.max_tokens} tokens ({prompt_tokens} in the prompt, {spec.max_tokens} for the "
            "completion). Reduce the prompt or the completion length.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return spec.max_tokens


def _failure_error(failure: Failed) -> OpenAIError:
    if failure.code == "no_worker_available":
        return ServiceUnavailable(failure.message, code=failure.code, headers={"Retry-After": "5"})
    error = OpenAIError(failure.message, code=failure.code)
    error.status, error.type = 502, "server_error"
    return error


class _RecordingResponse(HttpResponse):
    """Writes the request's usage into the ledger once the reply has been handed to the server."""

    def __init__(self, *args, request_id: str, **kwargs):
        super().__init__(*args, **kwargs)
        self._request_id = request_id

    def close(self):
        # Called by the server once the body is sent. The ledger write goes first: HttpResponse.close()
        # sends request_finished, which hands the thread's database connection back to the pool; a
        # write after it kept a pooled connection on this idle thread until its next request, and
        # enough idle threads starved the pool (PoolTimeout: HTTP 500s after bursts).
        try:
            dispatch.record(self._request_id)
        finally:
            super().close()


def _collect(job: RequestInput, model, spec: InferenceRequest) -> HttpResponse:
    parts: list[str] = []
    try:
        for event in dispatch.relay(job, model):
            if isinstance(event, Delta):
                parts.append(event.text)
            elif isinstance(event, Done):
                body = completion_body(
                    spec.kind, job.request_id, int(job.enqueued_at), model.model_id, "".join(parts), event.usage
                )
                return _RecordingResponse(json.dumps(body), content_type="application/json", request_id=job.request_id)
            elif isinstance(event, Failed):
                return _failure_error(event).response()
    except BaseException:
        dispatch.abandon(job)
        raise
    raise AssertionError("relay ended without a final event")


def _abandon(job: RequestInput) -> None:
    try:
        dispatch.abandon(job)
    except REDIS_UNAVAILABLE:
        # The worker cannot be told to stop: it finishes the request and bills all of it.
        log.warning("request %s: could not stop it on its worker (Redis unavailable)", job.request_id)


def _stream(job: RequestInput, model, spec: InferenceRequest):
    writer = ChunkWriter(spec.kind, job.request_id, int(job.enqueued_at), model.model_id, spec.include_usage)
    finished = False
    try:
        yield writer.opening()
        for event in dispatch.relay(job, model):
            if isinstance(event, Delta):
                if event.text:
                    yield writer.delta(event.text)
            elif isinstance(event, Idle):
                yield writer.keepalive()  # a gone client makes this write fail, which aborts the request
            elif isinstance(event, Done):
                finished = True
                yield writer.closing(event.usage)
            elif isinstance(event, Failed):
                finished = True
                yield writer.error(_failure_error(event).body())
    except REDIS_UNAVAILABLE:
        # Headers are out: end the stream with an error event rather than a cut connection. The
        # worker records the usage itself; the periodic flush writes it (no fast path without Redis).
        log.warning("request %s: Redis failed while relaying its stream", job.request_id, exc_info=True)
        interrupted = ServiceUnavailable("The token stream was interrupted; try again.", code="stream_interrupted")
        yield writer.error(interrupted.body())
        return
    finally:
        if not finished:
            _abandon(job)
    # Reached only after the last frame was written out.
    dispatch.record(job.request_id)
