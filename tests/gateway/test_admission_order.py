"""Admission before expensive work: a refused request costs no tokenization and is never counted as
demand for its pool; a request that can never fit is a 400 naming what to shrink, one that fits once
its window frees up a 429 with Retry-After; one access rule for the model listing and inference.

The gateway runs for real (views, catalog, quota scripts on Redis, the tiny model's tokenizer); the
tokenizing steps are wrapped to record their calls, and no worker serves the pool."""

import json
import uuid

import pytest
from django.test import Client

from catalog import selectors
from catalog.models import ServedModel
from contract.protocol import pool_waiting_key
from gateway import dispatch, tokenization
from quotas.admission import quota_admit
from quotas.limits import limits_for
from quotas.services import key_quota_set, plan_create, tenant_quota_set

# The views run on gateway threads, with connections of their own: the test data must be committed.
pytestmark = pytest.mark.django_db(transaction=True)

MODEL, OTHER_MODEL, POOL = "tiny-gemma4", "other-gemma", "tiny"
SHORT = [{"role": "user", "content": "hello world how are you"}]


@pytest.fixture(autouse=True)
def empty_catalog_snapshot(monkeypatch):
    monkeypatch.setattr(selectors, "_cache", {"at": float("-inf"), "models": {}})


@pytest.fixture
def model(tiny_model_dir):
    # A pool scaling from zero: a request that reaches the wait for a worker counts in pool:<pool>:waiting.
    return ServedModel.objects.create(
        model_id=MODEL, path=str(tiny_model_dir), pool=POOL, context_length=2048, cold_start_wait_seconds=1
    )


@pytest.fixture
def tokenizer_calls(monkeypatch):
    """Every call of the steps that tokenize a prompt; they still tokenize."""
    calls = []
    for name in ("chat_prompt_ids", "completion_prompt_ids"):
        real = getattr(tokenization, name)

        def recording(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(tokenization, name, recording)
    return calls


@pytest.fixture
def a_ready_worker(monkeypatch):
    """The pool has a ready worker, so a request that gets past the checks reaches the reservation."""
    monkeypatch.setattr(dispatch, "await_worker", lambda model: {"test-worker": 0})


@pytest.fixture
def alice(make_tenant, redis_client, model):
    tenant, key = make_tenant("alice")
    return tenant, key


def _post(key: str, path: str, body: dict):
    return Client().post(path, json.dumps(body), content_type="application/json", headers=_auth(key))


def _get(key: str, path: str):
    return Client().get(path, headers=_auth(key))


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _chat(key: str, messages=SHORT, **fields):
    return _post(key, "/v1/chat/completions", {"model": MODEL, "messages": messages, **fields})


def _hold_a_reservation(tenant, *, prompt_tokens=1, max_tokens=1):
    key_id = tenant.api_keys.get().id
    limits = limits_for(tenant_id=tenant.id, key_id=key_id)
    quota_admit(request_id=f"chatcmpl-{uuid.uuid4().hex}", tenant_id=tenant.id, key_id=key_id, limits=limits,
                prompt_tokens=prompt_tokens, max_tokens=max_tokens, implicit_max_tokens=False)  # fmt: skip


# 1. Refusals come before tokenizing and before waiting for a worker.


def test_a_tenant_at_its_concurrency_limit_is_refused_before_tokenizing_or_counting_as_pool_demand(
    alice, redis_client, tokenizer_calls
):
    tenant, key = alice
    tenant_quota_set(tenant=tenant, concurrency=1)
    _hold_a_reservation(tenant)

    reply = _chat(key, max_tokens=4)

    assert tokenizer_calls == []
    assert not redis_client.exists(pool_waiting_key(POOL))
    assert reply.status_code == 429, reply.content
    assert reply["Retry-After"] == "1" and reply["x-ratelimit-exceeded"] == "concurrency"


def test_a_prompt_far_over_the_input_tpm_is_refused_before_tokenizing(alice, redis_client, tokenizer_calls):
    tenant, key = alice
    tenant_quota_set(tenant=tenant, input_tpm=20)
    huge = [{"role": "user", "content": "word " * 400}]  # 2,000 characters: far more than 20 tokens

    reply = _chat(key, messages=huge, max_tokens=4)

    assert tokenizer_calls == []
    assert not redis_client.exists(pool_waiting_key(POOL))
    assert reply.status_code == 400, reply.content
    error = reply.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "messages", "exceeds_limit")
    assert "at least" in error["message"] and "Retry-After" not in reply


def test_a_prompt_far_over_the_context_length_is_refused_before_tokenizing(alice, redis_client, tokenizer_calls):
    _, key = alice
    huge = [{"role": "user", "content": "word " * 8000}]  # 40,000 characters: more than 2,048 tokens

    reply = _chat(key, messages=huge)

    assert tokenizer_calls == []
    assert reply.status_code == 400, reply.content
    error = reply.json()["error"]
    assert (error["param"], error["code"]) == ("messages", "context_length_exceeded")
    assert "the prompt has at least" in error["message"]


