"""End-to-end: a prompt sent twice is served from the engine's prefix cache the second time, and the
reply, the official openai client and the ledger say how many of its tokens were."""

import uuid

import openai
import pytest

from tests.e2e.stack import wait_usage_row

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

MODEL = "tiny-gemma4"


def test_a_repeated_prompt_reports_its_cached_tokens(tiny_stack, make_tenant):
    _, key = make_tenant("alice")
    client = openai.OpenAI(base_url=f"{tiny_stack.base_url}/v1", api_key=key, max_retries=0)
    # Several of the CPU engine's 128-token KV blocks long, and new to the engine's cache.
    prompt = f"{uuid.uuid4().hex} " + "the sea is wide and the wind is cold " * 40
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)

    assert first.usage.prompt_tokens == again.usage.prompt_tokens > 256
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.usage.prompt_tokens
    assert wait_usage_row(again.id).cached_tokens == cached
    assert wait_usage_row(first.id).cached_tokens == 0
