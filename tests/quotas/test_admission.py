"""Admission under concurrency, against the real Redis Lua scripts and the real ledger."""

import random
import threading
import time

import pytest

from core.periods import Period
from ledger.models import UsageRecord
from ledger.services import ledger_flush
from quotas.admission import Admitted, QuotaExceeded, quota_admit, quota_settle, resv_key, tenant_scope
from quotas.limits import limits_for
from quotas.services import key_quota_set, plan_create, tenant_quota_set
from tenants.services import apikey_create
from tests.quotas.helpers import (
    admit,
    admit_concurrently,
    billed_tokens,
    thread_redis,
    worker_reports,
)

pytestmark = pytest.mark.django_db

PROMPT, MAX_TOKENS = 10, 16


@pytest.fixture
def alice(make_tenant, redis_client):
    tenant, _ = make_tenant("alice")
    return tenant, tenant.api_keys.get().id


def test_200_concurrent_requests_never_overrun_a_budget_covering_50(alice, redis_client):
    tenant, key_id = alice
    budget = 50 * (PROMPT + MAX_TOKENS) + 13
    tenant_quota_set(tenant=tenant, budget_tokens=budget)
    limits = limits_for(tenant_id=tenant.id, key_id=key_id)

    results = admit_concurrently(200, lambda: admit(limits, tenant, key_id, prompt=PROMPT, max_tokens=MAX_TOKENS))
    admitted = [rid for rid, r in results if isinstance(r, Admitted)]
    refused = [r for _, r in results if isinstance(r, QuotaExceeded)]
    # Each worker reports what it really generated (never more than max_tokens), then the ledger flush.
    for rid in admitted:
        worker_reports(redis_client, rid, tenant, key_id, prompt=PROMPT, completion=random.randint(1, MAX_TOKENS))
    ledger_flush()

    billed = billed_tokens(tenant)
    overrun = max(0, billed - budget)
    print(f"\nbudget={budget} admitted={len(admitted)} refused={len(refused)} billed={billed} overrun={overrun}")
    assert overrun == 0
    assert len(admitted) == 50
    assert len(refused) == 150
    assert {r.limit for r in refused} == {"budget_tokens"}
    assert UsageRecord.objects.filter(tenant=tenant).count() == 50
    # After settling, the Redis counter holds exactly what the ledger billed.
    assert int(redis_client.get(f"{tenant_scope(tenant.id)}:bud:{Period.current().id}")) == billed


def test_an_rpm_limit_admits_exactly_the_limit_per_window_under_concurrency(alice, redis_client, clock):
    tenant, key_id = alice
    tenant_quota_set(tenant=tenant, rpm=37)
    limits = limits_for(tenant_id=tenant.id, key_id=key_id)
    clock.to_window_start(redis_client)

    results = admit_concurrently(200, lambda: admit(limits, tenant, key_id))

    admitted = [r for _, r in results if isinstance(r, Admitted)]
    refused = [r for _, r in results if isinstance(r, QuotaExceeded)]
    assert len(admitted) == 37
    assert len(refused) == 163 and {r.limit for r in refused} == {"requests"}
    assert all(1 <= r.retry_after <= 60 for r in refused)


def test_a_check_decides_as_admission_does_and_reserves_nothing(alice, redis_client):
    tenant, key_id = alice
    tenant_quota_set(tenant=tenant, concurrency=1, budget_tokens=100)
    limits = limits_for(tenant_id=tenant.id, key_id=key_id)

    def check():
        quota_admit(request_id="check", tenant_id=tenant.id, key_id=key_id, limits=limits, prompt_tokens=PROMPT,
                    max_tokens=MAX_TOKENS, implicit_max_tokens=False, check_only=True)  # fmt: skip

    for _ in range(3):
        check()  # nothing reserved: the one slot is still free
    assert not redis_client.exists(f"{tenant_scope(tenant.id)}:conc")
    _, admitted = admit(limits, tenant, key_id, prompt=PROMPT, max_tokens=MAX_TOKENS)
    assert isinstance(admitted, Admitted)
    with pytest.raises(QuotaExceeded) as refused:
        check()
    assert refused.value.limit == "concurrency"


def test_a_concurrency_cap_is_never_exceeded(alice, redis_client):
    tenant, key_id = alice
    tenant_quota_set(tenant=tenant, concurrency=5)
    limits = limits_for(tenant_id=tenant.id, key_id=key_id)
    lock = threading.Lock()
    state = {"in_flight": 0, "peak": 0, "served": 0, "refused": 0}

    def client():
        for _ in range(10):
            rid, result = admit(limits, tenant, key_id)
            if isinstance(result, QuotaExceeded):
                assert result.limit == "concurrency"
                with lock:
                    state["refused"] += 1
                continue
            with lock:
                state["in_flight"] += 1
                state["peak"] = max(state["peak"], state["in_flight"])
            time.sleep(0.005)
            with lock:
                state["in_flight"] -= 1
                state["served"] += 1
            quota_settle(request_id=rid, prompt_tokens=PROMPT, completion_tokens=3, redis=thread_redis())

    admit_concurrently(40, client)
    print(f"\nconcurrency cap 5: peak={state['peak']} served={state['served']} refused={state['refused']}")
    assert state["peak"] <= 5
    assert state["served"] >= 5 and state["refused"] > 0
    assert redis_client.zcard(f"{tenant_scope(tenant.id)}:conc") == 0


