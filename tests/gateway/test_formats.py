"""Reply bodies and SSE chunks for choices, logprobs and tool calls (gateway/formats.py)."""

import json

import pytest

from contract.protocol import Usage
from gateway.formats import ChoiceOutput, ChunkWriter, completion_body

USAGE = Usage(request_id="r", tenant_id=1, key_id=1, model="m", prompt_tokens=5, completion_tokens=4,
              finish_reason="stop")  # fmt: skip
CALL = {"name": "get_weather", "arguments": '{"city": "Oslo"}'}


def _frames(raw: bytes) -> list:
    payloads = [line[len(b"data: ") :] for line in raw.split(b"\n\n") if line.startswith(b"data: ")]
    return [p.decode() if p == b"[DONE]" else json.loads(p) for p in payloads]


def test_a_tool_call_reply_has_null_content_and_a_call_id():
    body = completion_body("chat", "r", 0, "m", [ChoiceOutput(finish_reason="tool_calls", tool_calls=[CALL])], USAGE)
    [choice] = body["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == CALL


def test_streamed_tool_calls_come_as_openais_chunks_then_the_finish_reason():
    writer = ChunkWriter("chat", "r", 0, "m", include_usage=True)
    frames = _frames(writer.closing(USAGE, [{"finish_reason": "tool_calls", "tool_calls": [CALL, CALL]}]))
    deltas = [f["choices"][0]["delta"] for f in frames[:-2]]
    assert [d["tool_calls"][0]["index"] for d in deltas[:4]] == [0, 0, 1, 1]
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert deltas[0]["tool_calls"][0]["id"].startswith("call_") and deltas[0]["tool_calls"][0]["type"] == "function"
    assert deltas[1]["tool_calls"][0] == {"index": 0, "function": {"arguments": CALL["arguments"]}}
    assert frames[4]["choices"][0]["finish_reason"] == "tool_calls"
    assert frames[5]["choices"] == [] and frames[5]["usage"]["total_tokens"] == 9 and frames[6] == "[DONE]"


def test_n_choices_each_open_and_finish_and_logprobs_keep_their_shape():
    writer = ChunkWriter("chat", "r", 0, "m", include_usage=False)
    opening = _frames(writer.opening(3))
    assert [f["choices"][0]["index"] for f in opening] == [0, 1, 2]
    [delta] = _frames(writer.delta("hi", 2, [["hi", -0.5, [["hi", -0.5], ["yo", -1.0]]]]))
    choice = delta["choices"][0]
    assert choice["index"] == 2 and choice["delta"] == {"content": "hi"}
    assert choice["logprobs"]["content"][0] == {
        "token": "hi", "logprob": -0.5, "bytes": [104, 105],
        "top_logprobs": [{"token": "hi", "logprob": -0.5, "bytes": [104, 105]},
                         {"token": "yo", "logprob": -1.0, "bytes": [121, 111]}],
    }  # fmt: skip
    ends = [{"finish_reason": "length"}, {"finish_reason": "stop"}, {"finish_reason": "length"}]
    closing = _frames(writer.closing(USAGE, ends))
    assert [(f["choices"][0]["index"], f["choices"][0]["finish_reason"]) for f in closing[:-1]] == [
        (0, "length"), (1, "stop"), (2, "length"),
    ]  # fmt: skip


def test_completion_logprobs_have_text_offsets_across_chunks():
    writer = ChunkWriter("completion", "r", 0, "m", include_usage=False)
    first = _frames(writer.delta("ab", 0, [["a", -1.0, []], ["b", -2.0, []]]))[0]["choices"][0]["logprobs"]
    second = _frames(writer.delta("c", 0, [["c", -3.0, [["c", -3.0]]]]))[0]["choices"][0]["logprobs"]
    assert first == {"tokens": ["a", "b"], "token_logprobs": [-1.0, -2.0], "top_logprobs": [{"a": -1.0}, {"b": -2.0}],
                     "text_offset": [0, 1]}  # fmt: skip
    assert second["text_offset"] == [2] and second["top_logprobs"] == [{"c": -3.0}]


CACHED = Usage(request_id="r", tenant_id=1, key_id=1, model="m", prompt_tokens=40, cached_tokens=32,
               completion_tokens=4, finish_reason="stop")  # fmt: skip


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_reply_reports_its_cached_prompt_tokens_as_openai_does(kind):
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    body = completion_body(kind, "r", 0, "m", [ChoiceOutput(texts=["hi"], finish_reason="stop")], CACHED)
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    parsed = (ChatCompletion if kind == "chat" else Completion).model_validate(body)
    assert parsed.usage.prompt_tokens_details.cached_tokens == 32 and parsed.usage.total_tokens == 44


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_the_streamed_usage_chunk_reports_the_cached_prompt_tokens(kind):
    from openai.types import Completion
    from openai.types.chat import ChatCompletionChunk

    frames = _frames(ChunkWriter(kind, "r", 0, "m", include_usage=True).closing(CACHED))
    usage_chunk = frames[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    parsed = (ChatCompletionChunk if kind == "chat" else Completion).model_validate(usage_chunk)
    assert parsed.usage.prompt_tokens_details.cached_tokens == 32


def test_a_reply_without_prefix_cache_hits_reports_zero_cached_tokens():
    body = completion_body("chat", "r", 0, "m", [ChoiceOutput(texts=["hi"])], USAGE)
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
