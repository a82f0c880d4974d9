"""Adapters on the bill: usage and invoice lines name the adapter, plans price adapter tokens and
limit how many adapters a tenant keeps."""

import datetime as dt
import uuid

import pytest

from adapters.models import Adapter
from billing.services import invoice_build
from ledger.models import UsageRecord
from quotas.limits import Period
from quotas.services import plan_create, tenant_quota_set
from tests.adapters.conftest import BASE
from tests.adapters.test_adapters_api import upload

pytestmark = pytest.mark.django_db

LAST_MONTH = Period.containing(Period.current().start - dt.timedelta(days=1))


def _usage(tenant, model: str, prompt: int, completion: int) -> None:
    UsageRecord.objects.create(
        request_id=f"chatcmpl-{uuid.uuid4().hex}", tenant=tenant, api_key=tenant.api_keys.first(), model=model,
        prompt_tokens=prompt, completion_tokens=completion, total_ms=100, finished_at=LAST_MONTH.start,
    )  # fmt: skip


def test_adapter_tokens_have_their_own_invoice_lines_at_the_plans_adapter_prices(people):
    alice = people["alice"].tenant
    plan = plan_create(
        name="tuned", price_input_per_1m_micros=100_000, price_output_per_1m_micros=200_000,
        price_adapter_input_per_1m_micros=150_000, price_adapter_output_per_1m_micros=400_000,
    )  # fmt: skip
    tenant_quota_set(tenant=alice, plan=plan)
    _usage(alice, BASE, 1_000_000, 1_000_000)
    _usage(alice, f"{BASE}:support-bot", 2_000_000, 1_000_000)

    lines = {(line.model, line.kind): line for line in invoice_build(tenant=alice, period=LAST_MONTH).lines.all()}
    assert lines[(BASE, "input_tokens")].amount_micros == 100_000
    assert lines[(BASE, "output_tokens")].amount_micros == 200_000
    tuned_in, tuned_out = (
        lines[(f"{BASE}:support-bot", "input_tokens")],
        lines[(f"{BASE}:support-bot", "output_tokens")],
    )
    assert (tuned_in.quantity, tuned_in.unit_price_micros, tuned_in.amount_micros) == (2_000_000, 150_000, 300_000)
    assert (tuned_out.unit_price_micros, tuned_out.amount_micros) == (400_000, 400_000)
    assert "support-bot" in tuned_in.description


def test_without_adapter_prices_adapter_tokens_cost_what_base_tokens_cost(people):
    alice = people["alice"].tenant
    tenant_quota_set(tenant=alice, plan=plan_create(name="flat", price_input_per_1m_micros=100_000))
    _usage(alice, f"{BASE}:support-bot", 1_000_000, 0)
    line = invoice_build(tenant=alice, period=LAST_MONTH).lines.get(kind="input_tokens")
    assert (line.unit_price_micros, line.amount_micros) == (100_000, 100_000)


def test_a_plan_limits_the_number_of_adapters_a_tenant_keeps(client, people, store_dir):
    alice, bob = people["alice"], people["bob"]
    tenant_quota_set(tenant=alice.tenant, plan=plan_create(name="one-adapter", max_adapters=1))
    assert upload(client, alice.admin_key, "alice", name="first").status_code == 201
    refused = upload(client, alice.admin_key, "alice", name="second")
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "adapter_limit_reached"
    assert upload(client, bob.admin_key, "bob", name="first").status_code == 201  # bob's plan sets no limit
    assert upload(client, bob.admin_key, "bob", name="second").status_code == 201
    assert Adapter.objects.filter(tenant=alice.tenant).count() == 1
