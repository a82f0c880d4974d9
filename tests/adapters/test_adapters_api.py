"""Uploading, listing and deleting LoRA adapters through the management API, and who sees them."""

import base64
import io
import json

import pytest
import torch

from adapters.models import Adapter
from tests.adapters.conftest import BASE, stored_files
from tests.adapters.lora import TINY_SHAPES, lora_files

pytestmark = pytest.mark.django_db

URL = "/api/v1/tenants/{tenant}/adapters/"


def _auth(key: str) -> dict:
    return {"HTTP_AUTHORIZATION": f"Bearer {key}"}


def upload(
    client,
    key: str,
    tenant: str,
    files=None,
    *,
    name="support-bot",
    base=BASE,
    weights_name="adapter_model.safetensors",
):
    config, weights = files or lora_files()
    config_file, weights_file = io.BytesIO(config), io.BytesIO(weights)
    config_file.name, weights_file.name = "adapter_config.json", weights_name
    body = {"name": name, "base_model": base, "config": config_file, "weights": weights_file}
    return client.post(URL.format(tenant=tenant), data=body, **_auth(key))


def _error(reply) -> tuple[str, str | None]:
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    return error["code"], error["param"]


def test_a_tenant_admin_uploads_lists_and_deletes_an_adapter(
    client, people, store_dir, django_capture_on_commit_callbacks
):
    alice = people["alice"]
    created = upload(client, alice.admin_key, "alice")
    assert created.status_code == 201, created.content
    body = created.json()
    assert (body["id"], body["name"], body["base_model"], body["rank"]) == (
        f"{BASE}:support-bot",
        "support-bot",
        BASE,
        8,
    )
    assert body["target_modules"] == ["down_proj", "o_proj", "q_proj", "v_proj"]
    assert [p.name for p in stored_files(store_dir)] == ["adapter_config.json", "adapter_model.safetensors"]

    listed = client.get(URL.format(tenant="alice"), **_auth(alice.admin_key)).json()
    assert [a["id"] for a in listed] == [f"{BASE}:support-bot"]
    detail = client.get(f"{URL.format(tenant='alice')}{BASE}:support-bot/", **_auth(alice.admin_key))
    assert detail.status_code == 200 and detail.json()["digest"] == body["digest"]

    with django_capture_on_commit_callbacks(execute=True):
        deleted = client.delete(f"{URL.format(tenant='alice')}{BASE}:support-bot/", **_auth(alice.admin_key))
    assert deleted.status_code == 204
    assert client.get(f"{URL.format(tenant='alice')}{BASE}:support-bot/", **_auth(alice.admin_key)).status_code == 404
    assert stored_files(store_dir) == []


def test_an_upload_as_json_with_base64_weights_is_accepted(client, people):
    config, weights = lora_files()
    body = {"name": "json-one", "base_model": BASE, "config": json.loads(config),
            "weights_base64": base64.b64encode(weights).decode()}  # fmt: skip
    reply = client.post(URL.format(tenant="alice"), data=body, content_type="application/json",
                        **_auth(people["alice"].admin_key))  # fmt: skip
    assert reply.status_code == 201, reply.content
    assert reply.json()["id"] == f"{BASE}:json-one"


def test_the_same_name_twice_is_a_conflict_and_the_same_files_are_stored_once(client, people, store_dir):
    alice, bob = people["alice"], people["bob"]
    files = lora_files()
    assert upload(client, alice.admin_key, "alice", files).status_code == 201
    again = upload(client, alice.admin_key, "alice", files)
    assert again.status_code == 409 and again.json()["error"]["code"] == "adapter_exists"
    assert upload(client, bob.admin_key, "bob", files).status_code == 201  # bob's own handle, same files
    assert len(stored_files(store_dir)) == 2


def _pickled() -> bytes:
    buffer = io.BytesIO()
    torch.save({"w": torch.zeros(2)}, buffer)
    return buffer.getvalue()


