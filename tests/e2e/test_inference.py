"""End-to-end: HTTP and the openai client → gunicorn → Redis → Celery worker → vLLM (tiny model, CPU)."""

import concurrent.futures
import json
import time

import httpx
import openai
import pytest

from tests.e2e.stack import disconnect_mid_stream, engine_paused, requests_in_flight, wait_usage_row
from tests.workers.engine_stream import open_stream

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

MODEL = "tiny-gemma4"
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture
def stack(tiny_stack):
    return tiny_stack


@pytest.fixture
def alice(stack, make_tenant):
    return make_tenant("alice")


@pytest.fixture
def reference_engine(tiny_model_dir):
    """A second, independent engine on the same model: what the engine itself generates.

    Function-scoped on purpose: an idle vLLM CPU engine still holds CPU threads, which would slow
    down the other tests on a 2-core machine."""
    from workers.engine import EngineHost

    engine = EngineHost(str(tiny_model_dir), profile="cpu")
    engine.start()
    yield engine
    engine.shutdown()


def engine_text(engine, prompt_ids: list[int], max_tokens: int) -> tuple[str, int]:
    params = {"temperature": 0.0, "max_tokens": max_tokens}
    chunks = list(open_stream(engine, "ref-" + str(time.monotonic_ns()), prompt_ids, params))
    return "".join(c.text for c in chunks), sum(c.token_count for c in chunks)


def chat_prompt_ids(model_dir) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return list(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False))


