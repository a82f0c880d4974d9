"""The admission gate (quotas/gate.py): what it refuses for a limit is a 429 recorded for the
tenant's console (quotas/refusals.py), the request of n choices without max_tokens included."""

import threading
import time
import uuid

import pytest

from catalog.models import ServedModel
from catalog.readiness import ready_workers
from contract import protocol
from core.errors import InvalidRequest, RateLimited
from quotas.admission import quota_settle
from quotas.gate import admission_check, admission_gate
from quotas.limits import limits_for
from quotas.refusals import refusals_recent
from quotas.services import tenant_quota_set
from tenants.services import KeyPrincipal

pytestmark = pytest.mark.django_db

PROMPT = 2


@pytest.fixture
def alice(make_tenant, redis_client):
    """alice with a token budget that leaves 4 tokens once a first request of 10 + 10 is admitted."""
    tenant, _ = make_tenant("alice")
    key = tenant.api_keys.get()
    tenant_quota_set(tenant=tenant, budget_tokens=24)
    principal = KeyPrincipal(key_id=key.id, tenant_id=tenant.id, tenant_name=tenant.name, allowed_models=(),
                             key_prefix=key.prefix)  # fmt: skip
    return principal, limits_for(tenant_id=tenant.id, key_id=key.id)


def _gate(alice, *, prompt: int, max_tokens: int, implicit: bool, choices: int):
    principal, limits = alice
    model = ServedModel(model_id="m", path="unused", pool="gate-test", context_length=4096)
    return admission_gate(
        principal=principal, limits=limits, model=model, request_id=f"chatcmpl-{uuid.uuid4().hex}",
        prompt_tokens=prompt, max_tokens=max_tokens, implicit_max_tokens=implicit, choices=choices, ready_workers={},
    )  # fmt: skip


def test_n_choices_without_max_tokens_are_refused_and_recorded_when_fewer_tokens_than_choices_are_left(alice):
    principal, limits = alice
    assert _gate(alice, prompt=10, max_tokens=10, implicit=False, choices=1).max_tokens == 10  # 4 left

    # Three choices need three tokens besides the prompt's two: one is missing.
    check = dict(principal=principal, limits=limits, prompt_tokens=PROMPT, max_tokens=3 * 1000,
                 implicit_max_tokens=True, prompt_param="messages", choices=3)  # fmt: skip
    with pytest.raises(RateLimited) as early:
        admission_check(**check)  # before tokenizing: the same answer, nothing reserved
    with pytest.raises(RateLimited) as refused:
        _gate(alice, prompt=PROMPT, max_tokens=3 * 1000, implicit=True, choices=3)
    for error in (early.value, refused.value):
        assert (error.status, error.code) == (429, "insufficient_quota")
        assert error.headers["x-ratelimit-exceeded"] == "budget_tokens" and "Retry-After" in error.headers
    recorded = refusals_recent(tenant_id=principal.tenant_id)
    assert [(r.limit, r.code, r.key_prefix) for r in recorded] == [("budget_tokens", "insufficient_quota",
                                                                   principal.key_prefix)] * 2  # fmt: skip

    # Two choices fit in the two tokens left: max_tokens is lowered to one each.
    admitted = _gate(alice, prompt=PROMPT, max_tokens=2 * 1000, implicit=True, choices=2)
    assert admitted.max_tokens == 2


def test_an_implicit_max_tokens_over_a_limits_whole_size_per_choice_is_a_400(alice):
    principal, limits = alice
    with pytest.raises(InvalidRequest) as too_large:  # 2 + 30 > 24, whatever the wait
        admission_check(principal=principal, limits=limits, prompt_tokens=PROMPT, max_tokens=30 * 1000,
                        implicit_max_tokens=True, prompt_param="messages", choices=30, counters=False)  # fmt: skip
    assert (too_large.value.code, too_large.value.param) == ("exceeds_limit", "max_tokens")
    assert refusals_recent(tenant_id=principal.tenant_id) == []


# -- the reservation and the pool's fair share in one script ------------------------------------

POOL = "gate-test"


def _slot_gate(alice, request_id: str, *, slots: int, prompt: int = PROMPT, max_tokens: int = 2):
    principal, limits = alice
    model = ServedModel(model_id="m", path="unused", pool=POOL, context_length=4096)
    return admission_gate(
        principal=principal, limits=limits, model=model, request_id=request_id, prompt_tokens=prompt,
        max_tokens=max_tokens, implicit_max_tokens=False, ready_workers={"worker-1": slots},
    )  # fmt: skip


