"""The console's pages through Django's test client: access rules, keys, login throttling, CSRF."""

import datetime as dt
import os
import subprocess
import sys
import uuid

import pytest
from django.test import Client
from django.utils import timezone

from tests.console.conftest import OPERATOR_PASSWORD, TENANT_ADMIN_PASSWORD

pytestmark = pytest.mark.django_db


def _tenant_urls(name: str, key_id: int = 1) -> list[str]:
    base = f"/console/tenants/{name}"
    return [f"{base}/", f"{base}/keys/", f"{base}/usage/", f"{base}/keys/{key_id}/revoke/"]


def _record(tenant, api_key, *, minutes_ago: float = 1, ttft_ms=100, status="ok", model="tiny-gemma4", **fields):
    from ledger.models import UsageRecord

    return UsageRecord.objects.create(
        request_id=uuid.uuid4().hex,
        tenant=tenant,
        api_key=api_key,
        model=model,
        prompt_tokens=fields.get("prompt_tokens", 10),
        completion_tokens=fields.get("completion_tokens", 20),
        ttft_ms=ttft_ms,
        total_ms=500,
        decode_tokens_per_second=fields.get("decode_tokens_per_second", 50.0),
        status=status,
        finished_at=timezone.now() - dt.timedelta(minutes=minutes_ago),
    )


def test_anonymous_visitors_are_sent_to_the_login_page(client):
    response = client.get("/console/tenants/")
    assert response.status_code == 302
    assert response["Location"].startswith("/console/login/?next=")


def test_an_operator_sees_the_operator_pages(client, operator, tenants):
    client.force_login(operator)
    assert client.get("/console/").url == "/console/overview/"
    for url in ["/console/overview/", "/console/tenants/", "/console/usage/", "/console/tenants/new/"]:
        assert client.get(url).status_code == 200, url
    for url in _tenant_urls("alice")[:3]:
        assert client.get(url).status_code == 200, url


def test_a_tenant_admin_lands_on_their_own_tenant(client, tenant_admins):
    client.force_login(tenant_admins["alice"])
    assert client.get("/console/").url == "/console/tenants/alice/"
    for url in _tenant_urls("alice")[:3]:
        assert client.get(url).status_code == 200, url


def test_bob_never_sees_alices_pages(client, tenant_admins, tenants):
    from tenants.services import apikey_create

    alice_key, _ = apikey_create(tenant=tenants["alice"])
    client.force_login(tenant_admins["bob"])
    for url in _tenant_urls("alice", alice_key.id) + _tenant_urls("no-such-tenant"):
        assert client.get(url).status_code == 404, url
    # Not through his own tenant's URL either.
    assert client.get(f"/console/tenants/bob/keys/{alice_key.id}/revoke/").status_code == 404
    assert client.post(f"/console/tenants/bob/keys/{alice_key.id}/revoke/").status_code == 404
    alice_key.refresh_from_db()
    assert alice_key.revoked_at is None


def test_a_tenant_admin_gets_404_on_operator_pages(client, tenant_admins):
    client.force_login(tenant_admins["alice"])
    for url in ["/console/overview/", "/console/tenants/", "/console/usage/", "/console/tenants/new/"]:
        assert client.get(url).status_code == 404, url


def test_an_operator_creates_a_tenant(client, operator):
    from tenants.models import Tenant

    client.force_login(operator)
    response = client.post("/console/tenants/new/", {"name": "dave", "display_name": "Dave Ltd"})
    assert response.status_code == 302 and response.url == "/console/tenants/dave/keys/"
    assert Tenant.objects.get(name="dave").display_name == "Dave Ltd"
    assert "already exists" in client.post("/console/tenants/new/", {"name": "dave"}).content.decode()
    assert "reserved" in client.post("/console/tenants/new/", {"name": "new"}).content.decode()


def test_a_new_keys_secret_is_shown_once(client, tenant_admins, tenants):
    from tenants.models import ApiKey
    from tenants.services import apikey_authenticate

    client.force_login(tenant_admins["alice"])
    response = client.post("/console/tenants/alice/keys/", {"name": "ci", "is_admin": "on"})
    assert response.status_code == 200
    assert "no-store" in response["Cache-Control"]
    api_key = ApiKey.objects.get(tenant=tenants["alice"], name="ci")
    assert api_key.is_admin
    plaintext = response.context["plaintext"]
    assert plaintext in response.content.decode()
    assert apikey_authenticate(plaintext=plaintext).tenant_id == tenants["alice"].id

    listing = client.get("/console/tenants/alice/keys/").content.decode()
    assert api_key.prefix in listing
    assert plaintext not in listing
    assert plaintext.split("_")[2] not in listing