def post(stack, key: str, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(
        f"{stack.base_url}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120, **kwargs
    )


def sse_events(response: httpx.Response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_a_greedy_chat_completion_equals_what_the_engine_generates(stack, alice, reference_engine):
    _, key = alice
    reply = post(
        stack, key, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 24, "temperature": 0}
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    expected_text, expected_tokens = engine_text(reference_engine, chat_prompt_ids(stack.model_dir), 24)
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": expected_text, "refusal": None}
    assert body["usage"]["completion_tokens"] == expected_tokens
    assert body["usage"]["prompt_tokens"] == len(chat_prompt_ids(stack.model_dir))


def test_streamed_chunks_concatenate_to_the_non_streamed_text(stack, alice):
    _, key = alice
    request = {"model": MODEL, "messages": MESSAGES, "max_tokens": 32, "temperature": 0}
    whole = post(stack, key, "/v1/chat/completions", request).json()
    with httpx.stream(
        "POST",
        f"{stack.base_url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json=dict(request, stream=True, stream_options={"include_usage": True}),
        timeout=120,
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert chunks[-2]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


def test_the_usage_row_matches_the_engine_token_counts(stack, alice):
    tenant, key = alice
    reply = post(
        stack,
        key,
        "/v1/completions",
        {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 20, "temperature": 0, "ignore_eos": True},
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    row = wait_usage_row(body["id"])
    assert row.tenant_id == tenant.id
    assert (row.prompt_tokens, row.completion_tokens) == (body["usage"]["prompt_tokens"], 20)
    assert row.finish_reason == "length" and row.status == "ok"
    assert row.ttft_ms is not None and row.total_ms >= row.ttft_ms


def test_usage_is_recorded_for_a_stream_that_did_not_ask_for_it(stack, alice):
    _, key = alice
    with httpx.stream(
        "POST",
        f"{stack.base_url}/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": MODEL, "prompt": "Hello", "max_tokens": 8, "stream": True, "ignore_eos": True},
        timeout=120,
    ) as response:
        events = sse_events(response)
    assert all("usage" not in e for e in events if isinstance(e, dict))
    row = wait_usage_row(events[0]["id"])
    assert row.completion_tokens == 8


def test_the_openai_client_works_unchanged(stack, alice):
    _, key = alice
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=key, max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=16, temperature=0, seed=1
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 16
    streamed = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_completion_tokens=16,
        temperature=0,
        seed=1,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage = [], None
    for chunk in streamed:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert "".join(parts) == chat.choices[0].message.content
    assert usage.completion_tokens == chat.usage.completion_tokens
    completion = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=5, temperature=0)
    assert completion.choices[0].finish_reason in {"stop", "length"}
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, n=9)
    assert error.value.body["param"] == "n"


def test_a_revoked_key_is_refused_at_once(stack, alice):
    _, key = alice
    assert httpx.get(f"{stack.base_url}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    stack.manage("revokekey", key)
    reply = httpx.get(f"{stack.base_url}/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert reply.status_code == 401
    assert reply.json()["error"]["code"] == "invalid_api_key"


def test_alices_key_never_reaches_bobs_data(stack, make_tenant):
    from ledger.models import UsageRecord

    alice, alice_key = make_tenant("alice")
    bob, bob_key = make_tenant("bob", allowed_models=["some-other-model"])
    reply = post(stack, alice_key, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 4})
    assert reply.status_code == 200
    row = wait_usage_row(reply.json()["id"])
    assert row.tenant_id == alice.id and row.tenant_id != bob.id
    # Bob's key is limited to another model: ours is invisible to him, exactly like a missing one.
    assert httpx.get(f"{stack.base_url}/v1/models", headers={"Authorization": f"Bearer {bob_key}"}).json()["data"] == []
    refused = post(stack, bob_key, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 4})
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"
    assert not UsageRecord.objects.filter(tenant=bob).exists()


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"messages": MESSAGES}, 400, "model"),
        ({"model": MODEL}, 400, "messages"),
        ({"model": MODEL, "messages": MESSAGES, "temperature": 3}, 400, "temperature"),
        ({"model": MODEL, "messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "messages": MESSAGES, "max_tokens": 5000}, 400, "max_tokens"),
        ({"model": MODEL, "messages": MESSAGES, "tools": []}, 400, "tools"),
        ({"model": MODEL, "messages": MESSAGES, "bogus": 1}, 400, "bogus"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
        ({"model": MODEL, "messages": MESSAGES, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({"model": MODEL, "messages": MESSAGES, "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ({"model": "unknown", "messages": MESSAGES}, 404, "model"),
    ],
)
def test_bad_input_gets_a_precise_openai_error(stack, alice, body, status, param):
    _, key = alice
    reply = post(stack, key, "/v1/chat/completions", body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]


def test_authentication_body_and_size_errors(stack, alice):
    _, key = alice
    url = f"{stack.base_url}/v1/chat/completions"
    assert httpx.post(url, json={}).status_code == 401
    assert httpx.post(url, json={}, headers={"Authorization": "Bearer gpk_nope"}).status_code == 401
    not_json = httpx.post(url, content=b"{not json", headers={"Authorization": f"Bearer {key}"})
    assert not_json.status_code == 400 and not_json.json()["error"]["code"] == "invalid_json"
    huge = httpx.post(url, content=b"x" * (2 * 1024 * 1024), headers={"Authorization": f"Bearer {key}"})
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "payload_too_large"
    wrong_method = httpx.get(url, headers={"Authorization": f"Bearer {key}"})
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()
    assert httpx.get(f"{stack.base_url}/v1/nothing-here").status_code == 404


def test_a_model_without_workers_gets_503(stack, alice):
    _, key = alice
    stack.register_model("orphan", pool="nobody")
    reply = post(stack, key, "/v1/completions", {"model": "orphan", "prompt": "Hi", "max_tokens": 4})
    assert reply.status_code == 503
    assert reply.json()["error"]["code"] == "no_worker_available" and reply.headers["retry-after"]


def test_health_and_readiness(stack):
    assert httpx.get(f"{stack.base_url}/healthz").json() == {"status": "ok"}
    ready = httpx.get(f"{stack.base_url}/readyz")
    assert ready.status_code == 200 and ready.json()["not_ready"] == []


def test_a_client_disconnect_aborts_the_request_and_bills_what_was_generated(stack, alice):
    _, key = alice
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Go on"}], "max_tokens": 1500,
            "ignore_eos": True}  # fmt: skip
    request_id = disconnect_mid_stream(stack, key, body)["x-request-id"]
    row = wait_usage_row(request_id, timeout=30)
    assert row.status == "cancelled" and row.finish_reason == "abort"
    assert 0 < row.completion_tokens < 1500


def _first_and_last_token_at(row) -> tuple[float, float]:
    """When the worker got a request's first token and its last (unix time), from its ledger row:
    the worker starts it at admission + queue_ms, gets its first token ttft_ms later, and finishes it
    at finished_at (= admission + total_ms)."""
    finished = row.finished_at.timestamp()
    started = finished - (row.total_ms - row.queue_ms) / 1000
    return started + row.ttft_ms / 1000, finished


def test_32_concurrent_requests_are_generated_together_by_one_engine(stack, alice):
    """Continuous batching, checked by cause rather than by the clock.

    The engine is paused (SIGSTOP) while 32 streamed requests are sent, until the worker reports all
    32 running at once, then resumed. From the ledger rows (times the worker recorded), every request
    must have had its first token before any request had its last: the one engine generated all 32
    together. A pool that ran one request at a time would never report 32 in flight, and an engine
    that served them one after another would start the second only after the first had ended.
    Pausing the engine keeps the check independent of how fast the machine admits 32 requests (a
    2-core CI machine stalls for seconds under load). The speed-up this batching gives is measured,
    not asserted: ``make bench-batching`` (README).
    """
    _, key = alice
    streams, max_tokens = 32, 256
    body = {"model": MODEL, "prompt": "Count with me", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    client = httpx.Client(
        base_url=stack.base_url,
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
        limits=httpx.Limits(max_connections=streams, max_keepalive_connections=streams),
    )

    def one_stream():
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200, response.read()
            chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
        return chunks[0]["id"]

    most_in_flight = 0
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        with engine_paused(stack):
            futures = [pool.submit(one_stream) for _ in range(streams)]
            deadline = time.monotonic() + 60
            while most_in_flight < streams and time.monotonic() < deadline:
                time.sleep(0.5)
                most_in_flight = max(most_in_flight, requests_in_flight(stack))
        request_ids = [future.result() for future in futures]
    client.close()
    assert most_in_flight == streams, f"the worker ran at most {most_in_flight} of {streams} requests at once"

    rows = [wait_usage_row(request_id, timeout=60) for request_id in request_ids]
    assert [(row.status, row.completion_tokens) for row in rows] == [("ok", max_tokens)] * streams
    spans = [_first_and_last_token_at(row) for row in rows]
    last_first_token, first_end = max(first for first, _ in spans), min(end for _, end in spans)
    print(f"\n{streams} requests: the first to end ended {first_end - last_first_token:+.2f} s after the last began")
    assert last_first_token < first_end, "a request ended before another had its first token"
