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
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
            "unsupported_content",
        ),
        ({"model": "m", "messages": MESSAGES, "temperature": True}, "temperature", "invalid_value"),
        ({"model": "m", "messages": MESSAGES, "top_p": 0}, "top_p", "invalid_value"),
        ({"model": "m", "messages": MESSAGES, "max_tokens": 1.5}, "max_tokens", "invalid_value"),
        ({"model": "m", "messages": MESSAGES, "seed": "1"}, "seed", "invalid_value"),
        ({"model": "m", "messages": MESSAGES, "stop": [""]}, "stop", "invalid_value"),
        ({"model": "m", "messages": MESSAGES, "n": 3}, "n", "unsupported_value"),
        ({"model": "m", "messages": MESSAGES, "logprobs": True}, "logprobs", "unsupported_parameter"),
        (
            {"model": "m", "messages": MESSAGES, "response_format": {"type": "json_object"}},
            "response_format",
            "unsupported_parameter",
        ),
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