@pytest.fixture
def script_calls(monkeypatch) -> list[str]:
    """The Lua scripts this process runs from here on, by digest (counted in the client: the server's
    own counters also count whatever else uses that Redis meanwhile)."""
    from redis.commands.core import Script

    calls: list[str] = []
    run = Script.__call__

    def counted(self, *args, **kwargs):
        calls.append(self.sha)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(Script, "__call__", counted)
    return calls


def test_with_a_free_slot_the_reservation_and_the_slot_are_one_script_call(alice, redis_client, script_calls):
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    _slot_gate(alice, rid, slots=2)
    assert len(script_calls) == 1, script_calls
    assert redis_client.zscore(f"fq:{POOL}:run", f"{alice[0].tenant_id}:{rid}") is not None
    assert redis_client.hget(f"resv:{rid}", "fq") == f"fq:{POOL}"  # settling gives the slot back


def test_with_the_pool_full_a_request_waits_for_the_slot_a_settled_one_frees(alice, redis_client, settings):
    settings.FAIR_SHARE_POLL_SECONDS = 0.01
    first, second = f"chatcmpl-{uuid.uuid4().hex}", f"chatcmpl-{uuid.uuid4().hex}"
    _slot_gate(alice, first, slots=1)
    admitted = []
    waiter = threading.Thread(target=lambda: admitted.append(_slot_gate(alice, second, slots=1)))
    waiter.start()
    tenant = str(alice[0].tenant_id)
    deadline = time.monotonic() + 60
    while redis_client.hget(f"fq:{POOL}:waitn", tenant) != "1":  # counted as waiting by its first try
        assert time.monotonic() < deadline and waiter.is_alive(), "the second request never waited"
        time.sleep(0.01)
    assert not admitted

    quota_settle(request_id=first, prompt_tokens=PROMPT, completion_tokens=1)
    waiter.join(60)
    assert admitted and redis_client.zscore(f"fq:{POOL}:run", f"{tenant}:{second}") is not None
    assert redis_client.hget(f"fq:{POOL}:waitn", tenant) == "0"


def test_a_request_over_its_quota_tries_no_slot(alice, redis_client):
    with pytest.raises(RateLimited):
        _slot_gate(alice, f"chatcmpl-{uuid.uuid4().hex}", slots=1, prompt=20, max_tokens=10)  # 30 > 24
    assert redis_client.zcard(f"fq:{POOL}:run") == 0
    assert redis_client.hget(f"fq:{POOL}:waitn", str(alice[0].tenant_id)) is None


# -- the early check and the pool's ready workers in one round trip ------------------------------


def _worker(redis_client, name: str, *, state: str, slots: int) -> None:
    redis_client.zadd(protocol.pool_workers_key(POOL), {name: time.time() + 3600})  # fresh all test long
    redis_client.hset(protocol.worker_key(name), mapping={"pool": POOL, "state": state, "slots": slots})


def _check(alice, *, max_tokens: int):
    principal, limits = alice
    return admission_check(principal=principal, limits=limits, prompt_tokens=PROMPT, max_tokens=max_tokens,
                           implicit_max_tokens=False, prompt_param="messages", ready_pool=POOL)  # fmt: skip


def test_the_early_check_reads_the_pools_ready_workers_in_its_own_round_trip(alice, redis_client, redis_round_trips):
    _worker(redis_client, "w-ready", state="ready", slots=3)
    _worker(redis_client, "w-starting", state="starting", slots=3)
    _check(alice, max_tokens=2)  # Redis loads the scripts: not what a request pays once it runs
    redis_round_trips.clear()

    assert _check(alice, max_tokens=2) == {"w-ready": 3} == ready_workers(POOL)
    assert redis_round_trips[0] == 2 and len(redis_round_trips) == 2  # the check and the read; then ready_workers
    _gate(alice, prompt=10, max_tokens=10, implicit=False, choices=1)  # 4 tokens left
    with pytest.raises(RateLimited):  # 2 + 3 > 4: refused as without the read
        _check(alice, max_tokens=3)
    assert [r.limit for r in refusals_recent(tenant_id=alice[0].tenant_id)] == ["budget_tokens"]


def test_the_early_check_loads_its_scripts_into_a_redis_that_lost_them(alice, redis_client):
    _worker(redis_client, "w-ready", state="ready", slots=2)
    redis_client.script_flush()  # as after a Redis restart
    assert _check(alice, max_tokens=2) == {"w-ready": 2}
    _gate(alice, prompt=10, max_tokens=10, implicit=False, choices=1)  # 4 tokens left
    redis_client.script_flush()
    with pytest.raises(RateLimited):
        _check(alice, max_tokens=3)
