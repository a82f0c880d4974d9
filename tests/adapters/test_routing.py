"""An adapter request no ready worker can run is refused before anything is enqueued (the choice
among those that can: tests/gateway/test_routing.py); what waits in a worker's own queue is the
pool's demand too; a worker turns the request's adapter into the engine's LoRA request."""

import time

import pytest

from contract import protocol
from contract.adapter_store import FilesystemStore, adapter_digest
from contract.protocol import RequestInput
from gateway import dispatch, lifecycle
from gateway.pools import pool_demand
from workers.adapters import AdapterResolver, AdapterUnavailable, held_field
from workers.engine import RequestRejected

POOL = "tiny"


def _request(adapter_id: int = 0, digest: str = "") -> RequestInput:
    return RequestInput(request_id="chatcmpl-1", model="tiny-gemma4:ft", prompt_token_ids=[2, 3], params={},
                        tenant_id=1, key_id=1, enqueued_at=time.time(), adapter_id=adapter_id,
                        adapter_digest=digest)  # fmt: skip


def _worker(redis_client, name: str, *, adapters: set[int], in_flight=0, slots=4, state="ready", lora=True):
    redis_client.zadd(protocol.pool_workers_key(POOL), {name: time.time()})
    record = {"pool": POOL, "state": state, "in_flight": in_flight, "slots": slots, "adapters": held_field(adapters),
              "lora": int(lora)}  # fmt: skip
    redis_client.hset(protocol.worker_key(name), mapping=record)


def test_when_no_ready_worker_runs_lora_an_adapter_request_is_a_503_and_nothing_is_enqueued(redis_client):
    from catalog.models import ServedModel
    from gateway.errors import ServiceUnavailable

    _worker(redis_client, "plain#a", adapters=set(), lora=False)
    _worker(redis_client, "lora#b", adapters={5}, state="starting")
    model = ServedModel(model_id="tiny-gemma4", path="/m", pool=POOL, context_length=2048)
    request = _request(5, "ab" * 32)
    with pytest.raises(ServiceUnavailable) as refused:
        lifecycle.route(request, model)  # the step before the enqueue
    assert (refused.value.status, refused.value.code) == (503, "adapters_unavailable")
    assert refused.value.headers["Retry-After"] and "tiny-gemma4" in refused.value.message
    assert not redis_client.exists(protocol.input_key(request.request_id))
    assert redis_client.llen(protocol.queue_name(POOL)) == 0


@pytest.mark.django_db
def test_requests_in_a_workers_own_queue_count_as_pool_demand(redis_client):
    _worker(redis_client, "w1#a", adapters={5})
    redis_client.lpush(protocol.queue_name(POOL), "{}")
    redis_client.lpush(protocol.worker_queue_name("w1#a"), "{}", "{}")
    assert pool_demand(POOL).queue_depth == 3


class _Engine:
    """Records the adapters loaded through ``load_adapter``; refuses those named in ``refuse``."""

    def __init__(self, refuse=()):
        self.loaded, self.refuse = [], set(refuse)

    async def load_adapter(self, lora):
        if lora.lora_int_id in self.refuse:
            raise RequestRejected("the adapter could not be loaded: bad file")
        self.loaded.append(lora.lora_int_id)


def test_a_worker_loads_the_adapter_once_from_its_own_copy_under_its_stable_id(tmp_path):
    import asyncio

    store = FilesystemStore(tmp_path / "store")
    files = {"adapter_config.json": b"{}", "adapter_model.safetensors": b"weights"}
    digest = adapter_digest(files)
    store.put(digest, files)
    resolver, engine = AdapterResolver(store, cache_dir=tmp_path / "cache"), _Engine()
    (tmp_path / "cache").mkdir()

    lora = asyncio.run(resolver.lora_request(_request(42, digest), engine))
    assert (lora.lora_int_id, lora.lora_name) == (42, "adapter-42")
    assert (
        lora.lora_path == str(tmp_path / "cache" / digest)
        and (tmp_path / "cache" / digest / "adapter_model.safetensors").read_bytes() == b"weights"
    )
    store.delete(digest)  # deleted meanwhile: the engine can still load again what it loaded once
    assert asyncio.run(resolver.lora_request(_request(42, digest), engine)).lora_path == lora.lora_path
    assert engine.loaded == [42]


