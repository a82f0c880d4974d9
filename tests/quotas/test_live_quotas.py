"""Quotas through the real inference path: gunicorn → admission (Redis Lua) → Celery worker → vLLM → ledger.

Operators' limits are set with the `setquota` management command, as a script would.
"""

import concurrent.futures
import time

import httpx
import pytest
import redis

from tests.e2e.stack import disconnect_mid_stream, wait_usage_row
from tests.quotas.helpers import billed_tokens, wait_for_window_room

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

MODEL = "tiny-gemma4"
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture
def stack(tiny_stack):
    return tiny_stack


def _chat(stack, key, **extra):
    body = {"model": MODEL, "messages": MESSAGES, "ignore_eos": True, **extra}
    return httpx.post(f"{stack.base_url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, json=body,
                      timeout=120)  # fmt: skip


def test_a_budget_caps_an_open_request_settles_to_actual_usage_then_refuses(stack, make_tenant):
    from core.periods import Period

    tenant, key = make_tenant("alice")
    client = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    first = _chat(stack, key, max_tokens=4)
    assert first.status_code == 200, first.text
    prompt = first.json()["usage"]["prompt_tokens"]
    used = wait_usage_row(first.headers["x-request-id"])
    spent = used.prompt_tokens + used.completion_tokens
    budget = spent + prompt + 20
    stack.manage("setquota", "alice", "--budget-tokens", str(budget), "--rpm", "1000")

    # No max_tokens: the gateway would reserve the whole context (2048); it is capped by the budget left.
    capped = _chat(stack, key)
    assert capped.status_code == 200, capped.text
    assert capped.json()["usage"]["completion_tokens"] == 20
    assert capped.headers["x-ratelimit-limit-budget-tokens"] == str(budget)
    assert capped.headers["x-ratelimit-remaining-budget-tokens"] == "0"
    assert capped.headers["x-ratelimit-limit-requests"] == "1000"
    assert capped.headers["x-ratelimit-remaining-requests"].isdigit()
    row = wait_usage_row(capped.headers["x-request-id"])
    counter = f"q:t:{tenant.id}:bud:{Period.current().id}"
    assert int(client.get(counter)) == spent + row.prompt_tokens + row.completion_tokens  # settled to actual
    assert not client.exists(f"resv:{row.request_id}")

    inputs_before = len(client.keys("req:*:in"))
    refused = _chat(stack, key, max_tokens=4)
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert (
        error["code"] == "insufficient_quota" and error["type"] == "rate_limit_error" and "budget" in error["message"]
    )
    assert refused.headers["x-ratelimit-exceeded"] == "budget_tokens"
    assert int(refused.headers["Retry-After"]) > 0
    assert len(client.keys("req:*:in")) == inputs_before  # never enqueued


def test_an_rpm_limit_answers_429_with_openai_headers(stack, make_tenant):
    _, key = make_tenant("bob")
    stack.manage("setquota", "bob", "--rpm", "2")
    wait_for_window_room(redis.Redis.from_url(stack.redis_url, decode_responses=True), 20)

    replies = [_chat(stack, key, max_tokens=2) for _ in range(3)]

    assert [r.status_code for r in replies] == [200, 200, 429]
    assert replies[1].headers["x-ratelimit-remaining-requests"] == "0"
    refused = replies[2]
    assert refused.headers["x-ratelimit-limit-requests"] == "2"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.headers["x-ratelimit-reset-requests"].endswith("s")
    assert 1 <= int(refused.headers["Retry-After"]) <= 60
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert "requests per minute" in refused.json()["error"]["message"]


def test_200_concurrent_requests_never_overrun_a_budget_covering_about_50(stack, make_tenant):

    tenant, key = make_tenant("charlie")
    probe = _chat(stack, key, max_tokens=8)
    per_request = probe.json()["usage"]["prompt_tokens"] + 8
    wait_usage_row(probe.headers["x-request-id"])
    spent = billed_tokens(tenant)
    budget = spent + 50 * per_request + per_request // 2
    stack.manage("setquota", "charlie", "--budget-tokens", str(budget))

    with concurrent.futures.ThreadPoolExecutor(200) as pool:
        replies = list(pool.map(lambda _: _chat(stack, key, max_tokens=8), range(200)))
    ok = [r for r in replies if r.status_code == 200]
    refused = [r for r in replies if r.status_code == 429]
    for reply in ok:
        wait_usage_row(reply.headers["x-request-id"])

    billed = billed_tokens(tenant)
    overrun = max(0, billed - budget)
    print(f"\nlive: budget={budget} ok={len(ok)} refused={len(refused)} billed={billed} overrun={overrun}")
    assert overrun == 0
    assert len(ok) + len(refused) == 200
    assert 45 <= len(ok) <= 60 and len(refused) >= 140
    assert all(r.json()["error"]["code"] == "insufficient_quota" for r in refused)


def test_a_client_that_disconnects_is_settled_to_what_was_generated(stack, make_tenant):
    from core.periods import Period

    tenant, key = make_tenant("dave")
    stack.manage("setquota", "dave", "--budget-tokens", "100000", "--concurrency", "1")
    client = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1500, "ignore_eos": True}
    headers = disconnect_mid_stream(stack, key, body)
    request_id = headers["x-request-id"]
    assert headers["x-ratelimit-remaining-concurrency"] == "0"  # it held dave's one slot

    row = wait_usage_row(request_id, timeout=30)  # the worker reports what it generated; the flush settles it
    assert row.status == "cancelled" and 0 < row.completion_tokens < 1500
    deadline = time.monotonic() + 10
    while client.exists(f"resv:{request_id}") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not client.exists(f"resv:{request_id}")
    assert int(client.get(f"q:t:{tenant.id}:bud:{Period.current().id}")) == billed_tokens(tenant)
    # The concurrency slot came back with the settle: the next request is admitted.
    assert _chat(stack, key, max_tokens=2).status_code == 200
