"""Three tenants (alice, bob, charlie), each with an admin key, a plain key, a plan, usage and an invoice;
and an operator (staff user with a staff token)."""

import datetime as dt
import uuid
from dataclasses import dataclass

import pytest

from billing.services import invoice_build
from core.periods import Period
from ledger.models import UsageRecord
from management.authentication import staff_token_create
from quotas.services import plan_create, tenant_quota_set
from tenants.services import apikey_create, tenant_create


@dataclass
class World:
    tenant: object
    admin_key: str
    admin_prefix: str
    plain_key: str
    plain_prefix: str
    plan: str
    invoice: str


@pytest.fixture
def world(db, redis_client):
    worlds = {}
    last_month = Period.containing(Period.current().start - dt.timedelta(days=1))
    for name in ("alice", "bob", "charlie"):
        tenant = tenant_create(name=name)
        admin, admin_plain = apikey_create(tenant=tenant, name="admin", is_admin=True)
        plain, plain_plain = apikey_create(tenant=tenant, name="app")
        plan = plan_create(name=f"plan-{name}", rpm=100, price_input_per_1m_micros=100, price_output_per_1m_micros=200)
        tenant_quota_set(tenant=tenant, plan=plan)
        UsageRecord.objects.create(
            request_id=f"chatcmpl-{uuid.uuid4().hex}", tenant=tenant, api_key=plain, model="tiny-gemma4",
            prompt_tokens=11, completion_tokens=22, total_ms=500, ttft_ms=50, finished_at=last_month.start,
        )  # fmt: skip
        invoice = invoice_build(tenant=tenant, period=last_month)
        worlds[name] = World(tenant, admin_plain, admin.prefix, plain_plain, plain.prefix, plan.name, invoice.number)
    return worlds


@pytest.fixture
def operator_token(db, django_user_model):
    user = django_user_model.objects.create_user("ops", password="a-long-password-1", is_staff=True)
    _, plaintext = staff_token_create(user=user, name="ci")
    return plaintext


def call(client, method: str, url: str, token: str | None = None, body: dict | None = None):
    headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"} if token else {}
    return getattr(client, method.lower())(url, data=body or {}, content_type="application/json", **headers)
