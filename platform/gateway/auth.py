"""Bearer API key authentication for the inference API, with the caller's limits.

A key's tenant never changes. So once this process has seen a key, the tenant's cached limits are
read in the same round trip as the key's record (`_key_tenants`): on a busy core every round trip
is a wait for Redis and another for the CPU, on the path of every request. The key's record itself
is still read on every request, so a revocation takes effect at once.
"""

from config.bearer import bearer_token
from config.database import DatabaseUnavailable
from gateway.errors import ServiceUnavailable, Unauthorized
from quotas.limits import Limits, limits_cache_key, limits_for
from tenants.keys import key_prefix
from tenants.services import AuthenticationFailed, KeyPrincipal, apikey_authenticate_reading

# Key prefix → tenant id, for the keys this process has authenticated; cleared when this large
# (forgetting costs each key one more round trip).
_key_tenants: dict[str, int] = {}
_KEY_TENANTS_TRACKED = 100_000


def authenticate(http_request) -> tuple[KeyPrincipal, Limits]:
    """The HTTP request's key and the limits that apply to it (its plan's models among them)."""
    token = bearer_token(http_request)
    if token is None:
        raise Unauthorized(
            "You didn't provide an API key. Provide it in the Authorization header as 'Bearer YOUR_KEY'.",
            code="missing_api_key",
        )
    known_tenant = _key_tenants.get(key_prefix(token) or "")
    also = [limits_cache_key(known_tenant)] if known_tenant is not None else []
    try:
        principal, values = apikey_authenticate_reading(plaintext=token, also=also)
    except AuthenticationFailed as exc:
        raise Unauthorized(str(exc), code="invalid_api_key") from None
    except DatabaseUnavailable:
        # A key this platform has not seen lately, during a database outage: neither yes nor no.
        raise ServiceUnavailable(
            "This API key cannot be checked right now (database unavailable); try again shortly.",
            code="database_unavailable", headers={"Retry-After": "5"},
        ) from None  # fmt: skip
    if known_tenant != principal.tenant_id:
        if len(_key_tenants) >= _KEY_TENANTS_TRACKED:
            _key_tenants.clear()
        _key_tenants[principal.key_prefix] = principal.tenant_id
    prefetched = (values[0],) if known_tenant == principal.tenant_id else None
    return principal, limits_for(tenant_id=principal.tenant_id, key_id=principal.key_id, prefetched=prefetched)
