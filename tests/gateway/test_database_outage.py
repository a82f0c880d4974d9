"""The inference API's reads through a PostgreSQL outage (config/database.py): a key seen before is
served with its limits and the model catalog as last read; one never seen gets a 503 in OpenAI's
shape, not a 401 and not a 500."""

import pytest

from catalog import selectors as catalog
from tests.tenants.test_database_outage import postgres_down

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def registered_model(tiny_model_dir):
    from django.core.management import call_command

    call_command(
        "registermodel", "tiny-gemma4", "--path", str(tiny_model_dir), "--pool", "tiny", "--context-length", "2048"
    )


def _models(client, key):
    return client.get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {key}")


def _expire_every_cache(redis_client, tenant) -> None:
    """As after the auth cache's, the limits cache's and the catalog snapshot's lifetimes."""
    for key in redis_client.scan_iter(match="auth:*"):
        redis_client.delete(key)
    redis_client.delete(f"quota:lim:{tenant.id}")
    catalog._cache["at"] = float("-inf")


def test_a_key_seen_before_lists_its_models_through_an_outage(client, make_tenant, registered_model, redis_client):
    tenant, key = make_tenant("alice")
    before = _models(client, key)
    assert before.status_code == 200
    _expire_every_cache(redis_client, tenant)

    with postgres_down():
        during = _models(client, key)

    assert during.status_code == 200 and during.json() == before.json()


def test_a_key_never_seen_gets_a_503_during_an_outage(client, make_tenant, registered_model, redis_client):
    _, seen = make_tenant("alice")
    assert _models(client, seen).status_code == 200  # the catalog is known to this process
    _, unseen = make_tenant("bob")

    with postgres_down():
        reply = _models(client, unseen)

    assert reply.status_code == 503 and reply.headers["Retry-After"]
    assert reply.json()["error"]["code"] == "database_unavailable"
