"""Who may see what: the cross-tenant access matrix over every management endpoint."""

import pytest

from tests.management.conftest import call

pytestmark = pytest.mark.django_db

BASE = "/api/v1"


def endpoints(w):
    """Every tenant-scoped endpoint, for the world `w` of one tenant: (method, url, body)."""
    t, k, i = w.tenant.name, w.plain_prefix, w.invoice
    return [
        ("GET", f"{BASE}/tenants/{t}/", None),
        ("PATCH", f"{BASE}/tenants/{t}/", {"display_name": "x"}),
        ("GET", f"{BASE}/tenants/{t}/quota/", None),
        ("PATCH", f"{BASE}/tenants/{t}/quota/", {"rpm": 1}),
        ("GET", f"{BASE}/tenants/{t}/keys/", None),
        ("POST", f"{BASE}/tenants/{t}/keys/", {"name": "new"}),
        ("GET", f"{BASE}/tenants/{t}/keys/{k}/", None),
        ("GET", f"{BASE}/tenants/{t}/keys/{k}/quota/", None),
        ("PATCH", f"{BASE}/tenants/{t}/keys/{k}/quota/", {"rpm": 1}),
        ("POST", f"{BASE}/tenants/{t}/keys/{k}/rotate/", {"grace_seconds": 60}),
        ("POST", f"{BASE}/tenants/{t}/keys/{k}/revoke/", None),
        ("GET", f"{BASE}/tenants/{t}/usage/", None),
        ("GET", f"{BASE}/tenants/{t}/invoices/", None),
        ("POST", f"{BASE}/tenants/{t}/invoices/", {"period": "2026-01"}),
        ("GET", f"{BASE}/tenants/{t}/invoices/{i}/", None),
        ("GET", f"{BASE}/tenants/{t}/invoices/{i}/csv/", None),
        ("POST", f"{BASE}/tenants/{t}/invoices/{i}/close/", None),
        ("GET", f"{BASE}/plans/{w.plan}/", None),
        ("PATCH", f"{BASE}/plans/{w.plan}/", {"rpm": 1}),
    ]


@pytest.mark.parametrize("stranger", ["bob", "charlie"])
def test_a_tenant_admin_gets_404_for_every_endpoint_of_another_tenant(client, world, stranger):
    alice = world["alice"]
    for method, url, body in endpoints(world[stranger]):
        response = call(client, method, url, alice.admin_key, body)
        assert response.status_code == 404, (method, url, response.status_code, response.content)
        assert response.json()["error"]["type"] == "invalid_request_error"


def test_a_tenant_admin_gets_404_for_a_foreign_object_under_its_own_tenant(client, world):
    alice, bob = world["alice"], world["bob"]
    for url in (
        f"{BASE}/tenants/alice/keys/{bob.plain_prefix}/",
        f"{BASE}/tenants/alice/keys/{bob.plain_prefix}/quota/",
        f"{BASE}/tenants/alice/invoices/{bob.invoice}/",
        f"{BASE}/tenants/alice/invoices/{bob.invoice}/csv/",
        f"{BASE}/tenants/alice/usage/?key={bob.plain_prefix}",
    ):
        assert call(client, "GET", url, alice.admin_key).status_code == 404, url
    assert (
        call(client, "POST", f"{BASE}/tenants/alice/keys/{bob.plain_prefix}/revoke/", alice.admin_key).status_code
        == 404
    )
    assert bob.tenant.api_keys.get(prefix=bob.plain_prefix).revoked_at is None


def test_a_tenant_admin_works_on_its_own_tenant_and_cannot_change_operator_fields(client, world):
    alice = world["alice"]
    for method, url, body in endpoints(alice):
        response = call(client, method, url, alice.admin_key, body)
        operator_only = (method, url) in {
            ("PATCH", f"{BASE}/tenants/alice/"),
            ("PATCH", f"{BASE}/tenants/alice/quota/"),
            ("POST", f"{BASE}/tenants/alice/invoices/"),
            ("POST", f"{BASE}/tenants/alice/invoices/{alice.invoice}/close/"),
            ("PATCH", f"{BASE}/plans/{alice.plan}/"),
        }
        expected = {403} if operator_only else {200, 201}
        assert response.status_code in expected, (method, url, response.status_code, response.content)


def test_lists_show_only_the_callers_tenant(client, world):
    alice = world["alice"]
    tenants = call(client, "GET", f"{BASE}/tenants/", alice.admin_key).json()
    plans = call(client, "GET", f"{BASE}/plans/", alice.admin_key).json()
    assert [t["name"] for t in tenants] == ["alice"]
    assert [p["name"] for p in plans] == ["plan-alice"]
    assert call(client, "POST", f"{BASE}/tenants/", alice.admin_key, {"name": "mallory"}).status_code == 403


def test_an_operator_sees_every_tenant(client, world, operator_token):
    names = [t["name"] for t in call(client, "GET", f"{BASE}/tenants/", operator_token).json()]
    assert names == ["alice", "bob", "charlie"]
    for w in world.values():
        for method, url, _ in endpoints(w):
            if method == "GET":
                assert call(client, method, url, operator_token).status_code == 200, url


def test_an_operator_session_works_too(client, world, django_user_model):
    staff = django_user_model.objects.create_user("admin", password="a-long-password-1", is_staff=True)
    client.force_login(staff)
    assert client.get(f"{BASE}/tenants/bob/").status_code == 200


def test_a_plain_key_and_no_key_are_refused(client, world):
    alice = world["alice"]
    no_key = call(client, "GET", f"{BASE}/tenants/alice/")
    plain = call(client, "GET", f"{BASE}/tenants/alice/", alice.plain_key)
    assert no_key.status_code == 401 and no_key.json()["error"]["type"] == "authentication_error"
    assert plain.status_code == 403 and plain.json()["error"]["type"] == "permission_error"
    assert call(client, "GET", f"{BASE}/tenants/", "gps_notreal_x").status_code == 401
