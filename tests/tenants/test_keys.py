"""API keys: shown once, stored as prefix + keyed digest, compared in constant time, revocable."""

import datetime as dt
import io

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from tenants.keys import key_digest, key_generate, key_prefix
from tenants.models import ApiKey, Tenant
from tenants.services import AuthenticationFailed, apikey_authenticate, apikey_create, apikey_revoke, tenant_create

pytestmark = pytest.mark.django_db


def test_a_generated_key_parses_back_to_its_prefix():
    new = key_generate()
    assert new.plaintext.startswith(f"gpk_{new.prefix}_")
    assert key_prefix(new.plaintext) == new.prefix
    assert new.digest == key_digest(new.plaintext)


@pytest.mark.parametrize(
    "garbage",
    [
        "",
        "gpk_",
        "sk-abc",
        "gpk_short_secret",
        "gpk_" + "a" * 12 + "_" + "é" * 40,
        "xyz_" + "a" * 12 + "_" + "b" * 40,
        "gpk_" + "a" * 12 + "_" + "b" * 39,
    ],
)
def test_malformed_keys_have_no_prefix(garbage):
    assert key_prefix(garbage) is None


def test_the_plaintext_is_never_stored(redis_client):
    tenant = tenant_create(name="alice")
    api_key, plaintext = apikey_create(tenant=tenant)
    secret = plaintext.rsplit("_", 1)[1]
    row = ApiKey.objects.values().get(id=api_key.id)
    assert all(secret not in str(value) for value in row.values())
    assert row["digest"] == key_digest(plaintext)


def test_a_key_authenticates_to_its_tenant(redis_client):
    alice = tenant_create(name="alice")
    _, plaintext = apikey_create(tenant=alice, allowed_models=["m1"])
    principal = apikey_authenticate(plaintext=plaintext)
    assert principal.tenant_id == alice.id and principal.tenant_name == "alice"
    assert principal.allowed_models == ("m1",)
    assert ApiKey.objects.get(id=principal.key_id).last_used_at is not None


def test_a_key_with_a_wrong_secret_is_refused(redis_client):
    _, plaintext = apikey_create(tenant=tenant_create(name="alice"))
    forged = plaintext[:-1] + ("A" if plaintext[-1] != "A" else "B")
    with pytest.raises(AuthenticationFailed):
        apikey_authenticate(plaintext=forged)


def test_it_refuses_a_revoked_key_even_when_cached(redis_client, django_capture_on_commit_callbacks):
    _, plaintext = apikey_create(tenant=tenant_create(name="alice"))
    apikey_authenticate(plaintext=plaintext)  # now cached in Redis
    api_key = ApiKey.objects.get(prefix=key_prefix(plaintext))
    # The cached record is cleared when the revocation commits (the test's transaction never does).
    with django_capture_on_commit_callbacks(execute=True):
        apikey_revoke(api_key=api_key)
    with pytest.raises(AuthenticationFailed, match="revoked"):
        apikey_authenticate(plaintext=plaintext)


def test_it_refuses_an_expired_key(redis_client):
    past = timezone.now() - dt.timedelta(seconds=1)
    _, plaintext = apikey_create(tenant=tenant_create(name="alice"), expires_at=past)
    with pytest.raises(AuthenticationFailed, match="expired"):
        apikey_authenticate(plaintext=plaintext)


def test_it_refuses_keys_of_a_suspended_tenant(redis_client):
    tenant = tenant_create(name="alice")
    _, plaintext = apikey_create(tenant=tenant)
    Tenant.objects.filter(id=tenant.id).update(is_active=False)
    with pytest.raises(AuthenticationFailed, match="suspended"):
        apikey_authenticate(plaintext=plaintext)


def test_unknown_keys_are_refused_and_negatively_cached(redis_client):
    unknown = key_generate().plaintext
    with pytest.raises(AuthenticationFailed):
        apikey_authenticate(plaintext=unknown)
    assert redis_client.get(f"auth:{key_prefix(unknown)}") == "missing"


def test_createkey_prints_the_key_as_its_last_line(redis_client):
    tenant_create(name="alice")
    out = io.StringIO()
    call_command("createkey", "alice", "--name", "ci", "--models", "a,b", stdout=out)
    plaintext = out.getvalue().strip().splitlines()[-1]
    principal = apikey_authenticate(plaintext=plaintext)
    assert principal.allowed_models == ("a", "b")


def test_revokekey_accepts_the_key_or_its_prefix(redis_client):
    _, plaintext = apikey_create(tenant=tenant_create(name="alice"))
    call_command("revokekey", key_prefix(plaintext), stdout=io.StringIO())
    assert ApiKey.objects.get(prefix=key_prefix(plaintext)).revoked_at is not None
    with pytest.raises(CommandError):
        call_command("revokekey", "nope", stdout=io.StringIO())


def test_createtenant_refuses_duplicates_unless_told_otherwise():
    call_command("createtenant", "alice", stdout=io.StringIO())
    with pytest.raises(CommandError, match="already exists"):
        call_command("createtenant", "alice", stdout=io.StringIO())
    call_command("createtenant", "alice", "--if-not-exists", stdout=io.StringIO())
    with pytest.raises(CommandError, match="name"):
        call_command("createtenant", "not a slug!", stdout=io.StringIO())
