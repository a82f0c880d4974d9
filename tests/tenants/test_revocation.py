"""Revocation: one service for every path (REST API, console, CLI, Django admin), effective for every
request that starts after it returns, however it races the Redis-cached key lookup."""

import datetime as dt
import io

import pytest
from django.core.management import call_command
from django.utils import timezone

from tenants import services
from tenants.keys import key_prefix
from tenants.models import ApiKey
from tenants.services import AuthenticationFailed, apikey_authenticate, apikey_create, apikey_revoke, apikey_rotate

pytestmark = pytest.mark.django_db


@pytest.fixture
def alice(db, redis_client):
    return services.tenant_create(name="alice")


@pytest.fixture
def operator(django_user_model):
    return django_user_model.objects.create_superuser("root", password="root-pass-9f3a", email="root@example.com")


def _in_grace(tenant, django_capture_on_commit_callbacks):
    """A key rotated with an hour of grace, its record cached in Redis: (old row, old plaintext)."""
    old, old_plaintext = apikey_create(tenant=tenant, name="app")
    with django_capture_on_commit_callbacks(execute=True):
        apikey_rotate(api_key=old, grace_seconds=3600)
    apikey_authenticate(plaintext=old_plaintext)  # works during the grace, and is cached now
    return ApiKey.objects.get(pk=old.pk), old_plaintext


# -- one service -----------------------------------------------------------------------------------
def test_revoking_a_key_in_its_grace_period_revokes_it_now(alice, django_capture_on_commit_callbacks):
    old, plaintext = _in_grace(alice, django_capture_on_commit_callbacks)
    with django_capture_on_commit_callbacks(execute=True):
        assert apikey_revoke(api_key=old) is True
    assert old.revoked_at <= timezone.now()
    with pytest.raises(AuthenticationFailed, match="revoked"):
        apikey_authenticate(plaintext=plaintext)


def test_revoking_a_key_revoked_in_the_past_keeps_its_revocation_time(alice):
    api_key, _ = apikey_create(tenant=alice)
    past = timezone.now() - dt.timedelta(days=1)
    ApiKey.objects.filter(pk=api_key.pk).update(revoked_at=past)
    assert apikey_revoke(api_key=api_key) is False
    assert api_key.revoked_at == past == ApiKey.objects.get(pk=api_key.pk).revoked_at


def test_the_console_revokes_a_key_in_its_grace_period(client, alice, operator, django_capture_on_commit_callbacks):
    old, plaintext = _in_grace(alice, django_capture_on_commit_callbacks)
    client.force_login(operator)
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(f"/console/tenants/alice/keys/{old.id}/revoke/")
    assert response.status_code == 302
    with pytest.raises(AuthenticationFailed, match="revoked"):
        apikey_authenticate(plaintext=plaintext)


def test_revokekey_revokes_a_key_in_its_grace_period(alice, django_capture_on_commit_callbacks):
    old, plaintext = _in_grace(alice, django_capture_on_commit_callbacks)
    out = io.StringIO()
    with django_capture_on_commit_callbacks(execute=True):
        call_command("revokekey", old.prefix, stdout=out)
    assert "revoked key" in out.getvalue()
    with pytest.raises(AuthenticationFailed, match="revoked"):
        apikey_authenticate(plaintext=plaintext)


def test_revokekey_says_when_a_key_was_already_revoked(alice, django_capture_on_commit_callbacks):
    api_key, _ = apikey_create(tenant=alice)
    with django_capture_on_commit_callbacks(execute=True):
        apikey_revoke(api_key=api_key)
    out = io.StringIO()
    call_command("revokekey", api_key.prefix, stdout=out)
    assert "already revoked" in out.getvalue()


# -- Django admin ----------------------------------------------------------------------------------
def _admin_key_form(api_key: ApiKey, **changes) -> dict:
    def split(value):
        return (f"{value:%Y-%m-%d}", f"{value:%H:%M:%S}") if value else ("", "")

    fields = {
        "tenant": api_key.tenant_id,
        "name": api_key.name,
        "allowed_models": "[]",
        "expires_at": api_key.expires_at,
        "revoked_at": api_key.revoked_at,
        **changes,
    }
    form = {name: value for name, value in fields.items() if name not in ("expires_at", "revoked_at")}
    for name in ("expires_at", "revoked_at"):
        form[f"{name}_0"], form[f"{name}_1"] = split(fields[name])
    if api_key.is_admin:
        form["is_admin"] = "on"
    return form


