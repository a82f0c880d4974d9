"""The console's own business rules: tenant-admin accounts and login rate limiting."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.password_validation import validate_password
from django.db import transaction

from config.redis_client import get_redis
from console.models import TenantMembership
from tenants.models import Tenant

# Failed logins allowed per (client address, username) and per client address within the window.
# Behind a proxy every client shares the proxy's address, so the per-address cap is generous and the
# per-username one does the real work; a successful login clears the username's counter.
LOGIN_MAX_FAILURES = getattr(settings, "CONSOLE_LOGIN_MAX_FAILURES", 5)
LOGIN_MAX_FAILURES_PER_ADDRESS = getattr(settings, "CONSOLE_LOGIN_MAX_FAILURES_PER_ADDRESS", 50)
LOGIN_WINDOW_SECONDS = getattr(settings, "CONSOLE_LOGIN_WINDOW_SECONDS", 900)


@dataclass(frozen=True)
class LoginThrottle:
    allowed: bool
    retry_after: int = 0


def _login_keys(address: str, username: str) -> tuple[str, str]:
    who = hashlib.sha256(f"{address}|{username.strip().lower()}".encode()).hexdigest()[:32]
    return f"console:login:user:{who}", f"console:login:addr:{address}"


def login_throttle_check(*, address: str, username: str) -> LoginThrottle:
    """Whether another attempt may be made now (checked before the password is)."""
    user_key, addr_key = _login_keys(address, username)
    pipe = get_redis().pipeline(transaction=False)
    pipe.get(user_key)
    pipe.ttl(user_key)
    pipe.get(addr_key)
    pipe.ttl(addr_key)
    user_failures, user_ttl, addr_failures, addr_ttl = pipe.execute()
    if int(user_failures or 0) >= LOGIN_MAX_FAILURES:
        return LoginThrottle(allowed=False, retry_after=max(int(user_ttl), 1))
    if int(addr_failures or 0) >= LOGIN_MAX_FAILURES_PER_ADDRESS:
        return LoginThrottle(allowed=False, retry_after=max(int(addr_ttl), 1))
    return LoginThrottle(allowed=True)


def login_failure_record(*, address: str, username: str) -> None:
    """Count a failed attempt; the window starts at the first failure (a fixed window per key)."""
    pipe = get_redis().pipeline(transaction=True)
    for key in _login_keys(address, username):
        # SET NX EX then INCR (INCR keeps the TTL); EXPIRE NX would need Redis 7, embedded Redis is 6.2.
        pipe.set(key, 0, nx=True, ex=LOGIN_WINDOW_SECONDS)
        pipe.incr(key)
    pipe.execute()


def login_success_record(*, address: str, username: str) -> None:
    user_key, _ = _login_keys(address, username)
    get_redis().delete(user_key)


@transaction.atomic
def tenant_admin_create(*, tenant: Tenant, username: str, password: str, email: str = ""):
    """A Django user who administers `tenant` in the console (never staff, so never the Django admin)."""
    user_model = get_user_model()
    user = user_model(username=username, email=email, is_staff=False, is_superuser=False)
    validate_password(password, user)
    user.set_password(password)
    user.full_clean()
    user.save()
    TenantMembership.objects.create(user=user, tenant=tenant)
    return user
