"""The inference API's authentication reads the tenant's cached limits in the same round trip as the
key's record once the process has seen the key (gateway/auth.py); revocation and limit changes still
take effect on the next request."""

import pytest

from gateway import auth
from gateway.errors import Unauthorized
from quotas.services import tenant_quota_set
from tenants.services import apikey_revoke

pytestmark = pytest.mark.django_db


@pytest.fixture
def alice(make_tenant, redis_client, rf, monkeypatch):
    monkeypatch.setattr(auth, "_key_tenants", {})  # this process has seen no key yet
    tenant, key = make_tenant("alice")
    return tenant, rf.post("/v1/chat/completions", HTTP_AUTHORIZATION=f"Bearer {key}")


def test_a_known_keys_record_and_its_tenants_limits_are_one_round_trip(alice, redis_round_trips):
    tenant, request = alice
    first_principal, first_limits = auth.authenticate(request)  # fills both caches, learns the tenant
    warm = auth.authenticate(request)  # last_used is marked once a minute: only reads from here on
    redis_round_trips.clear()

    principal, limits = auth.authenticate(request)

    assert redis_round_trips == [1]  # one MGET
    assert principal == first_principal == warm[0] and principal.tenant_id == tenant.id
    assert limits == first_limits


def test_a_limit_changed_or_a_key_revoked_applies_to_the_next_request(alice, django_capture_on_commit_callbacks):
    tenant, request = alice
    assert auth.authenticate(request)[1].tenant["budget_tokens"] is None
    auth.authenticate(request)  # the tenant is known: its limits are read with the key's record

    with django_capture_on_commit_callbacks(execute=True):
        tenant_quota_set(tenant=tenant, budget_tokens=1000)  # clears the cached limits once committed
    assert auth.authenticate(request)[1].tenant["budget_tokens"] == 1000

    with django_capture_on_commit_callbacks(execute=True):
        apikey_revoke(api_key=tenant.api_keys.get())
    with pytest.raises(Unauthorized) as refused:
        auth.authenticate(request)
    assert refused.value.code == "invalid_api_key"
