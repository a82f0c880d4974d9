"""End-to-end with the official openai client, unchanged: structured outputs, tool calling (plain and
streamed), logprobs and n > 1, through gunicorn → Redis → Celery worker → vLLM (tiny random model).

A random model never writes JSON or a tool call by itself: the engine's structured outputs constrain
it (response_format, and tool_choice "required" or a named function), which is what these tests
rely on. Usage is checked against the ledger row the worker's counts produced."""

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.stack import wait_usage_row

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

MODEL = "tiny-gemma4"
QUESTION = [{"role": "user", "content": "What is the weather in Oslo?"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


class Forecast(BaseModel):
    city: str = Field(max_length=12)
    unit: Literal["celsius", "fahrenheit"]
    sunny: bool


@pytest.fixture
def client(tiny_stack, make_tenant):
    _, key = make_tenant("alice")
    with openai.OpenAI(base_url=f"{tiny_stack.base_url}/v1", api_key=key, max_retries=0, timeout=120) as client:
        yield client


def assert_ledger_matches(request_id: str, usage) -> None:
    row = wait_usage_row(request_id)
    assert (row.prompt_tokens, row.completion_tokens) == (usage.prompt_tokens, usage.completion_tokens)
    assert row.status == "ok"


def prompt_tokens(model_dir, messages, tools=None) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return len(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                             return_dict=False))  # fmt: skip


def test_parse_returns_an_object_of_the_pydantic_model(client):
    completion = client.chat.completions.parse(
        model=MODEL, messages=QUESTION, response_format=Forecast, max_completion_tokens=200, temperature=0
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, Forecast)
    assert Forecast.model_validate_json(choice.message.content) == choice.message.parsed
    assert_ledger_matches(completion.id, completion.usage)


def test_json_object_mode_starts_a_json_object_and_a_bad_schema_is_a_400(client):
    completion = client.chat.completions.create(
        model=MODEL, messages=QUESTION, response_format={"type": "json_object"}, max_completion_tokens=8
    )
    assert completion.choices[0].message.content.startswith("{")
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_completion_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        )  # fmt: skip
    assert error.value.body["param"] == "response_format"


def test_a_tool_calling_round_trip(client, tiny_stack):
    first = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=[WEATHER_TOOL], tool_choice="required", parallel_tool_calls=False,
        max_completion_tokens=200, temperature=0,
    )  # fmt: skip
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in {"celsius", "fahrenheit"}
    # The tool definitions are part of the prompt, counted and billed.
    assert first.usage.prompt_tokens == prompt_tokens(tiny_stack.model_dir, QUESTION, [WEATHER_TOOL])
    assert first.usage.prompt_tokens > prompt_tokens(tiny_stack.model_dir, QUESTION)
    assert_ledger_matches(first.id, first.usage)

    history = [*QUESTION, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees."}]  # fmt: skip
    answer = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER_TOOL], tool_choice="none", max_completion_tokens=16,
        temperature=0,
    )  # fmt: skip
    assert answer.choices[0].finish_reason in {"stop", "length"}
    assert answer.choices[0].message.tool_calls is None and isinstance(answer.choices[0].message.content, str)
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result are in the prompt
    assert_ledger_matches(answer.id, answer.usage)


def test_with_tool_choice_auto_a_reply_without_a_call_is_plain_content(client):
    """tool_choice "auto" lets the model decide; the random model never writes Gemma 4's call syntax."""
    reply = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=[WEATHER_TOOL], max_completion_tokens=12, temperature=0
    )
    choice = reply.choices[0]
    assert choice.finish_reason in {"stop", "length"} and choice.message.tool_calls is None
    assert isinstance(choice.message.content, str)
    assert_ledger_matches(reply.id, reply.usage)


