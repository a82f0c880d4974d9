"""A worker's heartbeat says whether its engine runs LoRA adapters (ENGINE_LORA): the gateway sends
requests with an adapter only to workers that do (gateway/dispatch.py). A deleted adapter leaves the
real engine (vLLM's remove_lora) and the ids the heartbeat lists."""

import asyncio
import time

import pytest

from contract import protocol
from contract.adapter_store import FilesystemStore, adapter_digest
from contract.protocol import RequestInput
from tests.adapters.lora import lora_files
from workers.adapters import AdapterResolver, AdapterUnavailable
from workers.engine import EngineHost
from workers.profiles import LORA_ARGS
from workers.serving import WorkerRuntime

POOL = "lora-announce"


@pytest.fixture
def beat(redis_client, monkeypatch):
    """beat(lora) -> the heartbeat record of a worker built with ENGINE_LORA on or off."""
    runtimes = []

    def run(lora: bool) -> dict:
        monkeypatch.setenv("ENGINE_LORA", "1" if lora else "0")
        engine = EngineHost("unused-model-path", profile="cpu", served_model_name="tiny-gemma4")
        runtime = WorkerRuntime(node="worker@pod-a", model="tiny-gemma4", model_path="unused", pool=POOL,
                                profile="cpu", slots=4, engine=engine)  # fmt: skip
        runtimes.append(runtime)
        runtime._beat()
        return redis_client.hgetall(protocol.worker_key(runtime.name))

    yield run
    for runtime in runtimes:
        runtime.redis.close()


def test_the_heartbeat_announces_whether_the_engine_runs_lora(beat):
    with_lora, without = beat(True), beat(False)
    assert protocol.runs_lora(with_lora) and with_lora["lora"] == "1"
    assert not protocol.runs_lora(without) and without["lora"] == "0"
    assert not protocol.runs_lora({})  # a worker of a version that does not say: none sent to it


@pytest.fixture(scope="module")
def lora_engine(engine_model_dir):
    """A started EngineHost on the tiny model with LoRA on (the profile's ENGINE_LORA arguments)."""
    host = EngineHost(str(engine_model_dir), profile="cpu", served_model_name="tiny-gemma4", enforce_eager=True,
                      **LORA_ARGS)  # fmt: skip
    host.start(timeout=300)
    yield host
    host.shutdown()


def _held(host: EngineHost, wanted: bool, lora_id: int, timeout: float = 60) -> bool:
    """Wait until the ids the heartbeat would list hold `lora_id` (or not); each call asks the engine
    again and reads its previous answer, so this waits on the engine's state, a call at a time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (lora_id in host.loaded_adapters()) == wanted:
            return True
        time.sleep(0.05)
    return False


def test_a_deleted_adapter_is_removed_from_the_engine_and_no_longer_listed(lora_engine, redis_client, tmp_path):
    store = FilesystemStore(tmp_path / "store")
    config, weights = lora_files(seed=3)
    files = {"adapter_config.json": config, "adapter_model.safetensors": weights}
    digest = adapter_digest(files)
    store.put(digest, files)
    (tmp_path / "cache").mkdir()
    resolver = AdapterResolver(store, cache_dir=tmp_path / "cache")
    request = RequestInput(
        request_id="chatcmpl-1", model="tiny-gemma4:ft", prompt_token_ids=[2, 3], params={}, tenant_id=1, key_id=1,
        enqueued_at=time.time(), adapter_id=11, adapter_digest=digest,
    )  # fmt: skip

    def on_loop(coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, lora_engine.loop).result(timeout=120)

    assert on_loop(resolver.lora_request(request, lora_engine)).lora_int_id == 11
    assert _held(lora_engine, True, 11), "the engine lists the loaded adapter"

    redis_client.zadd(protocol.ADAPTERS_DELETED, {"11": time.time()})
    assert resolver.forget_deleted(redis_client, lora_engine) == {11}  # hands remove_lora to the engine's loop
    assert _held(lora_engine, False, 11), "the engine no longer lists the deleted adapter"
    assert 11 not in on_loop(lora_engine._engine.list_loras())  # vLLM itself no longer holds it
    assert on_loop(lora_engine.unload_adapter(11)) is False  # gone already: nothing to remove
    with pytest.raises(AdapterUnavailable):  # a request for it still queued is refused, never loaded again
        on_loop(resolver.lora_request(request, lora_engine))
