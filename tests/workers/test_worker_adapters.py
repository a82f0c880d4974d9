"""A worker's heartbeat says whether its engine runs LoRA adapters (ENGINE_LORA): the gateway sends
requests with an adapter only to workers that do (gateway/dispatch.py)."""

import pytest

from workers import protocol
from workers.engine import EngineHost
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
