"""Bearer API key authentication for the inference API."""

from config.bearer import bearer_token
from config.database import DatabaseUnavailable
from gateway.errors import ServiceUnavailable, Unauthorized
from tenants.services import AuthenticationFailed, KeyPrincipal, apikey_authenticate


def authenticate(request) -> KeyPrincipal:
    token = bearer_token(request)
    if token is None:
        raise Unauthorized(
            "You didn't provide an API key. Provide it in the Authorization header as 'Bearer YOUR_KEY'.",
            code="missing_api_key",
        )
    try:
        return apikey_authenticate(plaintext=token)
    except AuthenticationFailed as exc:
        raise Unauthorized(str(exc), code="invalid_api_key") from None
    except DatabaseUnavailable:
        # A key this platform has not seen lately, during a database outage: neither yes nor no.
        raise ServiceUnavailable(
            "This API key cannot be checked right now (database unavailable); try again shortly.",
            code="database_unavailable", headers={"Retry-After": "5"},
        ) from None  # fmt: skip
