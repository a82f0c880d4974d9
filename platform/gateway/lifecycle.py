"""The life of one inference request in the gateway: its steps, in the order they run.

    authenticate → validate → admit → route → enqueue → relay → finish and settle → record

`gateway/views.py` speaks HTTP: it picks the request's parser, calls `start` (steps 1-5) and then
`relay` (steps 6-8), and renders what they give as a JSON reply or an SSE stream. Each step below
calls the one module that does its work:

| step                 | here                      | the work                                                  |
|----------------------|---------------------------|-----------------------------------------------------------|
| 1. authenticate      | `start` → `authenticate`  | gateway/auth.py: the key, its tenant's limits             |
| 2. validate          | `validate`                | gateway/validation.py, catalog/selectors.py, images.py    |
| 3. admit             | `admit`                   | quotas/gate.py, gateway/tokenization.py, `dispatch.await_worker` |
| 4. route             | `route`                   | gateway/routing.py `choose_worker`                        |
| 5. enqueue           | `_start`                  | gateway/dispatch.py `enqueue` (input, lease, task)        |
| 6. relay             | `relay`                   | gateway/dispatch.py `relay` → gateway/streams.py          |
| 7. finish and settle | (the worker, or dispatch) | see "How usage becomes final" below                       |
| 8. record            | `record`                  | ledger/writer.py, or ledger/services.py `ledger_flush`    |

Steps 1-5 block (the ORM, sync Redis, the tokenizer): `start` runs them as one call on a gateway
thread (gateway/offload.py). Cheap refusals come before expensive steps: a request over its limits
costs no tokenization and is never counted as demand for its pool. Steps 6-8 run on the event loop:
an open stream holds no thread.

Names: `http_request` is Django's request; `inference` is what the client asked for, validated (an
InferenceRequest); `request` is the request as its worker gets it (a RequestInput); `model` is the
served model it runs on.

How a stream ends (one of four ways):
- its last event: `relay` records the usage (step 8) and yields the last batch, which the view
  sends as the body's last part (config/streaming.py `FinalPart`), so the quota is settled by the
  time the client reads the end of the reply;
- the client goes away: Django cancels the response task (config/asgi.py, CancelledError at the
  stream's current await) or the server stops iterating it (the view's `_EventStreamResponse` closes
  the stream's generator: GeneratorExit at its yield); either way `relay`'s `finally` abandons the
  request (`abandon`: taken back if still queued, else its worker is told to stop and bills what it
  generated);
- Redis fails mid-stream for longer than the reader rides out: the view ends the stream with an
  error event, `relay` abandons the request, and the worker's usage entry is written by the flush;
- the client goes away while steps 1-5 run on their thread: that thread cannot be stopped, so
  `start` lets it finish and then abandons a request it enqueued.
Three shields keep the cleanup whole when a second cancellation comes (a server shutting down):
`start`'s (steps 1-5 finish), `abandon`'s (the stop reaches Redis) and the stream reader's (its
wake is sent, gateway/streams.py). A response whose body is sent is let finish (config/asgi.py).

How usage becomes final: a request's usage is final once its entry is in `ledger:pending` (Redis),
and its quota reservation is settled with it (`quota_settle`, idempotent per request id, so the paths
may overlap); its ledger row (unique request id) follows. Every path, who takes it, and where the
reservation settles:

- worker done: workers/relay.py writes the engine's counts with the stream's done event and settles
  in the same transaction (`settle_pending_call`; `_settle` again after a Redis restart).
- client abandoned: `abandon` here; a request still queued is taken back (below), a started one is
  stopped by its worker, which ends it as "worker done" with what it generated (status cancelled).
- taken back: dispatch.py `_take_back` (the queue deadline, no ready worker left, its routed worker
  gone before claiming it, or an abandon): a zero-token entry, settled by
  `quotas.settlement.usage_buffer`.
- worker lost: dispatch.py `_lost` (from `_check_stalled`): a request that can continue on another
  worker of the pool does (`_continue`), and that worker's end is "worker done"; otherwise the
  relayed tokens, status worker_lost, unless the worker's own entry is there first; settled by
  `usage_buffer`.
- ledger flush: `ledger.services.ledger_flush` (step 8 with batching off, the batch writer of
  ledger/writer.py, the periodic `ledger.flush` task, an invoice run) announces each batch on
  `pending_flushing`, whose receiver in quotas/settlement.py settles it before the rows are written.
- reservation reaped: `quotas.settlement.reservations_reap` (the `quotas.reap` task, every minute)
  settles a reservation nobody settled within its hold (a crashed gateway) to the pending entry,
  the ledger row, or zero.
"""

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from django import db
from django.conf import settings

