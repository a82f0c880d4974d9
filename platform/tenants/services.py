"""Business rules for tenants and API keys (HackSoft style: keyword-only, <entity>_<action>).

Authenticated key records are cached in Redis (`tenants.auth_cache`). Every saved or deleted key or
tenant row clears the cached records it affects once its transaction commits (`tenants.signals`),
whoever wrote it: these services, the Django admin, a shell.
"""

import datetime as dt
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

from django.db import transaction
from django.dispatch import Signal
from django.utils import timezone

from config.database import OUTAGE_ERRORS, database_failed, database_reachable, read_with_fallback
from config.redis_client import get_redis
from core import clock
from core.errors import Conflict
from tenants import auth_cache
from tenants.keys import digests_match, key_generate, key_prefix
from tenants.models import ApiKey, Tenant

_LAST_USED_EVERY_SECONDS = 60
# When this process last asked Redis whether a key's last_used_at is due (monotonic seconds).
_last_used_tried: dict[int, float] = {}
_LAST_USED_TRACKED = 100_000
# Sent inside the rotation's transaction (old=, new=): apps that attach data to a key move it along.
rotated = Signal()


class AuthenticationFailed(Exception):
    """The presented key is missing, malformed, unknown, revoked or expired."""


@dataclass(frozen=True)
class KeyPrincipal:
    """Who is calling: the result of authenticating an API key."""

    key_id: int
    tenant_id: int
    tenant_name: str
    allowed_models: tuple[str, ...]  # empty: every model (catalog.selectors.model_access_allowed)
    key_prefix: str = ""  # the key's public prefix (what a tenant's pages name it by)


def tenant_create(*, name: str, display_name: str = "") -> Tenant:
    tenant = Tenant(name=name, display_name=display_name or name)
    tenant.full_clean()
    tenant.save()
    return tenant


def apikey_create(
    *,
    tenant: Tenant,
    name: str = "",
    expires_at: dt.datetime | None = None,
    allowed_models: list[str] | None = None,
    is_admin: bool = False,
) -> tuple[ApiKey, str]:
    """Create a key; returns the row and the plaintext, which is never retrievable again."""
    new = key_generate()
    api_key = ApiKey.objects.create(
        tenant=tenant,
        name=name,
        prefix=new.prefix,
        digest=new.digest,
        expires_at=expires_at,
        allowed_models=list(allowed_models or []),
        is_admin=is_admin,
    )
    return api_key, new.plaintext


@transaction.atomic
def apikey_rotate(*, api_key: ApiKey, grace_seconds: int = 0) -> tuple[ApiKey, str]:
    """Replace a key by a new one with the same settings; the old one keeps working for the grace period.

    Returns the new row and its plaintext (shown once). Limits of the key's own move to the new key.
    Conflict if the key is revoked or expired already.
    """
    if not api_key.is_usable():
        raise Conflict("A revoked or expired key cannot be rotated.", code="conflict")
    new_key, plaintext = apikey_create(
        tenant=api_key.tenant,
        name=api_key.name,
        expires_at=api_key.expires_at,
        allowed_models=api_key.allowed_models,
        is_admin=api_key.is_admin,
    )
    api_key.revoked_at = clock.now() + dt.timedelta(seconds=max(0, grace_seconds))
    api_key.save(update_fields=["revoked_at"])
    rotated.send(sender=ApiKey, old=api_key, new=new_key)
    return new_key, plaintext


def apikey_find(*, key_or_prefix: str) -> ApiKey:
    prefix = key_prefix(key_or_prefix) or key_or_prefix
    return ApiKey.objects.select_related("tenant").get(prefix=prefix)


@transaction.atomic
def apikey_revoke(*, api_key: ApiKey) -> bool:
    """Revoke the key now, also one still in a rotation's grace period; False if it was revoked already.

    A key revoked in the past keeps its revocation time. When this returns (outside a transaction;
    else when the caller's transaction commits), no request authenticated with the key starts any
    more, in any web process: the post-save hook clears its cached record after commit.
    """
    now = clock.now()
    current = ApiKey.objects.select_for_update().only("revoked_at").get(pk=api_key.pk)
    if current.revoked_at is not None and current.revoked_at <= now:
        api_key.revoked_at = current.revoked_at
        return False
    api_key.revoked_at = now
    api_key.save(update_fields=["revoked_at"])
    return True


