"""The bearer credential of a request: every face (the OpenAI API, the management API, the operator
endpoints) reads the Authorization header through this one function."""


def bearer_token(request) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (scheme case-insensitive), or None
    when the header is missing, names another scheme or carries no token."""
    scheme, _, token = request.META.get("HTTP_AUTHORIZATION", "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None
