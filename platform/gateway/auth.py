"""Bearer API key authentication for the inference API."""

from gateway.errors import Unauthorized
from tenants.services import AuthenticationFailed, KeyPrincipal, apikey_authenticate


def authenticate(request) -> KeyPrincipal:
    header = request.META.get("HTTP_AUTHORIZATION", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized(
            "You didn't provide an API key. Provide it in the Authorization header as 'Bearer YOUR_KEY'.",
            code="missing_api_key",
        )
    try:
        return apikey_authenticate(plaintext=token.strip())
    except AuthenticationFailed as exc:
        raise Unauthorized(str(exc), code="invalid_api_key") from None
