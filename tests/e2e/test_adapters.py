"""End-to-end: a tenant's LoRA adapter, uploaded through the management API, served by the real
engine through Celery, isolated from other tenants, routed to the worker that holds it, deleted and
unloaded."""

import httpx
import pytest
import redis

from contract import protocol
from tests.adapters.lora import lora_files
from tests.e2e.stack import wait_until, wait_usage_row

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

MODEL = "tiny-gemma4"
ADAPTER = f"{MODEL}:support-bot"
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def chat(stack, key: str, model: str) -> httpx.Response:
    body = {"model": model, "messages": MESSAGES, "max_tokens": 16, "temperature": 0}
    return httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, headers=_auth(key), timeout=120)


def upload(stack, admin_key: str, tenant: str) -> httpx.Response:
    config, weights = lora_files(seed=7)
    files = {"config": ("adapter_config.json", config), "weights": ("adapter_model.safetensors", weights)}
    return httpx.post(f"{stack.base_url}/api/v1/tenants/{tenant}/adapters/", data={"name": "support-bot",
                      "base_model": MODEL}, files=files, headers=_auth(admin_key), timeout=60)  # fmt: skip


def held_by_a_worker(stack, adapter_id: int) -> bool:
    client = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    try:
        records = protocol.fresh_workers(client, "tiny", since=0).values()
        return any(str(adapter_id) in (r.get("adapters") or "").split(",") for r in records)
    finally:
        client.close()


def test_an_uploaded_adapter_changes_the_output_for_its_tenant_only_until_deleted(tiny_stack, make_tenant):
    stack = tiny_stack
    alice, alice_admin = make_tenant("alice", is_admin=True)
    from tenants.services import apikey_create

    _, alice_key = apikey_create(tenant=alice, name="app")
    _, bob_key = make_tenant("bob")

    created = upload(stack, alice_admin, "alice")
    assert created.status_code == 201, created.text
    assert created.json()["id"] == ADAPTER

    base = chat(stack, alice_key, MODEL)
    tuned = chat(stack, alice_key, ADAPTER)
    assert base.status_code == 200 and tuned.status_code == 200, (base.text, tuned.text)
    base_text, tuned_text = (r.json()["choices"][0]["message"]["content"] for r in (base, tuned))
    assert tuned.json()["model"] == ADAPTER
    assert tuned_text != base_text  # same greedy prompt, the adapter's weights change the output
    row = wait_usage_row(tuned.json()["id"])
    assert row.model == ADAPTER and row.completion_tokens == tuned.json()["usage"]["completion_tokens"]

    # The worker advertises the adapter it loaded; the next request goes to its own queue and is the same.
    from adapters.models import Adapter

    adapter_id = Adapter.objects.get(tenant=alice, name="support-bot").pk
    wait_until(lambda: held_by_a_worker(stack, adapter_id), "the worker advertises the adapter", timeout=60)
    again = chat(stack, alice_key, ADAPTER)
    assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"] == tuned_text

    # bob neither sees nor calls it: exactly an unknown model.
    hidden = chat(stack, bob_key, ADAPTER)
    assert hidden.status_code == 404 and hidden.json()["error"]["code"] == "model_not_found"
    listed = httpx.get(f"{stack.base_url}/v1/models", headers=_auth(bob_key), timeout=30).json()
    assert ADAPTER not in [m["id"] for m in listed["data"]]
    assert ADAPTER in [m["id"] for m in httpx.get(f"{stack.base_url}/v1/models", headers=_auth(alice_key),
                                                  timeout=30).json()["data"]]  # fmt: skip

    deleted = httpx.delete(f"{stack.base_url}/api/v1/tenants/alice/adapters/{ADAPTER}/", headers=_auth(alice_admin),
                           timeout=30)  # fmt: skip
    assert deleted.status_code == 204
    gone = chat(stack, alice_key, ADAPTER)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    # The worker unloads it from its engine (vLLM's remove_lora) and its heartbeat stops listing it.
    wait_until(lambda: not held_by_a_worker(stack, adapter_id), "the worker stops listing the adapter", timeout=60)
