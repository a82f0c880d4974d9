"""The route step: which worker of a pool runs a request (gateway/routing.py), against real Redis."""

import time

import pytest

from contract import protocol
from contract.protocol import RequestInput
from gateway import routing

POOL = "route"
CHUNK = 64


@pytest.fixture(autouse=True)
def _settings(settings):
    settings.ROUTING_POLICY = "cache_aware"
    settings.ROUTING_CHUNK_TOKENS = CHUNK
    settings.ROUTING_INDEX_CHUNKS = 65_536
    settings.ROUTING_PREFILL_WEIGHT = 1.0
    settings.ROUTING_LOAD_WEIGHT = 1.0
    return settings


def _worker(redis_client, name: str, *, state="ready", seen=None, lora=False, adapters="", kv_tokens=0):
    redis_client.zadd(protocol.pool_workers_key(POOL), {name: seen or time.time()})
    record = {"pool": POOL, "state": state, "lora": int(lora), "adapters": adapters, "kv_tokens": kv_tokens}
    redis_client.hset(protocol.worker_key(name), mapping=record)


def _open(redis_client, worker: str, request_id: str, tokens: int, at: float | None = None) -> None:
    """An open request of ``worker`` bringing ``tokens``, as the route step records it."""
    redis_client.hset(routing.open_key(worker), request_id, f"{tokens}:{at or time.time()}")
    redis_client.hincrby(routing.open_key(worker), routing.LOAD_FIELD, tokens)


_ids = iter(range(10**9))


def _request(prompt: list[int], *, tenant_salt="tenant-1", max_tokens=16, adapter_id=0) -> RequestInput:
    return RequestInput(request_id=f"chatcmpl-{next(_ids)}", model="tiny-gemma4", prompt_token_ids=prompt,
                        params={"max_tokens": max_tokens}, tenant_id=1, key_id=1, enqueued_at=time.time(),
                        cache_salt=tenant_salt, adapter_id=adapter_id)  # fmt: skip


def _prefix(group: int, tokens: int = 20 * CHUNK) -> list[int]:
    return [1000 * group + i for i in range(tokens)]


def test_a_request_goes_where_its_prefix_was_sent_before(redis_client):
    _worker(redis_client, "a#1")
    _worker(redis_client, "b#2")
    request = _request(_prefix(1) + [7, 8, 9])
    first = routing.choose_worker(request, POOL)
    routing.release(request.request_id, first.worker)  # nothing open anywhere: only the cache decides
    again = routing.choose_worker(_request(_prefix(1) + [4, 5]), POOL)
    assert again.worker == first.worker
    assert again.cached_tokens == 20 * CHUNK


def test_groups_spread_over_the_pool_and_each_stays_on_its_worker(redis_client):
    """Load balance places new groups; affinity keeps each group's follow-ups where its prefix is."""
    _worker(redis_client, "a#1")
    _worker(redis_client, "b#2")
    homes = {group: routing.choose_worker(_request(_prefix(group)), POOL).worker for group in range(4)}
    assert sorted(homes.values()) == ["a#1", "a#1", "b#2", "b#2"]
    for group, home in homes.items():
        assert routing.choose_worker(_request(_prefix(group) + [group]), POOL).worker == home


def test_tenants_never_share_an_index_entry(redis_client):
    _worker(redis_client, "a#1")
    _worker(redis_client, "b#2")
    routing.choose_worker(_request(_prefix(1), tenant_salt="alice"), POOL)
    other = routing.choose_worker(_request(_prefix(1), tenant_salt="bob"), POOL)
    assert other.cached_tokens == 0
    assert routing.prompt_chunks(_request(_prefix(1), tenant_salt="alice")) != routing.prompt_chunks(
        _request(_prefix(1), tenant_salt="bob")
    )


def test_an_adapter_keys_its_own_chunks(redis_client):
    base = routing.prompt_chunks(_request(_prefix(1)))
    assert routing.prompt_chunks(_request(_prefix(1), adapter_id=5)) != base
    assert routing.prompt_chunks(_request(_prefix(1) + [1, 2])) == base  # only full chunks count


def test_a_hit_loses_to_a_worker_much_less_loaded(redis_client):
    """Affinity without load balance is slower than random: a busy holder is passed over once its
    extra load outweighs the prefill the cache would save."""
    _worker(redis_client, "a#1")
    _worker(redis_client, "b#2")
    home = routing.choose_worker(_request(_prefix(1)), POOL).worker
    other = "b#2" if home == "a#1" else "a#1"
    # The holder is given more open work than the whole prompt's prefill.
    _open(redis_client, home, "busy", 60 * CHUNK)
    assert routing.choose_worker(_request(_prefix(1)), POOL).worker == other