def test_a_streamed_tool_call_arrives_in_openais_chunk_shape(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    request = dict(model=MODEL, messages=QUESTION, tools=[WEATHER_TOOL], tool_choice=named, max_completion_tokens=200,
                   temperature=0)  # fmt: skip
    whole = client.chat.completions.create(**request)
    stream = client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True})
    calls: dict[int, dict] = {}
    finish_reasons, usage, chunk_id, content = [], None, None, ""
    for chunk in stream:
        chunk_id = chunk.id
        usage = chunk.usage or usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                if delta.id:
                    assert call["id"] is None and delta.type == "function"
                    call["id"], call["name"] = delta.id, delta.function.name
                call["arguments"] += delta.function.arguments or ""
            if choice.finish_reason:
                finish_reasons.append(choice.finish_reason)
    assert content == "" and finish_reasons == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls
    ]
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert_ledger_matches(chunk_id, usage)


def test_logprobs_are_consistent_with_the_text(client):
    completion = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_completion_tokens=12, temperature=0, logprobs=True, top_logprobs=3
    )
    choice = completion.choices[0]
    tokens = choice.logprobs.content
    assert len(tokens) == completion.usage.completion_tokens
    for token in tokens:
        assert token.logprob <= 0 and len(token.top_logprobs) == 3
        assert bytes(token.bytes) == token.token.encode()
        # Greedy decoding picks the most likely token.
        assert token.top_logprobs[0].token == token.token and token.top_logprobs[0].logprob == token.logprob
    # A token that is only part of a character (a random model emits such byte tokens) has no text of
    # its own (vLLM decodes tokens one by one); the text shows the character's replacement instead.
    assert "".join(t.token for t in tokens) == choice.message.content.replace("\ufffd", "")

    streamed = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_completion_tokens=12, temperature=0, logprobs=True, top_logprobs=3,
        stream=True,
    )  # fmt: skip
    streamed_tokens = [t for chunk in streamed for c in chunk.choices if c.logprobs for t in c.logprobs.content]
    assert [(t.token, t.logprob) for t in streamed_tokens] == [(t.token, t.logprob) for t in tokens]

    legacy = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=6, temperature=0, logprobs=2)
    logprobs = legacy.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == legacy.usage.completion_tokens
    assert "".join(logprobs.tokens) == legacy.choices[0].text.replace("\ufffd", "")
    assert all(len(top) == 2 for top in logprobs.top_logprobs)


def test_n_3_returns_three_choices_billed_together(client):
    completion = client.chat.completions.create(
        model=MODEL, messages=QUESTION, n=3, max_completion_tokens=8, temperature=1.0, seed=11,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" and c.message.content for c in completion.choices)
    assert completion.usage.completion_tokens == 3 * 8
    assert_ledger_matches(completion.id, completion.usage)

    stream = client.chat.completions.create(
        model=MODEL, messages=QUESTION, n=3, max_completion_tokens=8, temperature=1.0, seed=11, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    texts, finished, usage, chunk_id = {0: "", 1: "", 2: ""}, set(), None, None
    for chunk in stream:
        chunk_id, usage = chunk.id, chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1, 2} and all(texts.values())
    assert usage.completion_tokens == 3 * 8
    assert_ledger_matches(chunk_id, usage)


def test_n_reserves_max_tokens_for_every_choice(client, make_tenant, tiny_stack):
    from quotas.services import tenant_quota_set

    tenant, key = make_tenant("bob")
    tenant_quota_set(tenant=tenant, output_tpm=100)
    bob = openai.OpenAI(base_url=f"{tiny_stack.base_url}/v1", api_key=key, max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError) as error:
        bob.chat.completions.create(model=MODEL, messages=QUESTION, n=3, max_completion_tokens=40)
    assert (error.value.body["code"], error.value.body["param"]) == ("exceeds_limit", "max_tokens")
    fits = bob.chat.completions.create(model=MODEL, messages=QUESTION, n=2, max_completion_tokens=40)
    assert len(fits.choices) == 2
    assert_ledger_matches(fits.id, fits.usage)


def test_models_say_what_each_model_supports(client):
    [model] = client.models.list().data
    extra = model.model_dump()
    assert extra["context_length"] == 2048
    assert extra["architecture"] == {"input_modalities": ["text"], "output_modalities": ["text"]}
    assert {"tools", "tool_choice", "response_format", "logprobs", "n"} <= set(extra["supported_parameters"])
    assert client.models.retrieve(MODEL).model_dump()["context_length"] == 2048