from catalog.models import ServedModel
from catalog.selectors import served_model_get
from contract.outage import REDIS_UNAVAILABLE
from contract.protocol import RequestInput
from gateway import dispatch, images, routing, tokenization
from gateway.auth import authenticate
from gateway.dispatch import Done, Event, Failed
from gateway.errors import InvalidRequest
from gateway.offload import run_blocking
from gateway.validation import InferenceRequest, parse_json_body
from ledger.services import ledger_flush
from ledger.writer import ledger_write_soon
from quotas.admission import quota_release
from quotas.gate import admission_check, admission_gate
from quotas.limits import Limits
from tenants.services import KeyPrincipal

log = logging.getLogger(__name__)


@dataclass
class Enqueued:
    """A request admitted and in its worker's queue: what the relay and the view need."""

    request: RequestInput
    model: ServedModel
    inference: InferenceRequest
    headers: dict[str, str]  # admission's x-ratelimit-* headers


# Tasks started by a request that outlive it; the event loop keeps only weak references to tasks.
_background: set[asyncio.Task] = set()


async def start(http_request, parse: Callable[[dict], InferenceRequest]) -> Enqueued:
    """Steps 1-5, as one call on a gateway thread; raises the OpenAIError to answer.

    A cancelled view (the client went away) cannot stop that thread: the call runs to its end
    regardless, and a request it enqueued is then abandoned rather than generated for nobody."""
    steps = asyncio.ensure_future(run_blocking(_start, http_request, parse))
    try:
        return await asyncio.shield(steps)
    except asyncio.CancelledError:
        steps.add_done_callback(_abandon_if_enqueued)
        raise


def _start(http_request, parse: Callable[[dict], InferenceRequest]) -> Enqueued:
    principal, limits = authenticate(http_request)
    inference, model = validate(http_request.body, parse, principal=principal, limits=limits)
    request, headers = admit(inference, model, principal=principal, limits=limits)
    try:
        route(request, model)
        dispatch.enqueue(request, model)  # step 5: its input, reader lease and task, in one transaction
    except BaseException:
        quota_release(request_id=request.request_id)
        routing.release(request.request_id, request.routed_to)
        raise
    # In its worker's queue: settled through the ledger from here on.
    return Enqueued(request, model, inference, headers)


def _abandon_if_enqueued(steps: asyncio.Future) -> None:
    if steps.cancelled() or steps.exception() is not None:
        return  # nothing was enqueued (or what was is released by its own error path)
    task = asyncio.ensure_future(abandon(steps.result().request))
    _background.add(task)
    task.add_done_callback(_background.discard)


def validate(
    body: bytes, parse: Callable[[dict], InferenceRequest], *, principal: KeyPrincipal, limits: Limits
) -> tuple[InferenceRequest, ServedModel]:
    """Step 2: the body as an inference request of a model the key may use (400/404 otherwise).
    The body's size was checked before Django read it (config/middleware.py `RequestBodyLimit`)."""
    inference = parse(parse_json_body(body))
    model = served_model_get(principal=principal, limits=limits, model_id=inference.model)
    images.check_model(model, inference.messages)
    return inference, model


