"""The setquota command, plan/override resolution, and the reaper of reservations nobody settled."""

import json
import time
import uuid

import pytest
from django.core.management import CommandError, call_command

from ledger.models import UsageRecord
from quotas.admission import RESERVATIONS, resv_key, tenant_scope
from quotas.limits import limits_for
from quotas.services import plan_create, tenant_quota_set
from quotas.tasks import quota_reap
from tests.quotas.helpers import admit

pytestmark = pytest.mark.django_db(transaction=True)


def _setquota(*args) -> dict:
    from io import StringIO

    out = StringIO()
    call_command("setquota", *args, stdout=out)
    return json.loads(out.getvalue())


def test_setquota_sets_overrides_on_top_of_the_plan_and_none_removes_them(make_tenant, redis_client):
    tenant, _ = make_tenant("alice")
    plan_create(name="starter", rpm=60, concurrency=4, budget_tokens=1_000_000)

    with_plan = _setquota("alice", "--plan", "starter")
    overridden = _setquota("alice", "--rpm", "10", "--input-tpm", "5000", "--output-tpm", "2000", "--concurrency",
                           "2", "--budget-tokens", "300")  # fmt: skip
    cleared = _setquota("alice", "--rpm", "none")

    assert with_plan["limits"] == {"rpm": 60, "input_tpm": None, "output_tpm": None, "concurrency": 4,
                                   "budget_tokens": 1_000_000}  # fmt: skip
    assert overridden["limits"] == {"rpm": 10, "input_tpm": 5000, "output_tpm": 2000, "concurrency": 2,
                                    "budget_tokens": 300}  # fmt: skip
    assert cleared["limits"]["rpm"] == 60
    # The change is seen by admission at once (the cached limits were dropped).
    assert limits_for(tenant_id=tenant.id, key_id=0).tenant["budget_tokens"] == 300


def test_setquota_on_a_key_and_its_errors(make_tenant, redis_client):
    tenant, _ = make_tenant("alice")
    key = tenant.api_keys.get()
    result = _setquota("alice", "--key", key.prefix, "--rpm", "3")
    assert result["key_limits"]["rpm"] == 3 and result["limits"]["rpm"] is None
    for args in (["nobody", "--rpm", "1"], ["alice", "--rpm", "-1"], ["alice", "--plan", "nope"],
                 ["alice", "--key", "nokey", "--rpm", "1"]):  # fmt: skip
        with pytest.raises((CommandError, SystemExit)):
            call_command("setquota", *args)


def test_a_plan_restricts_the_models_a_tenant_may_use(make_tenant, redis_client):
    from catalog.selectors import model_access_allowed
    from tenants.services import KeyPrincipal

    tenant, _ = make_tenant("alice")
    tenant_quota_set(tenant=tenant, plan=plan_create(name="small", allowed_models=["tiny-gemma4"]))
    limits = limits_for(tenant_id=tenant.id, key_id=0)
    principal = KeyPrincipal(key_id=0, tenant_id=tenant.id, tenant_name="alice", allowed_models=())
    assert model_access_allowed(principal=principal, limits=limits, model_id="tiny-gemma4")
    assert not model_access_allowed(principal=principal, limits=limits, model_id="gemma-4-e4b")


def test_the_reaper_settles_reservations_nobody_settled(make_tenant, redis_client):
    tenant, _ = make_tenant("alice")
    key_id = tenant.api_keys.get().id
    tenant_quota_set(tenant=tenant, concurrency=2, budget_tokens=1000)
    limits = limits_for(tenant_id=tenant.id, key_id=key_id)
    ran, _ = admit(limits, tenant, key_id, prompt=10, max_tokens=100)
    lost, _ = admit(limits, tenant, key_id, prompt=10, max_tokens=100)
    _, full = admit(limits, tenant, key_id)
    assert full.limit == "concurrency"
    UsageRecord.objects.create(request_id=ran, tenant=tenant, api_key_id=key_id, model="m", prompt_tokens=10,
                               completion_tokens=7, total_ms=1, finished_at="2026-01-01T00:00:00Z")  # fmt: skip
    # Both gateways crashed: their reservations' hold ran out.
    redis_client.zadd(RESERVATIONS, {ran: time.time() - 1, lost: time.time() - 1})

    assert quota_reap() == 2

    assert not redis_client.exists(resv_key(ran)) and not redis_client.exists(resv_key(lost))
    assert redis_client.zcard(f"{tenant_scope(tenant.id)}:conc") == 0
    budget_key = next(iter(redis_client.scan_iter(f"{tenant_scope(tenant.id)}:bud:*")))
    assert int(redis_client.get(budget_key)) == 17  # what ran, as the ledger has it; the lost one is free
    assert admit(limits, tenant, key_id, rid=f"cmpl-{uuid.uuid4().hex}")[1].max_tokens == 16