def test_without_index_data_the_least_loaded_worker_gets_it(redis_client):
    _worker(redis_client, "a#1")
    _worker(redis_client, "b#2")
    _open(redis_client, "a#1", "r1", 500)
    assert routing.choose_worker(_request([1, 2, 3]), POOL).worker == "b#2"


@pytest.mark.parametrize("state", ["draining", "starting", "failed", "stopped"])
def test_a_worker_not_ready_gets_nothing(redis_client, state):
    _worker(redis_client, "a#1", state=state)
    _worker(redis_client, "b#2")
    _open(redis_client, "b#2", "r1", 100000)
    assert routing.choose_worker(_request(_prefix(1)), POOL).worker == "b#2"


def test_a_stale_worker_gets_nothing(redis_client):
    _worker(redis_client, "gone#1", seen=time.time() - 3600)
    _worker(redis_client, "b#2")
    _open(redis_client, "b#2", "r1", 100000)
    assert routing.choose_worker(_request(_prefix(1)), POOL).worker == "b#2"


def test_with_no_ready_worker_the_pools_queue_gets_a_base_request(redis_client):
    _worker(redis_client, "a#1", state="starting")
    assert routing.choose_worker(_request(_prefix(1)), POOL).worker == ""


def test_the_open_requests_are_released_when_the_gateway_lets_go(redis_client):
    _worker(redis_client, "a#1")
    request = _request(_prefix(1), max_tokens=100)
    route = routing.choose_worker(request, POOL)
    brings = redis_client.hget(routing.open_key(route.worker), request.request_id)
    assert int(brings.split(":")[0]) == 20 * CHUNK + 100
    routing.release(request.request_id, route.worker)
    assert not redis_client.hexists(routing.open_key(route.worker), request.request_id)
    assert redis_client.hget(routing.open_key(route.worker), routing.LOAD_FIELD) == "0"
    routing.release(request.request_id, route.worker)  # a second release changes nothing
    assert redis_client.hget(routing.open_key(route.worker), routing.LOAD_FIELD) == "0"


def test_an_index_holds_at_most_what_its_engine_caches(redis_client):
    _worker(redis_client, "a#1", kv_tokens=10 * CHUNK)
    for group in range(3):
        routing.choose_worker(_request(_prefix(group)), POOL)
    assert redis_client.zcard(routing.index_key("a#1")) == 10
    assert redis_client.ttl(routing.index_key("a#1")) > 0


def test_the_reaper_drops_lost_workers_and_unreleased_requests(redis_client):
    _worker(redis_client, "a#1")
    _worker(redis_client, "gone#2", seen=time.time() - 3600)
    redis_client.zadd(routing.index_key("gone#2"), {"ab": 1})
    _open(redis_client, "gone#2", "r1", 10)
    _open(redis_client, "a#1", "old", 10, at=1000)
    _open(redis_client, "a#1", "new", 10)
    assert routing.routing_reap() == 3
    assert not redis_client.exists(routing.index_key("gone#2"), routing.open_key("gone#2"))
    assert redis_client.hgetall(routing.open_key("a#1")).keys() == {"new", routing.LOAD_FIELD}
    assert redis_client.hget(routing.open_key("a#1"), routing.LOAD_FIELD) == "10"


def test_round_robin_takes_the_ready_workers_in_turn(redis_client, settings):
    settings.ROUTING_POLICY = "round_robin"
    for name in ("a#1", "b#2", "c#3"):
        _worker(redis_client, name)
    chosen = [routing.choose_worker(_request(_prefix(1)), POOL).worker for _ in range(6)]
    assert sorted(chosen[:3]) == ["a#1", "b#2", "c#3"] and chosen[3:] == chosen[:3]


def test_least_loaded_ignores_the_cache(redis_client, settings):
    _worker(redis_client, "a#1")
    _worker(redis_client, "b#2")
    home = routing.choose_worker(_request(_prefix(1)), POOL).worker
    settings.ROUTING_POLICY = "least_loaded"
    assert routing.choose_worker(_request(_prefix(1)), POOL).worker != home


def test_the_pool_policy_leaves_base_requests_to_the_pools_queue(redis_client, settings):
    settings.ROUTING_POLICY = "pool"
    _worker(redis_client, "a#1")
    assert routing.choose_worker(_request(_prefix(1)), POOL).worker == ""
    assert not redis_client.exists(routing.open_key("a#1"))


def test_a_worker_holding_the_adapter_is_preferred_and_one_without_lora_never_gets_it(redis_client):
    _worker(redis_client, "plain#1", lora=False)
    _worker(redis_client, "holder#2", lora=True, adapters="5,7")
    _worker(redis_client, "other#3", lora=True, adapters="9")
    _open(redis_client, "holder#2", "r1", 1000)  # busier, still cheaper
    assert routing.choose_worker(_request([1, 2], adapter_id=5), POOL).worker == "holder#2"
    assert routing.choose_worker(_request([1, 2], adapter_id=6), POOL).worker == "other#3"
