"""A deleted adapter: a request naming it is a 404 at once, and a worker whose engine loaded it
unloads it within a heartbeat and refuses a request for it that was queued before the deletion."""

import asyncio
import threading

import pytest

from adapters.models import Adapter
from contract import protocol
from contract.adapter_store import FilesystemStore, adapter_digest
from tests.adapters.conftest import BASE
from tests.adapters.test_adapters_api import URL, _auth, upload
from tests.adapters.test_routing import _request
from workers.adapters import AdapterResolver, AdapterUnavailable


class _LoopEngine:
    """An engine host's adapter calls on a real event loop in a thread of its own."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.loaded, self.unloaded = [], []
        self.unloaded_event = threading.Event()

    async def load_adapter(self, lora):
        self.loaded.append(lora.lora_int_id)

    async def unload_adapter(self, lora_id: int):
        self.unloaded.append(lora_id)
        self.unloaded_event.set()

    def run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=60)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=60)
        self.loop.close()


@pytest.fixture
def engine():
    host = _LoopEngine()
    yield host
    host.close()


def _stored(tmp_path, *weights: bytes):
    store = FilesystemStore(tmp_path / "store")
    digests = []
    for data in weights:
        files = {"adapter_config.json": b"{}", "adapter_model.safetensors": data}
        store.put(adapter_digest(files), files)
        digests.append(adapter_digest(files))
    (tmp_path / "cache").mkdir()
    return store, digests


def test_a_worker_unloads_a_deleted_adapter_and_refuses_requests_for_it(redis_client, engine, tmp_path):
    store, (first, second) = _stored(tmp_path, b"one", b"two")
    resolver = AdapterResolver(store, cache_dir=tmp_path / "cache")
    engine.run(resolver.lora_request(_request(42, first), engine))
    engine.run(resolver.lora_request(_request(43, second), engine))
    assert resolver.forget_deleted(redis_client, engine) == set()  # nothing deleted yet

    redis_client.zadd(protocol.ADAPTERS_DELETED, {"42": 1.0, "7": 1.0})  # 7: never loaded here
    assert resolver.forget_deleted(redis_client, engine) == {42}
    assert engine.unloaded_event.wait(timeout=60)
    assert engine.unloaded == [42]
    with pytest.raises(AdapterUnavailable):  # a request queued before the deletion
        engine.run(resolver.lora_request(_request(42, first), engine))
    assert engine.run(resolver.lora_request(_request(43, second), engine)).lora_int_id == 43  # the other stays
    assert resolver.forget_deleted(redis_client, engine) == set()  # unloaded once
    assert engine.unloaded == [42]


def test_deleting_an_adapter_tells_the_workers(client, people, redis_client, django_capture_on_commit_callbacks):
    alice = people["alice"]
    assert upload(client, alice.admin_key, "alice").status_code == 201
    adapter_id = Adapter.objects.get().pk
    with django_capture_on_commit_callbacks(execute=True):
        deleted = client.delete(f"{URL.format(tenant='alice')}{BASE}:support-bot/", **_auth(alice.admin_key))
    assert deleted.status_code == 204
    assert redis_client.zscore(protocol.ADAPTERS_DELETED, str(adapter_id)) is not None


# The inference views read on gateway threads (own database connections): committed data only.
@pytest.mark.django_db(transaction=True)
def test_a_request_for_a_deleted_adapter_is_a_404_at_once(client, people):
    alice = people["alice"]
    assert upload(client, alice.admin_key, "alice").status_code == 201
    body = {"model": f"{BASE}:support-bot", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    deleted = client.delete(f"{URL.format(tenant='alice')}{BASE}:support-bot/", **_auth(alice.admin_key))
    assert deleted.status_code == 204
    reply = client.post("/v1/chat/completions", data=body, content_type="application/json", **_auth(alice.key))
    assert reply.status_code == 404, reply.content
    assert reply.json()["error"]["code"] == "model_not_found"