def _bad_uploads():
    good_config, good_weights = lora_files()
    other_base = {**TINY_SHAPES, "q_proj": (256, 128), "v_proj": (64, 128)}  # a model with hidden size 128
    _, wrong_base = lora_files(shapes=other_base)
    _, wrong_rank_shapes = lora_files(rank=4)  # the weights' rank is 4, the config says 8
    return {
        "wrong base": ((good_config, wrong_base), "adapter_shape_mismatch", "weights"),
        "wrong shapes": ((good_config, wrong_rank_shapes), "adapter_shape_mismatch", "weights"),
        "pickle": ((good_config, _pickled()), "adapter_not_safetensors", "weights"),
        "truncated": ((good_config, good_weights[: len(good_weights) - 100]), "adapter_truncated", "weights"),
        "truncated header": ((good_config, good_weights[:40]), "adapter_truncated", "weights"),
        "rank too large": (lora_files(rank=32), "adapter_rank_too_large", "config"),
        "module not in base": (lora_files(layers=6), "adapter_base_mismatch", "weights"),
        "unsupported module": (
            lora_files(config_overrides={"target_modules": ["embed_tokens"]}),
            "adapter_unsupported_module",
            "config",
        ),  # fmt: skip
        "not LoRA": (lora_files(config_overrides={"peft_type": "IA3"}), "adapter_bad_config", "config"),
        "DoRA": (lora_files(config_overrides={"use_dora": True}), "adapter_bad_config", "config"),
        "config not JSON": ((b"{nope", good_weights), "adapter_bad_config", "config"),
        "not safetensors": (
            (good_config, b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!"),
            "adapter_not_safetensors",
            "weights",
        ),  # fmt: skip
    }


@pytest.mark.parametrize("case", list(_bad_uploads()))
def test_a_bad_upload_is_a_400_that_names_the_problem_and_stores_nothing(client, people, store_dir, case):
    files, code, param = _bad_uploads()[case]
    reply = upload(client, people["alice"].admin_key, "alice", files)
    assert reply.status_code == 400, reply.content
    assert _error(reply) == (code, param)
    assert not Adapter.objects.exists()
    assert stored_files(store_dir) == []


def test_an_oversized_or_pickle_named_upload_is_refused_before_it_is_read(client, people, store_dir, settings):
    settings.ADAPTER_MAX_BYTES = 4096
    reply = upload(client, people["alice"].admin_key, "alice")
    assert reply.status_code == 400 and _error(reply) == ("adapter_too_large", "weights")
    settings.ADAPTER_MAX_BYTES = 1 << 20
    reply = upload(client, people["alice"].admin_key, "alice", weights_name="adapter_model.bin")
    assert reply.status_code == 400 and _error(reply) == ("adapter_not_safetensors", "weights")
    assert not Adapter.objects.exists() and stored_files(store_dir) == []


def test_an_unknown_base_model_or_name_is_a_400(client, people):
    reply = upload(client, people["alice"].admin_key, "alice", base="no-such-model")
    assert reply.status_code == 400 and _error(reply) == ("model_not_found", "base_model")
    reply = upload(client, people["alice"].admin_key, "alice", name="has:colon")
    assert reply.status_code == 400 and _error(reply) == ("invalid_name", "name")


def test_another_tenant_cannot_see_use_or_delete_an_adapter(client, people):
    alice, bob = people["alice"], people["bob"]
    assert upload(client, alice.admin_key, "alice").status_code == 201
    adapter_url = f"{URL.format(tenant='alice')}{BASE}:support-bot/"
    # bob's admin key on alice's tenant: 404 as for a tenant that does not exist.
    assert client.get(URL.format(tenant="alice"), **_auth(bob.admin_key)).status_code == 404
    assert client.get(adapter_url, **_auth(bob.admin_key)).status_code == 404
    assert client.delete(adapter_url, **_auth(bob.admin_key)).status_code == 404
    assert upload(client, bob.admin_key, "alice", name="sneaky").status_code == 404
    # ... and under his own tenant, alice's adapter name is unknown.
    assert client.get(f"{URL.format(tenant='bob')}{BASE}:support-bot/", **_auth(bob.admin_key)).status_code == 404
    assert Adapter.objects.filter(tenant=alice.tenant).count() == 1


def _models(client, key: str) -> list[str]:
    reply = client.get("/v1/models", **_auth(key))
    assert reply.status_code == 200, reply.content
    return [m["id"] for m in reply.json()["data"]]


# The inference views read on gateway threads (own database connections): committed data only.
@pytest.mark.django_db(transaction=True)
def test_v1_models_lists_a_tenants_adapters_to_that_tenant_only(client, people):
    alice, bob = people["alice"], people["bob"]
    assert upload(client, alice.admin_key, "alice").status_code == 201
    assert _models(client, alice.key) == [BASE, f"{BASE}:support-bot"]
    assert _models(client, bob.key) == [BASE]
    assert client.get(f"/v1/models/{BASE}:support-bot", **_auth(alice.key)).json()["id"] == f"{BASE}:support-bot"
    hidden = client.get(f"/v1/models/{BASE}:support-bot", **_auth(bob.key))
    assert hidden.status_code == 404 and hidden.json()["error"]["code"] == "model_not_found"


def test_a_plain_key_cannot_manage_adapters(client, people):
    assert upload(client, people["alice"].key, "alice").status_code in (401, 403)
