"""Property-based fuzzing of the OpenAI request schema: any body is either a valid request or a 4xx in
OpenAI's error shape, never a 5xx, whether parsed directly (gateway.validation) or sent to the view."""

import json

import pytest
from django.test import Client
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.errors import InvalidRequest, error_response
from gateway.validation import InferenceRequest, chat_request, completion_request, parse_json_body
from tests.json_strategies import FUZZ, bodies, json_values, texts

_ROLES = st.sampled_from(["system", "developer", "user", "assistant", "tool"])
_MESSAGE = st.fixed_dictionaries({"role": _ROLES, "content": texts})
_COMMON = {
    "model": texts,
    "max_tokens": st.integers(min_value=-2, max_value=2**64),
    "temperature": st.floats(min_value=-1, max_value=3),
    "top_p": st.floats(min_value=0, max_value=1),
    "stop": st.lists(texts, max_size=5) | texts,
    "seed": st.integers(min_value=-(2**64), max_value=2**64),
    "n": st.integers(min_value=0, max_value=3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "user": texts,
    "presence_penalty": st.floats(min_value=-3, max_value=3),
    "frequency_penalty": st.floats(min_value=-3, max_value=3),
    "logit_bias": st.dictionaries(st.integers(min_value=-1, max_value=2000).map(str) | texts, st.floats(), max_size=3),
}
_SCHEMAS = json_values | st.fixed_dictionaries(
    {"type": st.sampled_from(["object", "string", "array", "integer", "nonsense"])},
    optional={"properties": st.dictionaries(texts, json_values, max_size=2), "maxLength": st.integers(),
              "pattern": texts, "required": json_values},
)  # fmt: skip
_FUNCTION = st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "get_weather"]) | texts}, optional={"parameters": _SCHEMAS, "description": texts}
)
_TOOLS = st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": _FUNCTION}), max_size=3)
_TOOL_CHOICES = st.sampled_from(["none", "auto", "required"]) | st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g"])})}
)
_RESPONSE_FORMATS = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])},
    optional={"json_schema": st.fixed_dictionaries({"name": st.just("x") | texts}, optional={"schema": _SCHEMAS})},
)
_CALL = st.fixed_dictionaries(
    {"id": texts, "type": st.just("function"),
     "function": st.fixed_dictionaries({"name": texts, "arguments": st.just('{"a": 1}') | texts})}
)  # fmt: skip
_TOOL_MESSAGES = st.fixed_dictionaries({"role": st.just("tool"), "content": texts}, optional={"tool_call_id": texts})
_CALLING = st.fixed_dictionaries(
    {"role": st.just("assistant"), "tool_calls": st.lists(_CALL, max_size=2)}, optional={"content": st.none() | texts}
)
CHAT_BODIES = bodies(
    _COMMON
    | {
        "messages": st.lists(_MESSAGE | _TOOL_MESSAGES | _CALLING, max_size=3),
        "max_completion_tokens": st.integers(),
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(min_value=-1, max_value=25),
        "tools": _TOOLS,
        "tool_choice": _TOOL_CHOICES,
        "parallel_tool_calls": st.booleans(),
        "response_format": _RESPONSE_FORMATS,
    }
)
COMPLETION_BODIES = bodies(
    _COMMON
    | {
        "prompt": texts | st.lists(st.integers(min_value=-1, max_value=300_000), max_size=4),
        "logprobs": st.integers(min_value=-1, max_value=6),
    }
)


def _strings_of(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from _strings_of(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings_of(item)


def _assert_parsed_or_refused(raw: bytes, parse) -> None:
    try:
        spec = parse(parse_json_body(raw))
    except InvalidRequest as error:
        assert 400 <= error.status < 500
        body = json.loads(error_response(error).content)
        assert set(body["error"]) == {"message", "type", "param", "code"}
        return
    assert isinstance(spec, InferenceRequest)
    json.dumps(spec.sampling, allow_nan=False)  # nothing non-finite reaches the engine
    json.dumps([spec.structured, spec.tools], allow_nan=False)
    for text in _strings_of([spec.model, spec.messages, spec.prompt, spec.sampling, spec.structured, spec.tools]):
        text.encode("utf-8")  # nothing a tokenizer cannot encode


@settings(FUZZ, max_examples=300)
@given(raw=CHAT_BODIES)
def test_any_chat_body_is_parsed_or_refused_with_a_4xx(raw):
    _assert_parsed_or_refused(raw, chat_request)


@settings(FUZZ, max_examples=300)
@given(raw=COMPLETION_BODIES)
def test_any_completion_body_is_parsed_or_refused_with_a_4xx(raw):
    _assert_parsed_or_refused(raw, completion_request)


@pytest.fixture
def key(transactional_db, make_tenant, redis_client):
    _, plaintext = make_tenant("fuzzer")
    return plaintext


@settings(FUZZ, max_examples=40)
@given(
    path_and_raw=st.one_of(
        st.tuples(st.just("/v1/chat/completions"), CHAT_BODIES),
        st.tuples(st.just("/v1/completions"), COMPLETION_BODIES),
    )
)
def test_the_inference_views_answer_any_body_with_a_4xx_in_openai_shape(key, path_and_raw):
    path, raw = path_and_raw
    response = Client(raise_request_exception=False).post(
        path, data=raw, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {key}"
    )
    # No model is registered: a body that passes validation ends in the model's 404.
    assert 400 <= response.status_code < 500, response.content
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
