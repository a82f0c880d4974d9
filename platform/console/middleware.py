"""Records every 429 the inference API returns, so a tenant admin can see why they were throttled.

The quota gate refuses with an OpenAI-shaped 429 that names the limit in `x-ratelimit-exceeded`.
This middleware only looks at responses that are already 429s (nothing is added to an admitted
request's path), finds the caller's tenant from the Authorization header (the same Redis-cached
key lookup the gateway just did) and appends the event to the tenant's capped list in Redis.

Both middlewares here are sync- and async-capable (config/middleware.py says why).
"""

import json
import logging
import time

from config.bearer import bearer_token
from config.database import DatabaseUnavailable
from config.middleware import SyncAndAsyncMiddleware
from console.services import throttle_record
from gateway.offload import run_blocking
from tenants.keys import key_prefix
from tenants.services import AuthenticationFailed, apikey_authenticate

log = logging.getLogger(__name__)


def _is_throttled(request, response) -> bool:
    return response.status_code == 429 and request.path.startswith("/v1/")


class ThrottleEventMiddleware(SyncAndAsyncMiddleware):
    def _call(self, request):
        response = self.get_response(request)
        if _is_throttled(request, response):
            self._record_safely(request, response)
        return response

    async def _acall(self, request):
        response = await self.get_response(request)
        if _is_throttled(request, response):
            # The key lookup may reach the database: on a gateway thread, off the event loop.
            await run_blocking(self._record_safely, request, response)
        return response

    def _record_safely(self, request, response) -> None:
        try:
            self._record(request, response)
        except Exception:  # recording must never turn a 429 into a 500
            log.warning("could not record a throttling event", exc_info=True)

    def _record(self, request, response) -> None:
        token = bearer_token(request)
        if token is None or key_prefix(token) is None:
            return
        try:
            principal = apikey_authenticate(plaintext=token)
        except (AuthenticationFailed, DatabaseUnavailable):
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


class ConsoleSecurityHeadersMiddleware(SyncAndAsyncMiddleware):
    """A Content-Security-Policy on every console page: the browser itself refuses other origins."""

    def _call(self, request):
        return self._with_headers(request, self.get_response(request))

    async def _acall(self, request):
        return self._with_headers(request, await self.get_response(request))

    @staticmethod
    def _with_headers(request, response):
        if request.path.startswith("/console/"):
            response.headers.setdefault("Content-Security-Policy", CONSOLE_CSP)
            response.headers.setdefault("Referrer-Policy", "same-origin")
        return response
