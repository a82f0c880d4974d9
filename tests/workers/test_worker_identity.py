"""A worker's identity in Redis is unique per process start, and its claim of a request records it
(workers/serving.py, workers/claims.py): the gateway tells a restarted worker's old requests from
its new ones."""

import asyncio
import os
import time

import pytest

from contract import protocol
from workers.claims import ClaimBatcher, claim_requests
from workers.engine import EngineHost
from workers.relay import relay_client
from workers.serving import WORKER_RECORD_SECONDS, WorkerRuntime

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


def _claim(rids: list[str], worker: str) -> list[str | None]:
    async def claim():
        client = relay_client(os.environ["REDIS_URL"])
        try:
            return await claim_requests(client, rids, worker)
        finally:
            await client.aclose()

    return asyncio.run(claim())


def test_a_claim_takes_the_input_and_records_the_claimer(redis_client):
    redis_client.set(protocol.input_key("r1"), "{}")

    assert _claim(["r1"], f"{NODE}#one") == ["{}"]
    assert _claim(["r1"], f"{NODE}#two") == [None]  # claimed once only

    assert not redis_client.exists(protocol.input_key("r1"))
    assert redis_client.get(protocol.claim_key("r1")) == f"{NODE}#one"
    assert 0 < redis_client.ttl(protocol.claim_key("r1")) <= protocol.REQUEST_TTL


def test_a_request_taken_back_by_the_gateway_is_not_claimed(redis_client):
    assert _claim(["r2"], f"{NODE}#one") == [None]
    assert not redis_client.exists(protocol.claim_key("r2"))


def test_claims_take_each_request_they_find_and_leave_the_others(redis_client):
    redis_client.set(protocol.input_key("r3"), '{"a": 1}')
    redis_client.set(protocol.input_key("r5"), '{"a": 2}')

    assert _claim(["r3", "r4", "r5"], f"{NODE}#one") == ['{"a": 1}', None, '{"a": 2}']

    claimers = [redis_client.get(protocol.claim_key(rid)) for rid in ("r3", "r4", "r5")]
    assert claimers == [f"{NODE}#one", None, f"{NODE}#one"]


@pytest.mark.asyncio
async def test_claims_asked_for_together_go_to_redis_in_one_round_trip(redis_client):
    """A wave of tasks: each task thread asks for its claim, the loop makes them all in one call."""
    rids = [f"wave-{index}" for index in range(50)]
    for rid in rids[::2]:
        redis_client.set(protocol.input_key(rid), rid)
    client = relay_client(os.environ["REDIS_URL"])
    claims = ClaimBatcher(client, f"{NODE}#one")
    try:
        inputs = await asyncio.gather(*(claims.claim(rid) for rid in rids))
    finally:
        await client.aclose()

    assert inputs == [rid if index % 2 == 0 else None for index, rid in enumerate(rids)]
    assert claims.batches == 1