def test_an_adapter_gone_from_the_store_or_refused_by_the_engine_fails_its_request_only(tmp_path):
    import asyncio

    store = FilesystemStore(tmp_path / "store")
    (tmp_path / "cache").mkdir()
    resolver = AdapterResolver(store, cache_dir=tmp_path / "cache")
    with pytest.raises(AdapterUnavailable):
        asyncio.run(resolver.lora_request(_request(42, "ab" * 32), _Engine()))
    files = {"adapter_config.json": b"{}", "adapter_model.safetensors": b"other"}
    store.put(adapter_digest(files), files)
    with pytest.raises(RequestRejected):
        asyncio.run(resolver.lora_request(_request(43, adapter_digest(files)), _Engine(refuse={43})))


def test_the_request_input_carries_the_adapter():
    raw = _request(42, "ab" * 32).dumps()
    assert (RequestInput.loads(raw).adapter_id, RequestInput.loads(raw).adapter_digest) == (42, "ab" * 32)


@pytest.mark.django_db(transaction=True)
def test_a_request_waiting_for_a_holder_that_died_is_sent_to_another_worker_at_once(redis_client):
    import asyncio

    from catalog.models import ServedModel

    _worker(redis_client, "w1#a", adapters=set())  # the pool has another ready worker
    request = _request(5, "ab" * 32)
    request.routed_to = "w9#gone"  # its holder stopped heartbeating
    request.params = {"max_tokens": 8}
    redis_client.set(protocol.input_key(request.request_id), request.dumps())
    model = ServedModel(model_id="tiny-gemma4", path="/m", pool=POOL, context_length=2048)
    progress = dispatch._Progress(queue_deadline=time.monotonic() + 300)

    outcome = asyncio.run(dispatch._check_unstarted(request, model, progress))
    assert outcome is dispatch.CONTINUED
    assert not redis_client.exists(protocol.input_key(request.request_id))
    assert (request.attempt, request.routed_to, request.earlier_workers) == (1, "w1#a", "w9#gone")
    assert redis_client.exists(protocol.input_key(f"{request.request_id}~1"))
    assert redis_client.llen(protocol.worker_queue_name("w1#a")) == 1

    request.routed_to, request.request_id, request.attempt = "w1#a", "chatcmpl-2", 0  # a live holder: it waits
    redis_client.set(protocol.input_key(request.request_id), request.dumps())
    assert asyncio.run(dispatch._check_unstarted(request, model, progress)) is None


# The inference views read on gateway threads (own database connections): committed data only.
@pytest.mark.django_db(transaction=True)
def test_an_adapter_request_to_a_pool_without_lora_workers_is_a_503_before_anything_is_enqueued(
    client, people, redis_client
):
    from tests.adapters.test_adapters_api import _auth, upload

    alice = people["alice"]
    assert upload(client, alice.admin_key, "alice").status_code == 201
    _worker(redis_client, "plain#a", adapters=set(), lora=False)  # ready, but its engine would refuse it
    body = {"model": "tiny-gemma4:support-bot", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    reply = client.post("/v1/chat/completions", data=body, content_type="application/json", **_auth(alice.key))
    assert reply.status_code == 503, reply.content
    error = reply.json()["error"]
    assert (error["type"], error["code"]) == ("service_unavailable_error", "adapters_unavailable")
    assert reply.headers["Retry-After"]
    assert not redis_client.keys("req:*") and redis_client.llen(protocol.queue_name(POOL)) == 0
    assert not redis_client.keys(f"{protocol.worker_queue_name('*')}")
