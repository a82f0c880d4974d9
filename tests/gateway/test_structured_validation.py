"""Validation of structured outputs, tools, n, logprobs and logit_bias: valid bodies become the
engine's constraints; every bad one is a 400 naming its param."""

import pytest

from gateway.errors import InvalidRequest
from gateway.structured import MAX_REPETITION, MAX_SCHEMA_BYTES
from gateway.validation import chat_request, completion_request

MESSAGES = [{"role": "user", "content": "hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def chat(**fields):
    return chat_request({"model": "m", "messages": MESSAGES, **fields})


def json_schema(schema, **extra) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True, **extra}}


def test_response_formats_become_engine_constraints():
    assert chat(response_format={"type": "json_object"}).structured == {"json_object": True}
    assert chat(response_format={"type": "text"}).structured is None
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert chat(response_format=json_schema(schema)).structured == {"json": schema}


def test_tool_choice_auto_parses_what_the_model_emits_and_none_parses_nothing():
    request = chat(tools=[WEATHER, TIME])
    assert (request.tool_mode, request.structured) == ("auto", None)
    assert request.tools == [WEATHER, {"type": "function", "function": {"name": "get_time"}}]
    assert chat(tools=[WEATHER], tool_choice="none").tool_mode == ""


def test_a_named_tool_choice_constrains_the_output_to_its_arguments():
    request = chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert (request.tool_mode, request.tool_name) == ("named", "get_weather")
    assert request.structured == {"json": WEATHER["function"]["parameters"]}
    no_parameters = chat(tools=[TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert no_parameters.structured == {"json": {"type": "object", "properties": {}}}


def test_required_constrains_the_output_to_an_array_of_calls():
    schema = chat(tools=[WEATHER, TIME], tool_choice="required").structured["json"]
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [option["properties"]["name"]["enum"] for option in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    single = chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False).structured["json"]
    assert single["maxItems"] == 1


def test_tool_calls_and_results_in_the_history_reach_the_template():
    history = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    messages = chat_request({"model": "m", "messages": history, "tools": [WEATHER]}).messages
    assert messages[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
        ],
    }
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1", "name": "get_weather"}


def test_n_logprobs_and_logit_bias_are_parsed():
    request = chat(n=3, logprobs=True, top_logprobs=2, logit_bias={"17": -100, "5": 2.5})
    assert (request.n, request.logprobs) == (3, 2)
    assert request.sampling["logit_bias"] == {"17": -100.0, "5": 2.5}
    assert chat(logprobs=True).logprobs == 0 and chat(logprobs=False).logprobs is None
    assert completion_request({"model": "m", "prompt": "x", "logprobs": 3, "n": 2}).logprobs == 3


def _tool_with_string(name: str, length: int) -> dict:
    parameters = {"type": "object", "properties": {"s": {"type": "string", "maxLength": length}}}
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def test_string_length_bounds_are_summed_once_per_distinct_value():
    many = {f"p{i}": {"type": "string", "minLength": 1, "maxLength": 60} for i in range(50)}
    assert chat(response_format=json_schema({"type": "object", "properties": many})).structured
    assert chat(tools=[_tool_with_string("f", 40), _tool_with_string("g", 24)], tool_choice="required").structured


def _huge_schema() -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(MAX_SCHEMA_BYTES // 20)}}


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"response_format": {"type": "xml"}}, "response_format.type", "invalid_value"),
        ({"response_format": "json"}, "response_format", "invalid_type"),
        ({"response_format": json_schema({"type": "string", "maxLength": 65})}, "response_format", "invalid_value"),
        (
            # Each distinct length bound is compiled on its own: 40 + 41 > 64.
            {
                "response_format": json_schema(
                    {
                        "type": "object",
                        "properties": {
                            "a": {"type": "string", "maxLength": 40},
                            "b": {"type": "string", "maxLength": 41},
                        },
                    }
                )
            },
            "response_format",
            "invalid_value",
        ),
        (
            {"tools": [_tool_with_string("f", 40), _tool_with_string("g", 41)], "tool_choice": "required"},
            "tools",
            "invalid_value",
        ),
        ({"response_format": json_schema({"type": "nonsense"})}, "response_format", "invalid_value"),
        ({"response_format": json_schema({"type": "object", "required": "a"})}, "response_format", "invalid_value"),
        ({"response_format": json_schema(["not", "an", "object"])}, "response_format", "invalid_type"),
        ({"response_format": json_schema(_huge_schema())}, "response_format", "invalid_value"),
        (
            {"response_format": json_schema({"type": "array", "maxItems": MAX_REPETITION + 1})},
            "response_format",
            "invalid_value",
        ),
        (
            {"response_format": json_schema({"type": "string", "pattern": "a{1000}"})},
            "response_format",
            "invalid_value",
        ),
        (
            {"response_format": json_schema({"type": "string", "pattern": "(unclosed"})},
            "response_format",
            "invalid_value",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!"}}},
            "response_format",
            "invalid_value",
        ),
        ({"tools": []}, "tools", "invalid_value"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]", "invalid_value"),
        (
            {"tools": [{"type": "function", "function": {"name": "has space"}}]},
            "tools[0].function.name",
            "invalid_value",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools", "invalid_value"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
            "tools[0].function.parameters",
            "invalid_value",
        ),
        ({"tool_choice": "required"}, "tool_choice", "invalid_value"),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", "invalid_value"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "invalid_value",
        ),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "invalid_type"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "invalid_value",
        ),
        ({"n": 0}, "n", "invalid_value"),
        ({"n": 9}, "n", "invalid_value"),
        ({"n": 2.0}, "n", "invalid_value"),
        ({"logprobs": 1}, "logprobs", "invalid_type"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value"),
        ({"top_logprobs": 2}, "top_logprobs", "invalid_value"),
        ({"logit_bias": {"abc": 1}}, "logit_bias", "invalid_value"),
        ({"logit_bias": {"\u00b2": 1}}, "logit_bias", "invalid_value"),  # a digit to str.isdigit, not to int()
        ({"logit_bias": {"1": 101}}, "logit_bias", "invalid_value"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "invalid_value"),
        ({"functions": []}, "functions", "unsupported_parameter"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "invalid_value"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f"}}]}]},
            "messages[0].tool_calls[0]",
            "invalid_value",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "[1]"}}],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
            "invalid_value",
        ),
    ],
)
def test_invalid_fields_name_their_param(fields, param, code):
    with pytest.raises(InvalidRequest) as error:
        chat_request({"model": "m", "messages": MESSAGES, **fields})
    assert (error.value.param, error.value.code) == (param, code), str(error.value)


@pytest.mark.parametrize("logprobs", [6, -1, True, "2"])
def test_completion_logprobs_is_a_small_integer(logprobs):
    with pytest.raises(InvalidRequest) as error:
        completion_request({"model": "m", "prompt": "x", "logprobs": logprobs})
    assert error.value.param == "logprobs"