def admit(
    inference: InferenceRequest, model: ServedModel, *, principal: KeyPrincipal, limits: Limits
) -> tuple[RequestInput, dict[str, str]]:
    """Step 3: refuse early, tokenize, wait for a worker, reserve; the request as its worker gets it
    and admission's headers. From here on the caller owns the reservation (`quota_release` it if
    the request is not enqueued)."""
    check = functools.partial(
        admission_check, principal=principal, limits=limits, implicit_max_tokens=inference.max_tokens is None,
        prompt_param=_prompt_param(inference), choices=inference.n,
    )  # fmt: skip
    # First with a lower bound of the prompt's size (no tokenizing), then with the exact size.
    prompt_at_least = tokenization.prompt_tokens_at_least(
        model.path, messages=inference.messages, prompt=inference.prompt
    )
    # Every choice of n may generate max_tokens: admission reserves them all.
    bound_max_tokens = _max_tokens(inference, model.context_length, prompt_at_least, at_least=True)
    # The pool's ready workers are read in the same round trip (one wait for Redis fewer).
    ready = check(
        prompt_tokens=prompt_at_least, max_tokens=bound_max_tokens * inference.n, at_least=True, ready_pool=model.pool
    )
    prepared = images.prepare(model, inference.messages) if inference.kind == "chat" else []
    prompt_ids = _prompt_ids(model, inference)
    # Each image's placeholder token becomes the image's tokens in the engine: counted here too.
    prompt_tokens = images.prompt_tokens(prompt_ids, prepared)
    max_tokens = _max_tokens(inference, model.context_length, prompt_tokens)
    # What can never fit is refused at its exact size. The quota counters are asked again only for a
    # request about to wait for its pool (counted as demand meanwhile); with a worker ready, the
    # reservation below is the exact check: one Lua call fewer on the hot path.
    check(prompt_tokens=prompt_tokens, max_tokens=max_tokens * inference.n, counters=not ready)
    if not ready:
        # A waiting request holds its gateway thread, not a PostgreSQL connection.
        db.connection.close()
        ready = dispatch.await_worker(model)
    request_id = f"{'chatcmpl' if inference.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    admitted_at = time.time()
    # The exact reservation (429, nothing enqueued; a check above may have been overtaken by other
    # requests) and the pool's fair share.
    admitted = admission_gate(
        principal=principal, limits=limits, model=model, request_id=request_id, prompt_tokens=prompt_tokens,
        max_tokens=max_tokens * inference.n, implicit_max_tokens=inference.max_tokens is None,
        choices=inference.n, ready_workers=ready,
    )  # fmt: skip
    request = RequestInput(
        request_id=request_id,
        model=model.model_id,
        prompt_token_ids=prompt_ids,
        params=_engine_params(inference, admitted.max_tokens // inference.n),
        tenant_id=principal.tenant_id,
        key_id=principal.key_id,
        enqueued_at=admitted_at,
        # Keeps one tenant from probing another's prompts through the shared prefix cache.
        cache_salt=f"tenant-{principal.tenant_id}",
        adapter_id=model.adapter.pk if model.adapter else 0,
        adapter_digest=model.adapter.digest if model.adapter else "",
        tool_mode=inference.tool_mode,
        tool_name=inference.tool_name or "",
        images=[image.wire() for image in prepared],
    )
    return request, dict(admitted.headers)


def route(request: RequestInput, model: ServedModel) -> None:
    """Step 4: the worker whose own queue gets the request ("" for the pool's queue)."""
    request.routed_to = routing.choose_worker(request, model.pool).worker


async def relay(enqueued: Enqueued) -> AsyncIterator[list[Event]]:
    """Steps 6-8: the request's events, those of one read together, until its last (Done or
    Failed). Its usage is recorded (step 8) before the last batch is yielded. A caller that stops
    early (it closes this generator, or its task is cancelled) abandons the request."""
    request = enqueued.request
    finished = False
    try:
        async with aclosing(dispatch.relay(request, enqueued.model)) as batches:
            async for events in batches:
                if isinstance(events[-1], Done | Failed):
                    finished = True
                    await record(request)
                    yield events
                    return
                yield events
    finally:
        if not finished:
            await abandon(request)


async def record(request: RequestInput) -> None:
    """Step 8: the ledger's fast path for a finished request (the periodic flush is the safety net).
    Its worker settled its quota in the write that carried its end; its row follows with this
    process's next batch, or, with batching off (LEDGER_BATCH_SECONDS=0), now, on a gateway thread.
    An unreachable Redis leaves it to the periodic flush (the worker's usage entry is durable)
    rather than cost the client a reply it was generated."""
    try:
        if settings.LEDGER_BATCH_SECONDS:
            ledger_write_soon(request.request_id)  # no I/O: safe on the event loop
        else:
            await run_blocking(ledger_flush, request_ids=[request.request_id])
    except REDIS_UNAVAILABLE:
        log.warning("request %s: its usage is left to the periodic flush (Redis unavailable)", request.request_id)


async def abandon(request: RequestInput) -> None:
    """The client went away: stop the request wherever it is. Shielded, so a second cancellation
    (the server shutting down) cannot cut it off half way. Never raises for an unreachable Redis."""
    try:
        await asyncio.shield(_abandon(request))
    except asyncio.CancelledError:
        pass  # the shielded call goes on by itself


async def _abandon(request: RequestInput) -> None:
    try:
        await dispatch.abandon(request)
    except REDIS_UNAVAILABLE:
        # The worker cannot be told to stop: it finishes the request and bills all of it.
        log.warning("request %s: could not stop it on its worker (Redis unavailable)", request.request_id)


def _engine_params(inference: InferenceRequest, max_tokens: int) -> dict:
    """The engine's parameters for the request (workers/engine.py REQUEST_KEYS); `max_tokens` per choice."""
    params = dict(inference.sampling, max_tokens=max_tokens)
    if inference.n > 1:
        params["n"] = inference.n
    if inference.logprobs is not None:
        params["logprobs"] = inference.logprobs
    if inference.structured is not None:
        params["structured_outputs"] = inference.structured
    if inference.tool_mode == "auto":
        # The model's tool-call markers are special tokens: keep them in the text, for the parser.
        params["skip_special_tokens"] = False
    return params


def _prompt_param(inference: InferenceRequest) -> str:
    return "messages" if inference.kind == "chat" else "prompt"


def _prompt_ids(model: ServedModel, inference: InferenceRequest) -> list[int]:
    tokenization.check_logit_bias(model.path, inference.sampling.get("logit_bias"))
    if inference.kind == "chat":
        return tokenization.chat_prompt_ids(model.path, inference.messages, inference.tools)
    return tokenization.completion_prompt_ids(model.path, inference.prompt)


def _max_tokens(inference: InferenceRequest, context_length: int, prompt_tokens: int, *, at_least: bool = False) -> int:
    """The completion's length to reserve; 400 if the prompt and max_tokens cannot fit the context.
    `at_least`: `prompt_tokens` is a lower bound of the prompt's size."""
    room = context_length - prompt_tokens
    counted = f"at least {prompt_tokens}" if at_least else str(prompt_tokens)
    if room < 1:
        raise InvalidRequest(
            f"This model's maximum context length is {context_length} tokens; the prompt has {counted}.",
            param=_prompt_param(inference),
            code="context_length_exceeded",
        )
    if inference.max_tokens is None:
        return room
    if inference.max_tokens > room:
        requested = (
            f"at least {prompt_tokens + inference.max_tokens}" if at_least else prompt_tokens + inference.max_tokens
        )
        raise InvalidRequest(
            f"This model's maximum context length is {context_length} tokens. You requested "
            f"{requested} tokens ({counted} in the prompt, {inference.max_tokens} for the "
            "completion). Reduce the prompt or the completion length.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return inference.max_tokens