def apikey_cache_forget_on_commit(*, prefixes: list[str]) -> None:
    """Clear the keys' cached auth records once the current transaction commits (at once outside one)."""
    if prefixes:
        transaction.on_commit(lambda: auth_cache.forget(prefixes))


def _cached_key_record(prefix: str, also: Sequence[str] = ()) -> tuple[dict | None, list[str | None]]:
    """The key's auth record from Redis, falling back to PostgreSQL (and caching the answer), and
    to the key's last known record while PostgreSQL is unreachable (DatabaseUnavailable if none);
    with the values of the Redis keys `also`, read in the same round trip as the cached record."""
    cached, generation, values = auth_cache.read(prefix, also)  # the generation is read before the database is
    if cached == auth_cache.MISSING:
        return None, values
    if cached is not None:
        return json.loads(cached), values
    record = read_with_fallback(
        lambda: _key_record_from_db(prefix) or {}, lambda: _last_known_record(prefix), what="this API key"
    )
    if not record:
        auth_cache.store_missing(prefix, generation=generation)
        return None, values
    auth_cache.store_record(prefix, json.dumps(record), generation=generation)
    return record, values


def _last_known_record(prefix: str) -> dict | None:
    last_known = auth_cache.last_known(prefix)
    return json.loads(last_known) if last_known else None


def _key_record_from_db(prefix: str) -> dict | None:
    api_key = ApiKey.objects.select_related("tenant").filter(prefix=prefix).first()
    if api_key is None:
        return None
    return {
        "key_id": api_key.id,
        "tenant_id": api_key.tenant_id,
        "tenant_name": api_key.tenant.name,
        "tenant_active": api_key.tenant.is_active,
        "digest": api_key.digest,
        "allowed_models": api_key.allowed_models,
        "expires_at": api_key.expires_at.timestamp() if api_key.expires_at else None,
        "revoked_at": api_key.revoked_at.timestamp() if api_key.revoked_at else None,
    }


def apikey_authenticate(*, plaintext: str) -> KeyPrincipal:
    """Check a presented key: constant-time digest compare, then revocation, expiry, tenant state."""
    return apikey_authenticate_reading(plaintext=plaintext)[0]


def apikey_authenticate_reading(*, plaintext: str, also: Sequence[str] = ()) -> tuple[KeyPrincipal, list[str | None]]:
    """`apikey_authenticate`, plus the values of the Redis keys `also` (None where absent), read in
    the same round trip as the key's cached record: a caller that knows what it reads next saves
    one (the inference API reads the tenant's limits)."""
    prefix = key_prefix(plaintext)
    if prefix is None:
        raise AuthenticationFailed("Incorrect API key provided.")
    record, values = _cached_key_record(prefix, also)
    if record is None or not digests_match(record["digest"], plaintext):
        raise AuthenticationFailed("Incorrect API key provided.")
    now = clock.timestamp()
    if record["revoked_at"] is not None and record["revoked_at"] <= now:
        raise AuthenticationFailed("This API key has been revoked.")
    if record["expires_at"] is not None and record["expires_at"] <= now:
        raise AuthenticationFailed("This API key has expired.")
    if not record["tenant_active"]:
        raise AuthenticationFailed("This API key's tenant is suspended.")
    _touch_last_used(record["key_id"])
    principal = KeyPrincipal(
        key_id=record["key_id"],
        tenant_id=record["tenant_id"],
        tenant_name=record["tenant_name"],
        allowed_models=tuple(record["allowed_models"]),
        key_prefix=prefix,
    )
    return principal, values


def _touch_last_used(key_id: int) -> None:
    # At most one UPDATE per key per minute, whatever the request rate (the Redis key decides among
    # processes), and at most one Redis call per key per minute in each process (a round trip
    # fewer on nearly every request); skipped while PostgreSQL is down (a bookkeeping write must
    # not stop inference).
    now = time.monotonic()
    if _last_used_tried.get(key_id, -_LAST_USED_EVERY_SECONDS) > now - _LAST_USED_EVERY_SECONDS:
        return
    if not database_reachable():
        return
    if len(_last_used_tried) >= _LAST_USED_TRACKED:
        _last_used_tried.clear()  # forgetting only costs each key one more Redis call
    _last_used_tried[key_id] = now
    if get_redis().set(f"lastused:{key_id}", 1, nx=True, ex=_LAST_USED_EVERY_SECONDS):
        try:
            ApiKey.objects.filter(id=key_id).update(last_used_at=timezone.now())
        except OUTAGE_ERRORS as exc:
            database_failed(exc)