def test_the_admin_revokes_keys_in_their_grace_period_with_an_action(
    client, alice, operator, django_capture_on_commit_callbacks
):
    old, plaintext = _in_grace(alice, django_capture_on_commit_callbacks)
    client.force_login(operator)
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(
            "/admin/tenants/apikey/", {"action": "revoke_now", "_selected_action": [old.pk]}, follow=True
        )
    assert response.status_code == 200
    assert ApiKey.objects.get(pk=old.pk).revoked_at <= timezone.now()
    with pytest.raises(AuthenticationFailed, match="revoked"):
        apikey_authenticate(plaintext=plaintext)


def test_editing_a_key_in_the_admin_clears_its_cached_record(
    client, alice, operator, django_capture_on_commit_callbacks
):
    api_key, plaintext = apikey_create(tenant=alice, allowed_models=["m1"])
    assert apikey_authenticate(plaintext=plaintext).allowed_models == ("m1",)  # cached
    client.force_login(operator)
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(f"/admin/tenants/apikey/{api_key.pk}/change/", _admin_key_form(api_key))
    assert response.status_code == 302, response.content.decode()[:2000]
    assert apikey_authenticate(plaintext=plaintext).allowed_models == ()

    past = timezone.now() - dt.timedelta(minutes=1)
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(f"/admin/tenants/apikey/{api_key.pk}/change/", _admin_key_form(api_key, revoked_at=past))
    assert response.status_code == 302
    with pytest.raises(AuthenticationFailed, match="revoked"):
        apikey_authenticate(plaintext=plaintext)


def test_deleting_a_key_in_the_admin_clears_its_cached_record(
    client, alice, operator, django_capture_on_commit_callbacks
):
    api_key, plaintext = apikey_create(tenant=alice)
    apikey_authenticate(plaintext=plaintext)
    client.force_login(operator)
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(f"/admin/tenants/apikey/{api_key.pk}/delete/", {"post": "yes"})
    assert response.status_code == 302
    with pytest.raises(AuthenticationFailed, match="Incorrect"):
        apikey_authenticate(plaintext=plaintext)


def test_deactivating_a_tenant_in_the_admin_clears_its_keys_cached_records(
    client, alice, operator, django_capture_on_commit_callbacks
):
    keys = [apikey_create(tenant=alice)[1] for _ in range(2)]
    for plaintext in keys:
        apikey_authenticate(plaintext=plaintext)
    _, bobs_key = apikey_create(tenant=services.tenant_create(name="bob"))
    apikey_authenticate(plaintext=bobs_key)
    client.force_login(operator)
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(
            f"/admin/tenants/tenant/{alice.pk}/change/", {"name": "alice", "display_name": "Alice"}
        )  # is_active unticked
    assert response.status_code == 302
    for plaintext in keys:
        with pytest.raises(AuthenticationFailed, match="suspended"):
            apikey_authenticate(plaintext=plaintext)
    assert apikey_authenticate(plaintext=bobs_key).tenant_name == "bob"


# -- the lookup racing a revocation ----------------------------------------------------------------
def test_a_lookup_racing_a_revocation_cannot_cache_the_key_as_valid(
    alice, monkeypatch, django_capture_on_commit_callbacks
):
    """The lookup reads the row before the revocation commits and writes the cache after the
    revocation has cleared it: the stale record must not be written back."""
    api_key, plaintext = apikey_create(tenant=alice)
    read_row = services._key_record_from_db

    def read_then_revoke(prefix):
        record = read_row(prefix)  # still valid: read before the revocation
        with django_capture_on_commit_callbacks(execute=True):
            apikey_revoke(api_key=ApiKey.objects.get(pk=api_key.pk))
        return record

    monkeypatch.setattr(services, "_key_record_from_db", read_then_revoke)
    apikey_authenticate(plaintext=plaintext)  # authenticated before the revocation returned
    monkeypatch.setattr(services, "_key_record_from_db", read_row)

    with pytest.raises(AuthenticationFailed, match="revoked"):
        apikey_authenticate(plaintext=plaintext)


def test_a_lookup_that_did_not_race_a_revocation_is_cached(alice, redis_client):
    _, plaintext = apikey_create(tenant=alice)
    apikey_authenticate(plaintext=plaintext)
    assert redis_client.get(f"auth:{key_prefix(plaintext)}") is not None
