"""EngineHost on the real vLLM engine (CPU, tiny Gemma 4 model), driven from many threads.

One engine serves the whole session (see conftest.py). Greedy decoding of the random model is
deterministic, so outputs can be compared exactly.
"""

import asyncio
import json
import threading
import time
import uuid

import pytest

from tests.workers.engine_stream import abort, open_stream, unfinished_requests
from workers.engine import EngineHost, EngineNotReady, EngineStartError, RequestRejected

pytestmark = pytest.mark.engine

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def _rid(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def _collect(host, prompt_ids, params, **kwargs):
    return list(open_stream(host, _rid(), prompt_ids, params, **kwargs))


def _ids(chunks) -> list[int]:
    return [token for chunk in chunks for token in chunk.token_ids]


def _text(chunks) -> str:
    return "".join(chunk.text for chunk in chunks)


def _vllm_direct(host, prompt_ids, max_tokens):
    """The same request straight through vLLM's AsyncLLM (final output only), on the host's loop."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, output_kind=RequestOutputKind.FINAL_ONLY, **GREEDY)

    async def run():
        final = None
        async for output in host._engine.generate({"prompt_token_ids": prompt_ids}, params, _rid("direct")):
            final = output
        return final.outputs[0]

    return asyncio.run_coroutine_threadsafe(run(), host._loop).result(timeout=60)


def _wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_the_host_is_ready(engine_host):
    assert engine_host.ready
    assert engine_host.state == "ready"
    assert unfinished_requests(engine_host) == 0


def test_greedy_output_is_deterministic_and_equals_vllm_direct(engine_host, chat_prompt_ids):
    first = _collect(engine_host, chat_prompt_ids, {**GREEDY, "max_tokens": 48})
    second = _collect(engine_host, chat_prompt_ids, {**GREEDY, "max_tokens": 48})
    direct = _vllm_direct(engine_host, chat_prompt_ids, 48)
    assert _ids(first) == _ids(second) == list(direct.token_ids)
    assert _text(first) == _text(second) == direct.text


def test_chunks_add_up_to_the_completion(engine_host, chat_prompt_ids):
    chunks = _collect(engine_host, chat_prompt_ids, {**GREEDY, "max_tokens": 40})
    final = chunks[-1]
    assert [chunk.finished for chunk in chunks] == [False] * (len(chunks) - 1) + [True]
    assert final.finish_reason == "length"
    assert all(chunk.finish_reason is None for chunk in chunks[:-1])
    assert sum(chunk.token_count for chunk in chunks) == len(_ids(chunks)) == final.completion_tokens == 40
    assert all(chunk.token_count == len(chunk.token_ids) for chunk in chunks)
    assert all(chunk.prompt_tokens == len(chat_prompt_ids) for chunk in chunks)
    assert chunks[0].token_count > 0 and chunks[0].ttft is not None and chunks[0].ttft > 0
    assert final.decode_time is not None and final.decode_time > 0


class _RecordingSink:
    """An ``OutputSink`` that records each engine output as it comes: (tokens, text)."""

    def __init__(self) -> None:
        self.abandoned = False
        self.outputs: list[tuple[int, str]] = []
        self.token_ids: list[int] = []
        self.ended = threading.Event()

    def prefilled(self, prompt_tokens: int, cached_tokens: int = 0) -> None:
        pass

    def push(self, text, token_ids, finished, finish_reason, index=0, logprobs=None) -> None:
        self.outputs.append((len(token_ids), text))
        self.token_ids += token_ids
        if finished:
            self.ended.set()

    def end(self, finish_reason, error=None) -> None:
        self.ended.set()


# A prompt whose greedy answer from the tiny model starts with a token that shows no text.
PROMPT_OF_A_SILENT_FIRST_TOKEN = [2, 105, 5, 106, 107]


def test_the_engine_hands_on_every_token_until_the_first_text_then_a_stream_interval_at_a_time(engine_host):
    interval = engine_host.text_stream_interval
    assert interval == 8  # the tests' engine (tests/workers/conftest.py)
    sink = _RecordingSink()
    engine_host.submit(_rid(), PROMPT_OF_A_SILENT_FIRST_TOKEN, {**GREEDY, "max_tokens": 40}, sink)
    assert sink.ended.wait(60)
    first_text = next(position for position, (_, text) in enumerate(sink.outputs) if text)
    assert first_text >= 1, sink.outputs  # the case at stake
    # One output per token until the first text (vLLM's stream_interval would gather 8 after the
    # first token, and hold that text back), then 8 tokens an output, the rest with the end.
    counts = [tokens for tokens, _ in sink.outputs]
    assert counts[: first_text + 1] == [1] * (first_text + 1), counts
    later = counts[first_text + 1 :]
    assert later[:-1] == [interval] * (len(later) - 1) and 1 <= later[-1] <= interval, counts
    assert sink.token_ids == list(_vllm_direct(engine_host, PROMPT_OF_A_SILENT_FIRST_TOKEN, 40).token_ids)


def test_deltas_are_coalesced_per_flush_interval(engine_host, chat_prompt_ids):
    params = {**GREEDY, "max_tokens": 200}
    received = []
    for chunk in open_stream(engine_host, _rid(), chat_prompt_ids, params, flush_interval=0.1):
        received.append((time.monotonic(), chunk))
    times = [at for at, chunk in received if not chunk.finished]
    gaps = [later - earlier for earlier, later in zip(times, times[1:], strict=False)]
    assert all(gap >= 0.095 for gap in gaps), gaps
    assert sum(chunk.token_count for _, chunk in received) == 200
    # Every engine output as its own chunk: never fewer than the coalesced ones. How many fewer the
    # interval makes depends on the engine's speed (a loaded machine's engine makes few outputs per
    # 0.1 s), so the gaps above are what this checks of the coalescing.
    per_output = _collect(engine_host, chat_prompt_ids, params, flush_interval=0)
    assert len(received) <= len(per_output), (len(received), len(per_output))
    assert _ids(chunk for _, chunk in received) == _ids(per_output)


def test_max_tokens_is_honoured(engine_host, chat_prompt_ids):
    chunks = _collect(engine_host, chat_prompt_ids, {**GREEDY, "max_tokens": 5})
    assert chunks[-1].completion_tokens == 5
    assert chunks[-1].finish_reason == "length"


def test_a_stop_string_ends_the_completion_before_it(engine_host, chat_prompt_ids):
    full = _text(_collect(engine_host, chat_prompt_ids, {**GREEDY, "max_tokens": 64}))
    # A printable two-character piece from the middle of the greedy output, first seen there.
    stop = next(
        full[i : i + 2]
        for i in range(len(full) // 3, len(full) - 2)
        if full[i : i + 2].isalnum() and full[i : i + 2].isascii() and full.index(full[i : i + 2]) == i
    )
    chunks = _collect(engine_host, chat_prompt_ids, {**GREEDY, "max_tokens": 64, "stop": [stop]})
    assert chunks[-1].finish_reason == "stop"
    assert _text(chunks) == full[: full.index(stop)]


def test_a_seed_makes_sampling_reproducible(engine_host, chat_prompt_ids):
    def sample(seed):
        params = {"temperature": 1.0, "top_p": 1.0, "seed": seed, "max_tokens": 32, "ignore_eos": True}
        return _ids(_collect(engine_host, chat_prompt_ids, params))

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_concurrent_streams_are_batched(engine_host, chat_prompt_ids):
    n, max_tokens = 32, 64
    params = {**GREEDY, "max_tokens": max_tokens}
    _collect(engine_host, chat_prompt_ids, params)  # warm

    started = time.monotonic()
    sequential_tokens = sum(_collect(engine_host, chat_prompt_ids, params)[-1].completion_tokens for _ in range(n))
    sequential = time.monotonic() - started

    results: dict[int, int] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(n)

    def one(i):
        try:
            barrier.wait()
            results[i] = _collect(engine_host, chat_prompt_ids, params)[-1].completion_tokens
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    concurrent = time.monotonic() - started

    assert not errors, errors
    assert sequential_tokens == sum(results.values()) == n * max_tokens
    ratio = sequential / concurrent
    print(
        f"\n{n} x {max_tokens} tokens: sequential {sequential:.2f} s ({sequential_tokens / sequential:.0f} tok/s), "
        f"{n} threads {concurrent:.2f} s ({n * max_tokens / concurrent:.0f} tok/s), speed-up {ratio:.1f}x"
    )
    assert ratio > 3


def test_closing_a_stream_aborts_the_request(engine_host, chat_prompt_ids):
    stream = open_stream(engine_host, _rid("abort"), chat_prompt_ids, {**GREEDY, "max_tokens": 1900})
    first = next(stream)
    assert not first.finished
    assert unfinished_requests(engine_host) == 1
    stream.close()
    assert _wait_until(lambda: unfinished_requests(engine_host) == 0)
    assert list(stream) == []
    # The engine serves the next request normally.
    assert _collect(engine_host, chat_prompt_ids, {**GREEDY, "max_tokens": 3})[-1].completion_tokens == 3


def test_a_stream_closed_before_its_first_token_is_aborted(engine_host, chat_prompt_ids):
    for _ in range(5):  # closes racing the submission, at several points
        open_stream(engine_host, _rid("early"), chat_prompt_ids, {**GREEDY, "max_tokens": 1900}).close()
    assert _wait_until(lambda: unfinished_requests(engine_host) == 0)


def test_a_dropped_generator_loop_aborts_the_request(engine_host, chat_prompt_ids):
    def read_two_chunks():
        for count, _chunk in enumerate(
            open_stream(engine_host, _rid("drop"), chat_prompt_ids, {**GREEDY, "max_tokens": 1900})
        ):
            if count == 1:
                break  # the stream is dropped here, unclosed

    read_two_chunks()
    assert _wait_until(lambda: unfinished_requests(engine_host) == 0)


def test_abort_from_another_thread_ends_the_stream_with_abort(engine_host, chat_prompt_ids):
    rid = _rid("abort")
    chunks = []
    with open_stream(engine_host, rid, chat_prompt_ids, {**GREEDY, "max_tokens": 1900}) as stream:
        for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 1:
                threading.Thread(target=abort, args=(engine_host, rid)).start()
    assert chunks[-1].finished
    assert chunks[-1].finish_reason == "abort"
    assert chunks[-1].completion_tokens < 1900
    assert _wait_until(lambda: unfinished_requests(engine_host) == 0)


def test_priority_is_accepted_under_fcfs_scheduling(engine_host, chat_prompt_ids):
    chunks = _collect(engine_host, chat_prompt_ids, {**GREEDY, "max_tokens": 4, "priority": 5})
    assert chunks[-1].completion_tokens == 4


def test_a_cache_salt_does_not_change_the_output(engine_host, chat_prompt_ids):
    plain = _collect(engine_host, chat_prompt_ids, {**GREEDY, "max_tokens": 8})
    salted = _collect(engine_host, chat_prompt_ids, {**GREEDY, "max_tokens": 8, "cache_salt": "tenant-alice"})
    assert _ids(plain) == _ids(salted)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([2, 4, 5], {"max_tokens": 4, "best_of": 2}, "unknown request parameter"),
        ([2, 4, 5], {"max_tokens": 0}, "max_tokens"),
        ([2, 4, 5], {"temperature": -1}, "temperature"),
        ([], {"max_tokens": 4}, "no tokens"),
        (["a", "b"], {"max_tokens": 4}, "integers"),
    ],
)
def test_bad_requests_are_rejected_before_submission(engine_host, prompt, params, message):
    with pytest.raises(RequestRejected, match=message):
        open_stream(engine_host, _rid(), prompt, params)


def test_a_schema_the_grammar_compiler_refuses_ends_the_request_as_rejected(engine_host):
    params = {"max_tokens": 4, "structured_outputs": {"json": {"type": "nonsense"}}}
    with pytest.raises(RequestRejected, match="nonsense"):
        list(open_stream(engine_host, _rid(), [2, 4, 5], params))


def test_structured_outputs_make_even_a_random_model_write_json(engine_host, chat_prompt_ids):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    chunks = _collect(engine_host, chat_prompt_ids, {"temperature": 0.0, "max_tokens": 32,
                                                     "structured_outputs": {"json": schema}})  # fmt: skip
    text = "".join(chunk.text for chunk in chunks)
    assert chunks[-1].finish_reason == "stop" and isinstance(json.loads(text)["ok"], bool)


def test_a_prompt_longer_than_the_context_is_rejected(engine_host):
    with pytest.raises(RequestRejected):
        _collect(engine_host, [2] + [300] * 2100, {"max_tokens": 4})
    assert engine_host.ready


def test_a_request_id_in_flight_cannot_be_reused(engine_host, chat_prompt_ids):
    rid = _rid("dup")
    with open_stream(engine_host, rid, chat_prompt_ids, {**GREEDY, "max_tokens": 1900}):
        with pytest.raises(RequestRejected, match="already in flight"):
            open_stream(engine_host, rid, chat_prompt_ids, {"max_tokens": 1})
    assert _wait_until(lambda: unfinished_requests(engine_host) == 0)


def test_a_host_not_started_refuses_requests(engine_model_dir):
    host = EngineHost(str(engine_model_dir))
    assert host.state == "stopped" and not host.ready
    with pytest.raises(EngineNotReady):
        open_stream(host, "x", [2, 4, 5], {"max_tokens": 1})


def test_a_start_failure_is_reported_with_its_cause(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    host = EngineHost(str(tmp_path))  # no config.json: not a model
    with pytest.raises(EngineStartError, match=r"vLLM engine failed to start .*" + str(tmp_path)):
        host.start(timeout=120)
    assert host.state == "failed"
    assert host.failure


def test_a_text_prompt_reaches_the_engine_without_a_thread_hop(engine_host, chat_prompt_ids, monkeypatch):
    """vLLM renders a raw prompt on its renderer's thread pool, a hop per request; the host hands
    text prompts over rendered, so the request is made on the engine's event loop."""
    hops = []
    executor = engine_host._engine.renderer._executor
    submit = executor.submit

    def counted(fn, /, *args, **kwargs):
        hops.append(fn)
        return submit(fn, *args, **kwargs)

    monkeypatch.setattr(executor, "submit", counted)
    chunks = _collect(engine_host, chat_prompt_ids, {**GREEDY, "max_tokens": 4})
    assert len(_ids(chunks)) == 4
    assert hops == []
