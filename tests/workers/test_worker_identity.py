"""A worker's identity in Redis is unique per process start, and its claim of a request records it
(workers/serving.py): the gateway tells a restarted worker's old requests from its new ones."""

import time

import pytest

from workers import protocol
from workers.engine import EngineHost
from workers.serving import WORKER_RECORD_SECONDS, WorkerRuntime, claim_request

NODE = "worker@pod-a"
POOL = "identity"


@pytest.fixture
def start_worker(redis_client):
    """Factory: a WorkerRuntime of NODE as one process start builds it (its engine is not started)."""
    runtimes = []

    def start() -> WorkerRuntime:
        engine = EngineHost("unused-model-path", profile="cpu", served_model_name="tiny-gemma4")
        runtime = WorkerRuntime(node=NODE, model="tiny-gemma4", model_path="unused", pool=POOL, profile="cpu",
                                slots=4, engine=engine)  # fmt: skip
        runtimes.append(runtime)
        return runtime

    yield start
    for runtime in runtimes:
        runtime.redis.close()


def test_each_process_start_heartbeats_under_its_own_identity(start_worker, redis_client):
    before, after = start_worker(), start_worker()

    assert before.name != after.name
    assert before.name.startswith(f"{NODE}#") and after.name.startswith(f"{NODE}#")
    assert before.relay.worker == before.name  # the identity its start entries carry
    before._beat()
    after._beat()
    assert set(redis_client.zrange(protocol.pool_workers_key(POOL), 0, -1)) == {before.name, after.name}
    record = redis_client.hgetall(protocol.worker_key(after.name))
    assert (record["node"], record["pool"], record["state"]) == (NODE, POOL, "starting")


def test_a_heartbeat_forgets_workers_gone_longer_than_their_record_lives(start_worker, redis_client):
    gone = f"{NODE}#long-gone"
    redis_client.zadd(protocol.pool_workers_key(POOL), {gone: time.time() - WORKER_RECORD_SECONDS - 60})

    worker = start_worker()
    worker._beat()

    assert redis_client.zrange(protocol.pool_workers_key(POOL), 0, -1) == [worker.name]


def test_a_claim_takes_the_input_and_records_the_claimer(redis_client):
    redis_client.set(protocol.input_key("r1"), "{}")

    assert claim_request(redis_client, "r1", f"{NODE}#one") == "{}"
    assert claim_request(redis_client, "r1", f"{NODE}#two") is None  # claimed once only

    assert not redis_client.exists(protocol.input_key("r1"))
    assert redis_client.get(protocol.claim_key("r1")) == f"{NODE}#one"
    assert 0 < redis_client.ttl(protocol.claim_key("r1")) <= protocol.REQUEST_TTL


def test_a_request_taken_back_by_the_gateway_is_not_claimed(redis_client):
    assert claim_request(redis_client, "r2", f"{NODE}#one") is None
    assert not redis_client.exists(protocol.claim_key("r2"))