def test_a_prompt_over_the_window_left_is_refused_after_tokenizing_but_before_waiting_for_a_worker(
    alice, redis_client, tokenizer_calls, clock
):
    tenant, key = alice
    clock.to_window_start(redis_client)
    tenant_quota_set(tenant=tenant, input_tpm=30)
    _hold_a_reservation(tenant, prompt_tokens=25)  # 5 prompt tokens left in this minute

    reply = _chat(key, max_tokens=4)  # about 18 tokens once templated: only the exact count tells

    assert tokenizer_calls == ["chat_prompt_ids"]
    assert not redis_client.exists(pool_waiting_key(POOL))
    assert reply.status_code == 429, reply.content
    assert reply["x-ratelimit-exceeded"] == "input_tokens" and int(reply["Retry-After"]) >= 1


def test_the_prompt_bound_never_exceeds_the_exact_count(model):
    texts = ["", "a", "hello world how are you", "word " * 400, "Ünïcödé ✓ 日本語 " * 30, "x" * 999, " \n\t " * 50]
    for text in texts:
        messages = [{"role": "system", "content": text}, {"role": "user", "content": text + "?"}]
        exact = len(tokenization.chat_prompt_ids(model.path, messages))
        assert tokenization.prompt_tokens_at_least(model.path, messages=messages, prompt=None) <= exact
        exact = len(tokenization.completion_prompt_ids(model.path, text or "."))
        assert tokenization.prompt_tokens_at_least(model.path, messages=None, prompt=text or ".") <= exact


# 2. A request that can never fit is a 400 naming what to shrink; one that fits later is a 429.


def test_an_explicit_max_tokens_over_the_output_tpm_is_a_400_naming_max_tokens(alice, a_ready_worker):
    tenant, key = alice
    tenant_quota_set(tenant=tenant, output_tpm=100)

    reply = _chat(key, max_tokens=101)

    assert reply.status_code == 400, reply.content
    error = reply.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "max_tokens", "exceeds_limit")
    assert "Retry-After" not in reply


def test_a_key_limit_that_can_never_fit_is_a_400_too(alice, a_ready_worker):
    tenant, key = alice
    key_quota_set(api_key=tenant.api_keys.get(), budget_tokens=50)

    reply = _chat(key, max_tokens=60)

    assert reply.status_code == 400, reply.content
    assert reply.json()["error"]["param"] == "max_tokens" and "Retry-After" not in reply


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": SHORT}, "messages"),
        ("/v1/completions", {"prompt": "hello world how are you doing today my friend, tell me"}, "prompt"),
    ],
)
def test_a_prompt_that_can_never_fit_the_input_tpm_is_a_400_naming_the_prompt(
    alice, a_ready_worker, redis_client, path, body, param
):
    tenant, key = alice
    tenant_quota_set(tenant=tenant, input_tpm=8)  # the prompts are short, but more than 8 tokens

    reply = _post(key, path, {"model": MODEL, "max_tokens": 2, **body})

    assert reply.status_code == 400, reply.content
    error = reply.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, "exceeds_limit")
    assert "Retry-After" not in reply
    assert not redis_client.exists(pool_waiting_key(POOL))


def test_a_request_that_fits_once_the_window_frees_up_is_a_429_with_retry_after(
    alice, a_ready_worker, redis_client, clock
):
    tenant, key = alice
    clock.to_window_start(redis_client)
    tenant_quota_set(tenant=tenant, output_tpm=10)
    _hold_a_reservation(tenant, max_tokens=8)

    reply = _chat(key, max_tokens=5)

    assert reply.status_code == 429, reply.content
    error = reply.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("rate_limit_error", None, "rate_limit_exceeded")
    assert 1 <= int(reply["Retry-After"]) <= 60 and reply["x-ratelimit-exceeded"] == "output_tokens"


# 3. One access rule: the listing shows exactly the models inference serves.


@pytest.fixture
def other_model(tiny_model_dir):
    return ServedModel.objects.create(model_id=OTHER_MODEL, path=str(tiny_model_dir), pool="other", context_length=2048)


def _listed(key: str) -> list[str]:
    reply = _get(key, "/v1/models")
    assert reply.status_code == 200, reply.content
    return [m["id"] for m in reply.json()["data"]]


def test_a_model_the_plan_forbids_is_neither_listed_nor_served(make_tenant, redis_client, model, other_model):
    alice, alice_key = make_tenant("alice")
    tenant_quota_set(tenant=alice, plan=plan_create(name="small", allowed_models=[OTHER_MODEL]))
    _, bob_key = make_tenant("bob")  # no plan: every model

    assert _listed(alice_key) == [OTHER_MODEL]
    assert _listed(bob_key) == [OTHER_MODEL, MODEL]
    forbidden = _chat(alice_key, max_tokens=2)
    unknown = _post(alice_key, "/v1/chat/completions", {"model": "no-such-model", "messages": SHORT})
    detail = _get(alice_key, f"/v1/models/{MODEL}")
    for reply in (forbidden, unknown, detail):
        assert reply.status_code == 404, reply.content
        error = reply.json()["error"]
        assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "model", "model_not_found")


def test_the_keys_models_and_the_plans_models_both_apply(make_tenant, redis_client, model, other_model):
    _, key_only = make_tenant("alice", allowed_models=[OTHER_MODEL])
    charlie, key_and_plan = make_tenant("charlie", allowed_models=[MODEL])
    tenant_quota_set(tenant=charlie, plan=plan_create(name="other-only", allowed_models=[OTHER_MODEL]))

    assert _listed(key_only) == [OTHER_MODEL]
    assert _chat(key_only, max_tokens=2).status_code == 404
    assert _listed(key_and_plan) == []
    assert _chat(key_and_plan, max_tokens=2).status_code == 404