def test_an_implicit_max_tokens_is_lowered_to_the_remaining_budget_instead_of_refused(alice, redis_client):
    tenant, key_id = alice
    tenant_quota_set(tenant=tenant, budget_tokens=100)
    limits = limits_for(tenant_id=tenant.id, key_id=key_id)

    _, explicit = admit(limits, tenant, key_id, prompt=10, max_tokens=2000)
    _, implicit = admit(limits, tenant, key_id, prompt=10, max_tokens=2000, implicit=True)
    _, after = admit(limits, tenant, key_id, prompt=10, max_tokens=1, implicit=True)

    assert isinstance(explicit, QuotaExceeded) and explicit.limit == "budget_tokens"
    assert isinstance(implicit, Admitted) and implicit.max_tokens == 90
    assert isinstance(after, QuotaExceeded) and after.limit == "budget_tokens"


def test_settling_returns_unused_output_tokens_to_the_window(alice, redis_client, clock):
    tenant, key_id = alice
    tenant_quota_set(tenant=tenant, output_tpm=100)
    limits = limits_for(tenant_id=tenant.id, key_id=key_id)
    clock.to_window_start(redis_client)

    rid, first = admit(limits, tenant, key_id, max_tokens=80)
    _, second = admit(limits, tenant, key_id, max_tokens=80)
    assert isinstance(first, Admitted) and isinstance(second, QuotaExceeded) and second.limit == "output_tokens"
    assert quota_settle(request_id=rid, prompt_tokens=10, completion_tokens=12) is True
    _, third = admit(limits, tenant, key_id, max_tokens=80)
    assert isinstance(third, Admitted)


def test_a_replayed_worker_result_is_counted_once(alice, redis_client):
    tenant, key_id = alice
    tenant_quota_set(tenant=tenant, budget_tokens=10_000)
    limits = limits_for(tenant_id=tenant.id, key_id=key_id)
    rid, _ = admit(limits, tenant, key_id, prompt=10, max_tokens=50)

    for _ in range(3):  # the worker's result arrives three times (a retried task, a redelivery)
        worker_reports(redis_client, rid, tenant, key_id, prompt=10, completion=7)
        ledger_flush()

    assert UsageRecord.objects.filter(request_id=rid).count() == 1
    assert int(redis_client.get(f"{tenant_scope(tenant.id)}:bud:{Period.current().id}")) == 17
    assert not redis_client.exists(resv_key(rid))
    assert quota_settle(request_id=rid, prompt_tokens=10, completion_tokens=7) is False


def test_a_key_with_stricter_limits_of_its_own_is_held_to_them(alice, redis_client, clock):
    tenant, key_id = alice
    plan = plan_create(name="team", rpm=100)
    tenant_quota_set(tenant=tenant, plan=plan)
    strict_key, _ = apikey_create(tenant=tenant, name="ci")
    key_quota_set(api_key=strict_key, rpm=3)
    clock.to_window_start(redis_client)

    strict = [admit(limits_for(tenant_id=tenant.id, key_id=strict_key.id), tenant, strict_key.id)[1] for _ in range(5)]
    other = [admit(limits_for(tenant_id=tenant.id, key_id=key_id), tenant, key_id)[1] for _ in range(5)]

    assert [isinstance(r, Admitted) for r in strict] == [True, True, True, False, False]
    assert strict[3].limit == "requests" and strict[3].headers["x-ratelimit-limit-requests"] == "3"
    assert all(isinstance(r, Admitted) for r in other)
    # The tenant's window counted all eight admitted requests.
    assert other[-1].headers["x-ratelimit-remaining-requests"] == str(100 - 8)


def test_replies_carry_ratelimit_headers(alice, redis_client, clock):
    tenant, key_id = alice
    tenant_quota_set(tenant=tenant, rpm=10, input_tpm=1000, output_tpm=500, budget_tokens=5000)
    limits = limits_for(tenant_id=tenant.id, key_id=key_id)
    clock.to_window_start(redis_client)

    _, ok = admit(limits, tenant, key_id, prompt=10, max_tokens=16)

    assert ok.headers["x-ratelimit-limit-requests"] == "10"
    assert ok.headers["x-ratelimit-remaining-requests"] == "9"
    assert ok.headers["x-ratelimit-limit-tokens"] == "1500"
    assert ok.headers["x-ratelimit-remaining-tokens"] == str(1500 - 26)
    assert ok.headers["x-ratelimit-remaining-budget-tokens"] == str(5000 - 26)
    assert ok.headers["x-ratelimit-reset-requests"].endswith("s")