def test_revoking_a_key_in_the_console_stops_it(
    client, operator, tenants, redis_client, django_capture_on_commit_callbacks
):
    from tenants.services import AuthenticationFailed, apikey_authenticate, apikey_create

    api_key, plaintext = apikey_create(tenant=tenants["alice"])
    apikey_authenticate(plaintext=plaintext)  # cached in Redis now
    client.force_login(operator)
    confirm = client.get(f"/console/tenants/alice/keys/{api_key.id}/revoke/")
    assert api_key.prefix in confirm.content.decode()
    with django_capture_on_commit_callbacks(execute=True):  # the auth cache is purged on commit
        response = client.post(f"/console/tenants/alice/keys/{api_key.id}/revoke/")
    assert response.status_code == 302
    with pytest.raises(AuthenticationFailed, match="revoked"):
        apikey_authenticate(plaintext=plaintext)
    assert "revoked" in client.get("/console/tenants/alice/keys/").content.decode()


def test_an_operator_adds_a_tenant_admin_who_then_signs_in(client, operator, tenants, redis_client):
    client.force_login(operator)
    response = client.post("/console/tenants/bob/", {"username": "bob-ops", "password": "short"})
    assert "too short" in response.content.decode()
    response = client.post("/console/tenants/bob/", {"username": "bob-ops", "password": TENANT_ADMIN_PASSWORD})
    assert response.status_code == 302
    client.logout()
    response = client.post("/console/login/", {"username": "bob-ops", "password": TENANT_ADMIN_PASSWORD})
    assert response.status_code == 302
    assert client.get("/console/").url == "/console/tenants/bob/"


def test_login_is_rate_limited_per_address_and_username(client, operator, redis_client):
    for _ in range(5):
        response = client.post("/console/login/", {"username": "ops", "password": "wrong"})
        assert "Please enter a correct username and password" in response.content.decode()
    # The right password no longer helps until the window passes.
    response = client.post("/console/login/", {"username": "ops", "password": OPERATOR_PASSWORD})
    assert response.status_code == 200
    assert "Too many failed sign-in attempts" in response.content.decode()
    assert "_auth_user_id" not in client.session
    # Another username from the same address is still allowed.
    assert "Too many" not in client.post("/console/login/", {"username": "x", "password": "y"}).content.decode()
    redis_client.flushdb()
    assert client.post("/console/login/", {"username": "ops", "password": OPERATOR_PASSWORD}).status_code == 302


def test_a_user_without_tenant_or_staff_cannot_sign_in(client, django_user_model, redis_client):
    django_user_model.objects.create_user("nobody", password=OPERATOR_PASSWORD)
    response = client.post("/console/login/", {"username": "nobody", "password": OPERATOR_PASSWORD})
    assert "no access to the console" in response.content.decode()


def test_every_form_needs_a_csrf_token(operator, tenants, redis_client):
    client = Client(enforce_csrf_checks=True)
    assert client.post("/console/login/", {"username": "ops", "password": OPERATOR_PASSWORD}).status_code == 403
    client.force_login(operator)
    for url in ["/console/tenants/new/", "/console/tenants/alice/keys/", "/console/tenants/alice/", "/console/logout/"]:
        assert client.post(url, {"name": "x"}).status_code == 403, url
        page = client.get(url if url != "/console/logout/" else "/console/tenants/alice/keys/")
        assert 'name="csrfmiddlewaretoken"' in page.content.decode(), url


def test_tenant_search_and_pagination(client, operator):
    from tenants.models import Tenant

    Tenant.objects.bulk_create([Tenant(name=f"t-{i:04d}") for i in range(120)])
    client.force_login(operator)
    response = client.get("/console/tenants/", {"q": "t-01"})
    rows = response.context["rows"]
    assert [t.name for t, _ in rows] == [f"t-{i:04d}" for i in range(100, 120)]
    page3 = client.get("/console/tenants/", {"page": 3})
    assert page3.context["page"].number == 3 and len(page3.context["rows"]) == 20
    partial = client.get("/console/tenants/", {"q": "t-0119"}, headers={"HX-Request": "true"})
    assert "<html" not in partial.content.decode() and "t-0119" in partial.content.decode()


