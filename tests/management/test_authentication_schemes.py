"""The management API accepts only what docs/api.md documents: staff tokens, tenant admin keys and an
operator's session. No view checks a password (DRF's default Basic auth would, with no rate limit)."""

import base64

import pytest
from django.urls import URLPattern, URLResolver, get_resolver
from rest_framework.authentication import BasicAuthentication, SessionAuthentication

from management.authentication import StaffTokenAuthentication, TenantAdminKeyAuthentication

pytestmark = pytest.mark.django_db

PASSWORD = "a-long-password-1"


def _drf_views(patterns=None):
    for pattern in patterns if patterns is not None else get_resolver().url_patterns:
        if isinstance(pattern, URLResolver):
            yield from _drf_views(pattern.url_patterns)
        elif isinstance(pattern, URLPattern) and hasattr(pattern.callback, "cls"):
            yield pattern.callback.cls


def _basic(username: str, password: str) -> dict:
    return {"HTTP_AUTHORIZATION": "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()}


def test_every_api_view_uses_only_the_documented_schemes():
    documented = {StaffTokenAuthentication, TenantAdminKeyAuthentication, SessionAuthentication}
    views = list(_drf_views())
    assert len(views) > 10
    for view in views:
        schemes = {type(authenticator) for authenticator in view().get_authenticators()}
        assert BasicAuthentication not in schemes, view
        assert schemes <= documented, view


def test_the_schema_does_not_tell_a_right_password_from_a_wrong_one(client, django_user_model, redis_client):
    django_user_model.objects.create_user("ops", password=PASSWORD, is_staff=True)
    right = client.get("/api/v1/schema/", **_basic("ops", PASSWORD))
    wrong = client.get("/api/v1/schema/", **_basic("ops", "wrong"))
    assert right.status_code == wrong.status_code == 200
    assert "WWW-Authenticate" not in wrong


def test_basic_credentials_do_not_reach_the_management_api(client, django_user_model, redis_client):
    django_user_model.objects.create_user("ops", password=PASSWORD, is_staff=True)
    response = client.get("/api/v1/tenants/", **_basic("ops", PASSWORD))
    assert response.status_code == 401
    assert response["WWW-Authenticate"] == "Bearer"
