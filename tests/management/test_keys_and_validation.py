"""Key lifecycle through the API (secret shown once, revoke, rotate with grace) and input validation."""

import pytest

from tests.management.conftest import call

pytestmark = pytest.mark.django_db(transaction=True)

BASE = "/api/v1"


def _models(client, key):
    return call(client, "GET", "/v1/models", key).status_code


def test_a_created_key_shows_its_secret_once_and_works(client, world):
    alice = world["alice"]
    created = call(client, "POST", f"{BASE}/tenants/alice/keys/", alice.admin_key, {"name": "svc"}).json()
    listed = call(client, "GET", f"{BASE}/tenants/alice/keys/", alice.admin_key).json()
    detail = call(client, "GET", f"{BASE}/tenants/alice/keys/{created['prefix']}/", alice.admin_key).json()

    assert created["key"].startswith(f"gpk_{created['prefix']}_")
    assert all("key" not in row for row in listed) and "key" not in detail
    assert {"prefix", "last_used_at"} <= set(listed[0])
    assert _models(client, created["key"]) == 200
    after_use = call(client, "GET", f"{BASE}/tenants/alice/keys/{created['prefix']}/", alice.admin_key).json()
    assert after_use["last_used_at"] is not None


def test_a_revoked_key_stops_working_at_once(client, world):
    alice = world["alice"]
    assert _models(client, alice.plain_key) == 200  # now in the Redis auth cache
    call(client, "POST", f"{BASE}/tenants/alice/keys/{alice.plain_prefix}/revoke/", alice.admin_key)
    assert _models(client, alice.plain_key) == 401


def test_rotation_keeps_both_keys_working_for_the_grace_period(client, world, clock):
    alice = world["alice"]
    assert _models(client, alice.plain_key) == 200
    rotated = call(client, "POST", f"{BASE}/tenants/alice/keys/{alice.plain_prefix}/rotate/", alice.admin_key,
                   {"grace_seconds": 60}).json()  # fmt: skip

    assert rotated["replaces"]["prefix"] == alice.plain_prefix and rotated["name"] == "app"
    assert _models(client, rotated["key"]) == 200 and _models(client, alice.plain_key) == 200
    clock.advance(60)
    assert _models(client, alice.plain_key) == 401
    assert _models(client, rotated["key"]) == 200


@pytest.mark.parametrize(
    ("method", "url", "body", "param"),
    [
        ("POST", "/tenants/", {"name": "Not A Slug!"}, "name"),
        ("POST", "/tenants/", {"name": "dave", "is_active": False, "created_at": "2020-01-01"}, "created_at"),
        ("POST", "/tenants/alice/keys/", {"tenant": "bob"}, "tenant"),
        ("POST", "/tenants/alice/keys/", {"name": "x", "last_used_at": "2020-01-01T00:00:00Z"}, "last_used_at"),
        ("PATCH", "/tenants/alice/quota/", {"rpm": -1}, "rpm"),
        ("PATCH", "/tenants/alice/quota/", {"plan": "no-such-plan"}, "plan"),
        ("PATCH", "/tenants/alice/", {"total_micros": 0}, "total_micros"),
        ("POST", "/plans/", {"name": "gold", "fair_share_weight": 0}, "fair_share_weight"),
        ("POST", "/tenants/alice/invoices/", {"period": "November"}, "period"),
        ("GET", "/tenants/alice/usage/?granularity=week", None, "granularity"),
    ],
)
def test_invalid_input_is_a_400_naming_the_field(client, world, operator_token, method, url, body, param):
    response = call(client, method, f"{BASE}{url}", operator_token, body)
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and param in error["message"]


def test_operators_manage_plans_and_quotas(client, world, operator_token):
    plan = call(client, "POST", f"{BASE}/plans/", operator_token, {
        "name": "gold", "rpm": 600, "input_tpm": 100_000, "output_tpm": 50_000, "concurrency": 16,
        "budget_tokens": 10_000_000, "price_input_per_1m_micros": 150_000, "price_output_per_1m_micros": 600_000,
        "fair_share_weight": 4, "guaranteed_tokens_per_second": 200, "reserved_throughput_fee_micros": 99_000_000,
    })  # fmt: skip
    assert plan.status_code == 201, plan.content
    quota = call(client, "PATCH", f"{BASE}/tenants/bob/quota/", operator_token, {"plan": "gold", "rpm": 30})
    body = quota.json()
    assert body["plan"] == "gold" and body["overrides"]["rpm"] == 30
    assert body["effective"]["rpm"] == 30 and body["effective"]["concurrency"] == 16
    cleared = call(client, "PATCH", f"{BASE}/tenants/bob/quota/", operator_token, {"rpm": None}).json()
    assert cleared["effective"]["rpm"] == 600
    assert call(client, "POST", f"{BASE}/plans/", operator_token, {"name": "gold"}).status_code == 409


def test_the_schema_and_docs_are_served(client, world):
    schema = client.get(f"{BASE}/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert schema.status_code == 200
    paths = schema.json()["paths"]
    assert "/api/v1/tenants/{tenant}/keys/{prefix}/rotate/" in paths and "/api/v1/tenants/{tenant}/usage/" in paths
    docs = client.get(f"{BASE}/docs/")
    assert docs.status_code == 200 and b"swagger" in docs.content.lower()


def test_a_rotated_key_keeps_its_own_limits(client, world):
    alice = world["alice"]
    call(client, "PATCH", f"{BASE}/tenants/alice/keys/{alice.plain_prefix}/quota/", alice.admin_key, {"rpm": 7})
    rotated = call(client, "POST", f"{BASE}/tenants/alice/keys/{alice.plain_prefix}/rotate/", alice.admin_key).json()
    limits = call(client, "GET", f"{BASE}/tenants/alice/keys/{rotated['prefix']}/quota/", alice.admin_key).json()
    assert limits["rpm"] == 7