def test_usage_series_buckets_tokens_and_percentiles(tenants):
    from billing.services import rollup_refresh
    from console.selectors import period_get, usage_by_model, usage_series
    from tenants.services import apikey_create

    key, _ = apikey_create(tenant=tenants["alice"])
    bob_key, _ = apikey_create(tenant=tenants["bob"])
    for ttft in (100, 200, 300, 400):
        _record(tenants["alice"], key, minutes_ago=2, ttft_ms=ttft, completion_tokens=60)
    _record(tenants["alice"], key, minutes_ago=2, ttft_ms=None, status="error", completion_tokens=0)
    _record(tenants["alice"], key, minutes_ago=3 * 60)  # outside the hour
    _record(tenants["bob"], bob_key, minutes_ago=2)  # another tenant

    hour = period_get("1h")  # minute buckets, from the ledger
    series = usage_series(tenant=tenants["alice"], period=hour)
    assert len(series.labels) == 60 and series.total_requests == 5
    bucket = series.requests.index(5)
    assert series.output_tps[bucket] == pytest.approx(240 / 60, abs=1e-3)
    assert series.ttft_p50[bucket] == 250.0
    assert series.failed[bucket] == 1
    assert usage_series(tenant=None, period=hour).total_requests == 6

    day = period_get("24h")  # hourly buckets: totals from the rollups, percentiles from the ledger
    assert usage_series(tenant=tenants["alice"], period=day).total_requests == 0  # not rolled up yet
    rollup_refresh(since=timezone.now() - dt.timedelta(days=1))
    series = usage_series(tenant=tenants["alice"], period=day)
    assert len(series.labels) == 24 and series.total_requests == 6 and series.total_failed == 1
    assert sum(series.output_tps) == pytest.approx((240 + 20) / 3600, abs=1e-3)
    (row,) = usage_by_model(tenant=tenants["alice"], period=day)
    assert row["requests"] == 6 and row["failed_requests"] == 1 and row["failure_rate"] == pytest.approx(1 / 6)
    assert row["ttft_p50"] == 200.0  # of 100, 100, 200, 300, 400 (the failed request has no TTFT)


def test_the_usage_page_embeds_chart_data(client, tenant_admins, tenants):
    from catalog.models import ServedModel
    from tenants.services import apikey_create

    ServedModel.objects.create(model_id="tiny-gemma4", path="/m", pool="tiny", context_length=2048)
    key, _ = apikey_create(tenant=tenants["alice"])
    _record(tenants["alice"], key, minutes_ago=5, completion_tokens=600)
    _record(tenants["alice"], key, minutes_ago=5, model="other")
    client.force_login(tenant_admins["alice"])
    response = client.get("/console/tenants/alice/usage/", {"period": "1h", "model": "tiny-gemma4"})
    assert response.context["series"].total_requests == 1
    assert sum(response.context["chart_data"]["tokens"]["output"]) == pytest.approx(10.0)
    assert 'id="usage-data"' in response.content.decode()


def test_the_overview_reports_recent_rates(client, operator, tenants, redis_client):
    from tenants.services import apikey_create

    key, _ = apikey_create(tenant=tenants["alice"])
    for _ in range(3):
        _record(tenants["alice"], key, minutes_ago=1, prompt_tokens=300, completion_tokens=600)
    _record(tenants["alice"], key, minutes_ago=1, status="worker_lost")
    _record(tenants["alice"], key, minutes_ago=30)  # outside the window
    client.force_login(operator)
    overview = client.get("/console/overview/").context["overview"]
    assert overview.requests == 4 and overview.errors == 1
    assert overview.output_tokens_per_second == pytest.approx((1800 + 20) / 300, abs=0.1)
    assert [(row["tenant__name"], row["requests"]) for row in overview.top_tenants] == [("alice", 4)]


def test_check_deploy_is_clean_under_production_settings(tmp_path):
    env = dict(
        os.environ,
        DJANGO_DEBUG="0",
        SECRET_KEY="x" * 20 + uuid.uuid4().hex + uuid.uuid4().hex,
        ALLOWED_HOSTS="console.example.com",
        SECURE_HSTS_SECONDS="31536000",
        SECURE_HSTS_INCLUDE_SUBDOMAINS="1",
        SECURE_HSTS_PRELOAD="1",
        SECURE_SSL_REDIRECT="1",
    )
    env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    result = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout
