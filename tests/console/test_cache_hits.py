"""The console's prefix-cache figures: hit rates per model, pool, worker and tenant on the usage pages,
and a plan's cached-input price in its form."""

import datetime as dt
import uuid
from decimal import Decimal

import pytest
from django.utils import timezone

pytestmark = pytest.mark.django_db


@pytest.fixture
def cached_usage(tenants):
    from catalog.models import ServedModel
    from ledger.models import UsageRecord
    from tenants.services import apikey_create

    ServedModel.objects.create(model_id="tiny-gemma4", path="/models/tiny", pool="tiny", context_length=2048)
    for tenant, worker, prompt, cached in (("alice", "w1#aa", 400, 300), ("alice", "w2#bb", 100, 0),
                                           ("bob", "w2#bb", 500, 100)):  # fmt: skip
        key, _ = apikey_create(tenant=tenants[tenant])
        UsageRecord.objects.create(
            request_id=uuid.uuid4().hex, tenant=tenants[tenant], api_key=key, model="tiny-gemma4",
            prompt_tokens=prompt, cached_tokens=cached, completion_tokens=5, total_ms=100, worker=worker,
            finished_at=timezone.now() - dt.timedelta(minutes=2),
        )  # fmt: skip


def _rates(response, by: str) -> dict[str, float]:
    return {row[by]: row["hit_rate"] for row in response.context["cache_hits"][by]}


def test_an_operator_sees_hit_rates_per_pool_worker_and_tenant(client, operator, cached_usage):
    client.force_login(operator)
    response = client.get("/console/usage/", {"period": "1h"})
    assert response.status_code == 200
    assert _rates(response, "pool") == {"tiny": 0.4}
    assert _rates(response, "worker") == {"w1#aa": 0.75, "w2#bb": 100 / 600}
    assert _rates(response, "tenant") == {"alice": 0.6, "bob": 0.2}
    assert response.context["hit_rate"] == 0.4
    page = response.content.decode()
    assert 'data-testid="usage-hit-rate">40.0%' in page and "w1#aa" in page and "75.0%" in page


def test_a_tenant_admin_sees_their_own_hit_rate_and_no_worker(client, tenant_admins, cached_usage):
    client.force_login(tenant_admins["alice"])
    response = client.get("/console/tenants/alice/usage/", {"period": "1h"})
    assert response.status_code == 200
    assert set(response.context["cache_hits"]) == {"pool"}
    assert _rates(response, "pool") == {"tiny": 0.6}
    assert response.context["hit_rate"] == 0.6
    assert "w1#aa" not in response.content.decode()


def test_a_plans_cached_input_price_is_entered_in_usd_and_empty_means_the_input_price(client, operator):
    from quotas.models import Plan

    client.force_login(operator)
    form = {"name": "team", "price_input": "0.25", "price_output": "1.5", "reserved_fee": "0",
            "fair_share_weight": "1", "guaranteed_tokens_per_second": "0", "price_cached_input": "0.05"}  # fmt: skip
    assert client.post("/console/plans/new/", form).status_code == 302
    plan = Plan.objects.get(name="team")
    assert (plan.price_input_per_1m_micros, plan.price_cached_input_per_1m_micros) == (250_000, 50_000)
    assert "USD 0.05" in client.get("/console/plans/").content.decode()
    assert client.get("/console/plans/team/").context["form"]["price_cached_input"].value() == Decimal("0.05")
    assert client.post("/console/plans/team/", dict(form, price_cached_input="")).status_code == 302
    plan.refresh_from_db()
    assert plan.price_cached_input_per_1m_micros is None
