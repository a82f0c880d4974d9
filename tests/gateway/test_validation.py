"""Request validation: every bad field is a 400 naming its param; valid bodies become typed requests."""

import pytest

from gateway.errors import InvalidRequest
from gateway.validation import chat_request, completion_request, parse_json_body

MESSAGES = [{"role": "user", "content": "hi"}]


def test_a_full_chat_body_is_parsed():
    request = chat_request({
        "model": "m", "messages": [{"role": "developer", "content": [{"type": "text", "text": "be brief"}]}] + MESSAGES,
        "max_completion_tokens": 10, "max_tokens": 99, "temperature": 0.5, "top_p": 0.9, "stop": "END", "seed": 7,
        "n": 1, "stream": True, "stream_options": {"include_usage": True}, "user": "u1",
    })  # fmt: skip
    assert request.messages[0] == {"role": "system", "content": "be brief"}
    assert request.max_tokens == 10  # max_completion_tokens wins over the legacy field
    assert request.sampling == {"temperature": 0.5, "top_p": 0.9, "stop": ["END"], "seed": 7}
    assert request.stream and request.include_usage


def test_a_completion_accepts_a_string_a_one_string_list_or_token_ids():
    assert completion_request({"model": "m", "prompt": ["x"]}).prompt == "x"
    assert completion_request({"model": "m", "prompt": [1, 2, 3]}).prompt == [1, 2, 3]


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"messages": MESSAGES}, "model", "missing_required_parameter"),
        ({"model": 3, "messages": MESSAGES}, "model", "invalid_type"),
        ({"model": "m", "messages": []}, "messages", "invalid_value"),
        ({"model": "m", "messages": ["hi"]}, "messages[0]", "invalid_type"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_type"),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            "messages[0].content[0]",
            "unsupported_content",
        ),
        ({"model": "m", "messages": MESSAGES, "temperature": True}, "temperature", "invalid_value"),
        ({"model": "m", "messages": MESSAGES, "top_p": 0}, "top_p", "invalid_value"),
        ({"model": "m", "messages": MESSAGES, "max_tokens": 1.5}, "max_tokens", "invalid_value"),
        ({"model": "m", "messages": MESSAGES, "seed": "1"}, "seed", "invalid_value"),
        ({"model": "m", "messages": MESSAGES, "stop": [""]}, "stop", "invalid_value"),
        ({"model": "m", "messages": MESSAGES, "n": 9}, "n", "invalid_value"),
        ({"model": "m", "messages": MESSAGES, "audio": {}}, "audio", "unsupported_parameter"),
        ({"model": "m", "messages": MESSAGES, "prompt": "x"}, "prompt", "unknown_parameter"),
        ({"model": "m", "messages": MESSAGES, "stream": "yes"}, "stream", "invalid_type"),
        (
            {"model": "m", "messages": MESSAGES, "stream": True, "stream_options": {"x": 1}},
            "stream_options",
            "invalid_value",
        ),
    ],
)
def test_invalid_chat_bodies_name_the_param(body, param, code):
    with pytest.raises(InvalidRequest) as error:
        chat_request(body)
    assert (error.value.param, error.value.code) == (param, code)
    assert error.value.status == 400


@pytest.mark.parametrize("prompt", [None, "", [], ["a", "b"], [1, -1], [1, "a"], {"x": 1}, [True]])
def test_invalid_prompts_are_refused(prompt):
    body = {"model": "m"} if prompt is None else {"model": "m", "prompt": prompt}
    with pytest.raises(InvalidRequest) as error:
        completion_request(body)
    assert error.value.param == "prompt"


@pytest.mark.parametrize("raw", [b"", b"{", b"[1]", b"\xff\xfe", b'"text"'])
def test_bodies_that_are_not_json_objects_are_refused(raw):
    with pytest.raises(InvalidRequest) as error:
        parse_json_body(raw)
    assert error.value.code == "invalid_json"


def _nested(depth: int) -> bytes:
    return b'{"model": "m", "prompt": ' + b"[" * depth + b"1" + b"]" * depth + b"}"


@pytest.mark.parametrize("depth", [40, 5000])
def test_deeply_nested_bodies_are_refused(depth):
    with pytest.raises(InvalidRequest) as error:
        parse_json_body(_nested(depth))
    assert error.value.code == "invalid_json"
    assert "nest" in error.value.message


def test_a_body_nested_as_deep_as_a_request_can_be_is_parsed():
    body = b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}'
    assert parse_json_body(body)["messages"][0]["content"][0]["text"] == "hi"


@pytest.mark.parametrize("digits", [101, 5000])
def test_integer_literals_with_too_many_digits_are_refused(digits):
    with pytest.raises(InvalidRequest) as error:
        parse_json_body(b'{"model": "m", "seed": ' + b"9" * digits + b"}")
    assert error.value.code == "invalid_json"
    assert "digits" in error.value.message


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e400"])
def test_non_finite_numbers_are_refused(literal):
    with pytest.raises(InvalidRequest) as error:
        parse_json_body(b'{"model": "m", "temperature": ' + literal + b"}")
    assert error.value.code == "invalid_json"


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_number_field_is_refused_even_when_given_directly(value):
    with pytest.raises(InvalidRequest) as error:
        chat_request({"model": "m", "messages": MESSAGES, "temperature": value})
    assert error.value.param == "temperature"


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (rb'{"model": "m", "prompt": "a\ud800b"}', "prompt"),
        (rb'{"model": "m", "messages": [{"role": "user", "content": "\udfff"}]}', "messages[0].content"),
        (rb'{"model": "m", "stop": ["ok", "\ud83d"]}', "stop[1]"),
        ('{"model": "m", "prompt": "a\udc80"}'.encode("utf-8", "surrogatepass"), "prompt"),
    ],
)
def test_lone_surrogates_are_refused_naming_the_param(raw, param):
    with pytest.raises(InvalidRequest) as error:
        parse_json_body(raw)
    assert (error.value.param, error.value.code) == (param, "invalid_value")


def test_a_surrogate_pair_is_a_character_like_any_other():
    assert parse_json_body(rb'{"model": "m", "prompt": "\ud83d\ude00"}')["prompt"] == "\U0001f600"
