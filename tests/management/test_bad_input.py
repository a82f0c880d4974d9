"""Bad input to the management API is a 400 in its documented error shape, never a 500: bodies nested
too deep, NaN and overflowing numbers, huge integer literals, lone surrogates, limits beyond their
database column. Unknown paths and server errors answer JSON too."""

import pytest
from django.test import Client

from tests.bad_input import DIGITS_5000, NESTED_40, NESTED_5000, error_of, post_raw, raw_json
from tests.management.conftest import call

BASE = "/api/v1"
BIGINT_MAX = 2**63 - 1
INT_MAX = 2**31 - 1


@pytest.fixture
def alice(db, make_tenant):
    tenant, _ = make_tenant("alice")
    return tenant


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("display_name", NESTED_5000),
        ("display_name", NESTED_40),
        ("rpm", DIGITS_5000),
        ("rpm", b"NaN"),
        ("rpm", b"-Infinity"),
        ("rpm", b"1e999"),
    ],
    ids=["nested-5000", "nested-40", "int-5000-digits", "nan", "minus-infinity", "overflowing-float"],
)
def test_bodies_json_cannot_hold_are_a_400(client, operator_token, field, value):
    raw = raw_json(name=b'"x"', **{field: value})
    error = error_of(post_raw(client, f"{BASE}/plans/", operator_token, raw), 400)
    assert error["type"] == "invalid_request_error" and error["code"] == "parse_error"


def test_a_lone_surrogate_is_a_400_naming_the_field(client, operator_token, alice):
    raw = rb'{"display_name": "caf\ud800"}'
    error = error_of(post_raw(client, f"{BASE}/tenants/alice/", operator_token, raw, method="patch"), 400)
    assert error["param"] == "display_name" and error["code"] == "invalid_value"


@pytest.mark.parametrize(
    ("url", "field", "too_big"),
    [
        ("/tenants/alice/quota/", "rpm", 10_000_000_000_000_000_000),
        ("/tenants/alice/quota/", "budget_tokens", BIGINT_MAX + 1),
        ("/plans/", "price_input_per_1m_micros", BIGINT_MAX + 1),
        ("/plans/", "fair_share_weight", INT_MAX + 1),
        ("/plans/", "guaranteed_tokens_per_second", INT_MAX + 1),
    ],
)
def test_a_value_beyond_its_column_is_a_400_naming_the_field(client, operator_token, alice, url, field, too_big):
    body = {field: too_big} if "quota" in url else {"name": "gold", field: too_big}
    response = call(client, "PATCH" if "quota" in url else "POST", f"{BASE}{url}", operator_token, body)
    error = error_of(response, 400)
    assert (error["param"], error["code"]) == (field, "max_value")


def test_the_largest_value_a_column_holds_is_accepted(client, operator_token, alice):
    response = call(client, "PATCH", f"{BASE}/tenants/alice/quota/", operator_token, {"rpm": BIGINT_MAX})
    assert response.status_code == 200, response.content
    assert response.json()["overrides"]["rpm"] == BIGINT_MAX


def test_a_key_quota_beyond_its_column_is_a_400(client, operator_token, alice):
    from tenants.models import ApiKey

    prefix = ApiKey.objects.get(tenant=alice).prefix
    response = call(client, "PATCH", f"{BASE}/tenants/alice/keys/{prefix}/quota/", operator_token,
                    {"concurrency": BIGINT_MAX + 1})  # fmt: skip
    assert error_of(response, 400)["param"] == "concurrency"


@pytest.mark.parametrize("path", [f"{BASE}/no-such-thing/", f"{BASE}/tenants/alice/keys/x/y/z/", f"{BASE}"])
def test_an_unknown_management_path_is_a_json_404(client, db, path):
    error = error_of(client.get(path), 404)
    assert (error["type"], error["code"]) == ("invalid_request_error", "unknown_url")


def test_an_unknown_console_path_is_still_html(client, db):
    response = client.get("/console/no-such-page/x/")
    assert response.status_code == 404 and response["Content-Type"].startswith("text/html")


def test_a_server_error_in_the_management_api_is_json(db, operator_token, monkeypatch):
    from management import views

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(views.Plan.objects, "all", broken)
    client = Client(raise_request_exception=False)
    error = error_of(client.get(f"{BASE}/plans/", HTTP_AUTHORIZATION=f"Bearer {operator_token}"), 500)
    assert (error["type"], error["code"]) == ("server_error", "internal_error")
    assert "a bug" not in error["message"]
