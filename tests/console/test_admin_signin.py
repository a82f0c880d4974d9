"""/admin/login/ is rate limited like the console's sign-in, and both share one budget."""

import pytest

from tests.console.conftest import OPERATOR_PASSWORD

pytestmark = pytest.mark.django_db

ADMIN_LOGIN = "/admin/login/"


def _admin_sign_in(client, password: str):
    return client.post(ADMIN_LOGIN, {"username": "ops", "password": password, "next": "/admin/"})


def test_admin_login_is_rate_limited(client, operator, redis_client):
    for _ in range(5):
        assert _admin_sign_in(client, "wrong").status_code == 200
    response = _admin_sign_in(client, OPERATOR_PASSWORD)  # the right password, too late
    assert response.status_code == 200
    assert "Too many failed sign-in attempts" in response.content.decode()
    assert "_auth_user_id" not in client.session


def test_admin_login_still_works_within_the_limit(client, operator, redis_client):
    for _ in range(4):
        _admin_sign_in(client, "wrong")
    assert _admin_sign_in(client, OPERATOR_PASSWORD).status_code == 302


def test_the_console_and_admin_sign_ins_share_one_budget(client, operator, redis_client):
    for _ in range(3):
        client.post("/console/login/", {"username": "ops", "password": "wrong"})
    for _ in range(2):
        _admin_sign_in(client, "wrong")
    response = client.post("/console/login/", {"username": "ops", "password": OPERATOR_PASSWORD})
    assert "Too many failed sign-in attempts" in response.content.decode()
