"""Authentication through a PostgreSQL outage: known keys keep working from their last known record,
a key never seen is answered 503 (neither yes nor no), a revoked key never comes back, and the
process stops trying PostgreSQL for a while after a failure (config/database.py)."""

import contextlib
import socket

import pytest
from django.db import connection

from config import database
from tenants import auth_cache, services
from tenants.keys import key_prefix
from tenants.services import apikey_authenticate, apikey_revoke

pytestmark = pytest.mark.django_db(transaction=True)


@contextlib.contextmanager
def postgres_down():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        unreachable = str(sock.getsockname()[1])  # nothing listens there once the socket closes
    real_port = connection.settings_dict["PORT"]
    connection.close()
    connection.settings_dict["PORT"] = unreachable
    try:
        yield
    finally:
        connection.settings_dict["PORT"] = real_port
        connection.close()
        database._down, database._down_until = False, 0.0  # the next test starts with it reachable


def _expire_fresh_record(redis_client, plaintext: str) -> None:
    redis_client.delete(f"auth:{key_prefix(plaintext)}")  # as after AUTH_CACHE_SECONDS


def test_a_known_key_keeps_working_through_an_outage(make_tenant, redis_client):
    tenant, key = make_tenant("alice")
    assert apikey_authenticate(plaintext=key).tenant_id == tenant.id  # seen once: its record is known
    _expire_fresh_record(redis_client, key)
    redis_client.delete(f"lastused:{tenant.api_keys.get().id}")  # its last_used write is due
    services._last_used_tried.clear()

    with postgres_down():
        principal = apikey_authenticate(plaintext=key)

    assert principal.tenant_id == tenant.id


def test_an_unknown_key_during_an_outage_is_a_503_not_a_401(make_tenant, rf):
    from gateway.auth import authenticate
    from gateway.errors import ServiceUnavailable

    _, key = make_tenant("alice")  # created, never used: no record in Redis
    request = rf.post("/v1/chat/completions", HTTP_AUTHORIZATION=f"Bearer {key}")
    with postgres_down(), pytest.raises(ServiceUnavailable) as refused:
        authenticate(request)
    assert refused.value.status == 503 and refused.value.code == "database_unavailable"


def test_a_key_revoked_before_the_outage_stays_revoked(make_tenant, redis_client):
    tenant, key = make_tenant("alice")
    apikey_authenticate(plaintext=key)
    apikey_revoke(api_key=tenant.api_keys.get())
    assert auth_cache.last_known(key_prefix(key)) is None

    with postgres_down(), pytest.raises((database.DatabaseUnavailable, services.AuthenticationFailed)):
        apikey_authenticate(plaintext=key)


def test_after_a_failure_postgres_is_left_alone_for_a_while(make_tenant, redis_client, monkeypatch):
    _, key = make_tenant("alice")
    apikey_authenticate(plaintext=key)
    reads = []
    real_read = services._key_record_from_db
    monkeypatch.setattr(services, "_key_record_from_db", lambda prefix: reads.append(prefix) or real_read(prefix))

    with postgres_down():
        for _ in range(5):
            _expire_fresh_record(redis_client, key)
            apikey_authenticate(plaintext=key)

    assert len(reads) == 1  # the first lookup tried PostgreSQL; the others used the last known record
