"""Plans, limits, invoices, key rotation and the throttling view (issue 3's models behind the console)."""

import datetime as dt
import json
import uuid

import pytest
from django.utils import timezone

pytestmark = pytest.mark.django_db


@pytest.fixture
def pro_plan(db):
    from quotas.services import plan_create

    return plan_create(name="pro", display_name="Pro", rpm=600, budget_tokens=1_000_000,
                       price_input_per_1m_micros=150_000, price_output_per_1m_micros=600_000)  # fmt: skip


def test_an_operator_creates_and_edits_a_plan_in_usd(client, operator):
    from quotas.models import Plan

    client.force_login(operator)
    form = {"name": "team", "display_name": "Team", "rpm": "120", "price_input": "0.25", "price_output": "1.5",
            "reserved_fee": "0", "fair_share_weight": "2", "guaranteed_tokens_per_second": "0"}  # fmt: skip
    assert client.post("/console/plans/new/", form).status_code == 302
    plan = Plan.objects.get(name="team")
    assert (plan.rpm, plan.price_input_per_1m_micros, plan.price_output_per_1m_micros) == (120, 250_000, 1_500_000)
    assert plan.input_tpm is None and plan.fair_share_weight == 2
    response = client.post("/console/plans/team/", dict(form, rpm="", name="renamed"))
    assert response.status_code == 302
    plan.refresh_from_db()
    assert plan.rpm is None and plan.name == "team"  # the name cannot change
    assert "Team" in client.get("/console/plans/").content.decode()


def test_an_operator_sets_a_tenants_plan_and_overrides(
    client, operator, tenants, pro_plan, redis_client, django_capture_on_commit_callbacks
):
    from quotas.limits import limits_for

    client.force_login(operator)
    assert "no plan" in client.get("/console/tenants/alice/limits/").content.decode()
    with django_capture_on_commit_callbacks(execute=True):  # the cached limits are dropped on commit
        response = client.post("/console/tenants/alice/limits/", {"plan": pro_plan.id, "rpm": "30"})
    assert response.status_code == 302
    limits = limits_for(tenant_id=tenants["alice"].id, key_id=0)
    assert limits.tenant["rpm"] == 30 and limits.tenant["budget_tokens"] == 1_000_000
    page = client.get("/console/tenants/alice/limits/").content.decode()
    assert "Pro" in page and "1,000,000" in page


def test_a_tenant_admin_sees_limits_but_cannot_change_them(client, tenant_admins, tenants, pro_plan):
    from quotas.services import tenant_quota_set

    tenant_quota_set(tenant=tenants["alice"], plan=pro_plan)
    client.force_login(tenant_admins["alice"])
    response = client.get("/console/tenants/alice/limits/")
    assert response.status_code == 200 and response.context["form"] is None
    client.post("/console/tenants/alice/limits/", {"plan": "", "rpm": "999999"})
    assert tenants["alice"].quota.rpm is None
    assert client.get("/console/tenants/bob/limits/").status_code == 404


def test_rotating_a_key_shows_the_new_secret_once_and_retires_the_old(client, tenant_admins, tenants):
    from tenants.services import apikey_authenticate, apikey_create

    old, old_plaintext = apikey_create(tenant=tenants["alice"], name="prod")
    client.force_login(tenant_admins["alice"])
    response = client.post(f"/console/tenants/alice/keys/{old.id}/rotate/", {"grace_seconds": "3600"})
    assert response.status_code == 200 and "no-store" in response["Cache-Control"]
    new_plaintext = response.context["plaintext"]
    assert new_plaintext != old_plaintext and new_plaintext in response.content.decode()
    assert apikey_authenticate(plaintext=new_plaintext).tenant_id == tenants["alice"].id
    old.refresh_from_db()
    assert old.revoked_at > timezone.now() + dt.timedelta(minutes=59)  # still usable during the grace period
    assert new_plaintext not in client.get("/console/tenants/alice/keys/").content.decode()
    client.force_login(tenant_admins["bob"])
    assert client.post(f"/console/tenants/alice/keys/{old.id}/rotate/", {"grace_seconds": "0"}).status_code == 404


