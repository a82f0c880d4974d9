"""The console's security headers, sync- and async-capable (config/middleware.py says why)."""

from config.middleware import SyncAndAsyncMiddleware

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
