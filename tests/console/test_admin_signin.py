"""/admin/login/ and /admin/password_change/ are rate limited like the console's sign-in, and all
three share one budget."""

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


ADMIN_PASSWORD_CHANGE = "/admin/password_change/"
NEW_PASSWORD = "a-new-pass-9e1b"


def _change_password(client, old_password: str):
    return client.post(
        ADMIN_PASSWORD_CHANGE,
        {"old_password": old_password, "new_password1": NEW_PASSWORD, "new_password2": NEW_PASSWORD},
    )


def test_admin_password_change_is_rate_limited(client, operator, redis_client):
    client.force_login(operator)
    for _ in range(5):
        refused = _change_password(client, "wrong")
        assert refused.status_code == 200 and "incorrect" in refused.content.decode()
    response = _change_password(client, OPERATOR_PASSWORD)  # the right password, too late
    assert response.status_code == 200
    assert "Too many failed sign-in attempts" in response.content.decode()
    operator.refresh_from_db()
    assert operator.check_password(OPERATOR_PASSWORD)


def test_admin_password_change_still_works_within_the_limit(client, operator, redis_client):
    client.force_login(operator)
    for _ in range(4):
        _change_password(client, "wrong")
    assert _change_password(client, OPERATOR_PASSWORD).status_code == 302
    operator.refresh_from_db()
    assert operator.check_password(NEW_PASSWORD)


def test_password_changes_and_sign_ins_share_one_budget(client, operator, redis_client):
    client.force_login(operator)
    for _ in range(3):
        _change_password(client, "wrong")
    client.logout()
    for _ in range(2):
        _admin_sign_in(client, "wrong")
    response = client.post("/console/login/", {"username": "ops", "password": OPERATOR_PASSWORD})
    assert "Too many failed sign-in attempts" in response.content.decode()
