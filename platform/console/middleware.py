"""Records every 429 the inference API returns, so a tenant admin can see why they were throttled.

The quota gate refuses with an OpenAI-shaped 429 that names the limit in `x-ratelimit-exceeded`.
This middleware only looks at responses that are already 429s (nothing is added to an admitted
request's path), finds the caller's tenant from the Authorization header (the same Redis-cached
key lookup the gateway just did) and appends the event to the tenant's capped list in Redis.
"""

import json
import logging
import time

from console.services import throttle_record
from tenants.keys import key_prefix
from tenants.services import AuthenticationFailed, apikey_authenticate

log = logging.getLogger(__name__)


class ThrottleEventMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        response = self.get_response(request)
        if response.status_code == 429 and request.path.startswith("/v1/"):
            try:
                self._record(request, response)
            except Exception:  # recording must never turn a 429 into a 500
                log.warning("could not record a throttling event", exc_info=True)
        return response

    def _record(self, request, response) -> None:
        scheme, _, token = request.META.get("HTTP_AUTHORIZATION", "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or key_prefix(token) is None:
            return
        try:
            principal = apikey_authenticate(plaintext=token)
        except AuthenticationFailed:
            return
        error = json.loads(response.content or b"{}").get("error", {}) if not response.streaming else {}
        retry_after = response.headers.get("Retry-After")
        throttle_record(
            tenant_id=principal.tenant_id,
            key_prefix=key_prefix(token),
            limit=response.headers.get("x-ratelimit-exceeded", ""),
            code=error.get("code") or "",
            message=error.get("message") or "",
            retry_after=int(retry_after) if retry_after and retry_after.isdigit() else None,
            path=request.path,
            at=time.time(),
        )


# Console pages load scripts, styles and data only from our own origin (Chart.js and htmx are
# vendored); charts draw on canvas, htmx requests go to the same origin. Inline styles stay allowed:
# Chart.js sizes its canvas through style attributes.
CONSOLE_CSP = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self' 'unsafe-inline'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "form-action 'self'",
        "frame-ancestors 'none'",
        "base-uri 'none'",
        "object-src 'none'",
    ]
)


class ConsoleSecurityHeadersMiddleware:
    """A Content-Security-Policy on every console page: the browser itself refuses other origins."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        response = self.get_response(request)
        if request.path.startswith("/console/"):
            response.headers.setdefault("Content-Security-Policy", CONSOLE_CSP)
            response.headers.setdefault("Referrer-Policy", "same-origin")
        return response