def test_invoices_are_listed_per_tenant_and_downloadable(client, operator, tenant_admins, tenants, pro_plan):
    from core.periods import Period
    from ledger.models import UsageRecord
    from quotas.services import tenant_quota_set
    from tenants.services import apikey_create

    tenant_quota_set(tenant=tenants["alice"], plan=pro_plan)
    key, _ = apikey_create(tenant=tenants["alice"])
    UsageRecord.objects.create(request_id=uuid.uuid4().hex, tenant=tenants["alice"], api_key=key, model="m",
                               prompt_tokens=2_000_000, completion_tokens=1_000_000, total_ms=1,
                               finished_at=timezone.now())  # fmt: skip
    period = Period.current().id
    client.force_login(tenant_admins["alice"])
    assert client.post("/console/tenants/alice/invoices/", {"period": period}).status_code == 404  # operators only
    client.force_login(operator)
    response = client.post("/console/tenants/alice/invoices/", {"period": period})
    number = f"alice-{period}"
    assert response.status_code == 302 and response.url == f"/console/tenants/alice/invoices/{number}/"
    page = client.get(response.url).content.decode()
    assert "USD 0.90" in page  # 2M input x 0.15 + 1M output x 0.60
    assert number in client.get("/console/invoices/").content.decode()

    client.force_login(tenant_admins["alice"])
    csv = client.get(f"/console/tenants/alice/invoices/{number}/", {"format": "csv"})
    assert csv["Content-Type"] == "text/csv" and "900000" in csv.content.decode()
    client.force_login(tenant_admins["bob"])
    assert client.get(f"/console/tenants/alice/invoices/{number}/").status_code == 404
    assert client.get(f"/console/tenants/bob/invoices/{number}/").status_code == 404


def test_a_request_admission_refuses_is_listed_for_its_tenant_only(
    client, tenant_admins, tenants, redis_client, django_capture_on_commit_callbacks
):
    from catalog.models import ServedModel
    from gateway.errors import RateLimited
    from quotas.gate import admission_gate
    from quotas.limits import limits_for
    from quotas.services import tenant_quota_set
    from tenants.services import apikey_authenticate, apikey_create

    key, plaintext = apikey_create(tenant=tenants["alice"])
    with django_capture_on_commit_callbacks(execute=True):
        tenant_quota_set(tenant=tenants["alice"], rpm=1)
    principal = apikey_authenticate(plaintext=plaintext)
    limits = limits_for(tenant_id=principal.tenant_id, key_id=principal.key_id)
    model = ServedModel(model_id="tiny-gemma4", path="/models/tiny", pool="tiny")

    def admit():
        return admission_gate(
            principal=principal, limits=limits, model=model, request_id=f"chatcmpl-{uuid.uuid4().hex}",
            prompt_tokens=5, max_tokens=5, implicit_max_tokens=False, ready_workers={},
        )  # fmt: skip

    admit()  # the minute's one request
    with pytest.raises(RateLimited) as refused:
        admit()
    assert refused.value.headers["x-ratelimit-exceeded"] == "requests"

    client.force_login(tenant_admins["alice"])
    response = client.get("/console/tenants/alice/throttling/")
    (event,) = response.context["events"]
    retry_after = int(refused.value.headers["Retry-After"])
    assert (event.key, event.limit, event.code, event.retry_after) == (key.prefix, "requests", "rate_limit_exceeded",
                                                                      retry_after)  # fmt: skip
    assert "requests per minute (RPM)" in response.content.decode()
    client.force_login(tenant_admins["bob"])
    assert client.get("/console/tenants/bob/throttling/").context["events"] == []
    assert client.get("/console/tenants/alice/throttling/").status_code == 404
    assert json.loads(redis_client.lindex(f"console:throttled:{tenants['alice'].id}", 0))["key"] == key.prefix


def test_a_tenant_admin_restricts_one_of_their_keys(
    client, tenant_admins, tenants, redis_client, django_capture_on_commit_callbacks
):
    from quotas.limits import limits_for
    from tenants.services import apikey_create

    key, _ = apikey_create(tenant=tenants["alice"], name="batch")
    client.force_login(tenant_admins["alice"])
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(f"/console/tenants/alice/keys/{key.id}/limits/", {"rpm": "5", "concurrency": "2"})
    assert response.status_code == 302
    own = limits_for(tenant_id=tenants["alice"].id, key_id=key.id).key
    assert own["rpm"] == 5 and own["concurrency"] == 2 and own["input_tpm"] is None
    assert key.prefix in client.get("/console/tenants/alice/limits/").content.decode()
    client.force_login(tenant_admins["bob"])
    assert client.post(f"/console/tenants/alice/keys/{key.id}/limits/", {"rpm": "0"}).status_code == 404
    assert client.post(f"/console/tenants/bob/keys/{key.id}/limits/", {"rpm": "0"}).status_code == 404


def test_usage_the_ledger_refused_is_listed_for_operators_only(client, operator, tenant_admins, tenants, redis_client):
    from contract.protocol import Usage
    from ledger.services import LEDGER_REJECTED

    refused = Usage(request_id="chatcmpl-refused-1", tenant_id=tenants["alice"].id, key_id=4242, model="tiny-gemma4",
                    prompt_tokens=12, completion_tokens=34, finished_at=timezone.now().timestamp())  # fmt: skip
    redis_client.hset(LEDGER_REJECTED, refused.request_id, refused.dumps())

    client.force_login(operator)
    page = client.get("/console/invoices/").content.decode()
    assert "Usage the ledger refused" in page and "chatcmpl-refused-1" in page and "alice" in page

    client.force_login(tenant_admins["alice"])
    assert client.get("/console/invoices/").status_code in (302, 403, 404)
