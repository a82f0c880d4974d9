"""Middleware support for serving under ASGI without moving requests onto threads.

Django runs a request through the middleware stack in the mode of each middleware: one that is only
sync-capable makes the handler adapt the rest of the stack around it (sync_to_async, then
async_to_sync), so every request, the async inference views included, would hold a thread while it
runs. Every entry of settings.MIDDLEWARE is therefore sync- and async-capable.

RequestBodyLimit is ASGI middleware around the whole application (config/asgi.py): it answers an
over-size body before Django reads it.
"""

import json
import re

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from whitenoise.middleware import WhiteNoiseMiddleware


class SyncAndAsyncMiddleware:
    """Base of a middleware that runs in the mode of the handler it wraps (Django's documented
    pattern): a call returns `_acall(request)`'s coroutine when that handler is async, else
    `_call(request)`'s response."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        self._async = iscoroutinefunction(get_response)
        if self._async:
            markcoroutinefunction(self)

    def __call__(self, request):
        if self._async:
            return self._acall(request)
        return self._call(request)

    def _call(self, request):
        raise NotImplementedError

    async def _acall(self, request):
        raise NotImplementedError


class StaticFilesMiddleware(SyncAndAsyncMiddleware):
    """whitenoise's middleware (sync-only as of whitenoise 6.12) with an async mode.

    A request for a static file is served by whitenoise on a thread (it opens the file); any other
    request goes on to the next handler in the caller's mode, on the event loop under ASGI.
    """

    def __init__(self, get_response):
        super().__init__(get_response)
        self._whitenoise = WhiteNoiseMiddleware(get_response)

    def _call(self, request):
        return self._whitenoise(request)

    async def _acall(self, request):
        static_file = await self._find(request.path_info)
        if static_file is None:
            return await self.get_response(request)
        return await sync_to_async(self._whitenoise.serve, thread_sensitive=False)(static_file, request)

    async def _find(self, path: str):
        if not self._whitenoise.autorefresh:
            return self._whitenoise.files.get(path)  # the files indexed at start
        # Development (DEBUG): whitenoise looks on the disk, for paths under STATIC_URL only (this
        # project sets no WHITENOISE_ROOT), so other requests need no thread.
        if not path.startswith(self._whitenoise.static_prefix):
            return None
        return await sync_to_async(self._whitenoise.find_file, thread_sensitive=False)(path)


class ApiSecurityHeadersMiddleware(SyncAndAsyncMiddleware):
    """The headers Django's SecurityMiddleware would add to an API response (`nosniff`, the
    referrer policy), without its thread hops; the inference API redirects nothing to HTTPS (a
    redirected POST would lose its body): a TLS proxy in front of it is the deployment's job."""

    def _call(self, request):
        return self._with_headers(self.get_response(request))

    async def _acall(self, request):
        return self._with_headers(await self.get_response(request))

    @staticmethod
    def _with_headers(response):
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        response.headers.setdefault("Referrer-Policy", "same-origin")
        return response


class RequestBodyLimit:
    """ASGI middleware: a request body over `limit` bytes is answered 413 with `Connection: close`
    here, before Django reads it (Django's ASGI handler reads a whole body, spooled to disk, before
    any view runs).

    A body declared too large (Content-Length) is drained first, when it is at most `drain_limit`
    bytes, so that closing the connection does not reset it under the client while it still sends:
    the client reads the 413 rather than a broken pipe. A chunked body is counted as it arrives and
    cut off (Django sees a disconnect) once over the limit. Either way the connection is closed after
    the 413: what is left of the body is never parsed as the next request.

    `larger` gives paths (regular expressions) a limit of their own (adapter uploads); the drain limit
    stays the default's."""

    def __init__(self, app, *, limit: int, drain_limit: int, larger: tuple[tuple[str, int], ...] = ()):
        self.app, self.limit, self.drain_limit = app, limit, drain_limit
        self.larger = [(re.compile(pattern), most) for pattern, most in larger]

    def _limit_for(self, path: str) -> int:
        return next((most for pattern, most in self.larger if pattern.match(path)), self.limit)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self._limit_for(scope["path"])
        declared = _declared_length(scope)
        if declared is not None and declared > limit:
            if declared <= self.drain_limit and not _expects_continue(scope):
                await _drain(receive, self.drain_limit)
            return await self._too_large(scope, send, limit)
        counted = _CountedBody(receive, limit, self.drain_limit)
        await self.app(scope, counted, send)
        if counted.exceeded:
            await self._too_large(scope, send, limit)

    async def _too_large(self, scope, send, limit: int) -> None:
        from config.error_views import api_error_body, is_api_path

        message = f"The request body exceeds {limit} bytes."
        path = scope["path"]
        if is_api_path(path):
            body = json.dumps(api_error_body(path, 413, message, "payload_too_large")).encode()
            content_type = b"application/json"
        else:
            body, content_type = b"413 Payload too large", b"text/plain; charset=utf-8"
        headers = [
            (b"content-type", content_type),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return value
    return None


def _declared_length(scope) -> int | None:
    value = _header(scope, b"content-length")
    return int(value) if value is not None and value.isdigit() else None


def _expects_continue(scope) -> bool:
    # The client waits for "100 Continue" before it sends the body: nothing to drain.
    return (_header(scope, b"expect") or b"").lower() == b"100-continue"


async def _drain(receive, most: int) -> None:
    """Read and drop the request body, up to `most` bytes."""
    seen = 0
    while seen <= most:
        message = await receive()
        if message["type"] != "http.request":
            return
        seen += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


class _CountedBody:
    """An ASGI `receive` that counts the body; past `limit` bytes it drains the rest (up to
    `drain_limit`) and answers a disconnect, which makes Django give the request up unanswered."""

    def __init__(self, receive, limit: int, drain_limit: int):
        self._receive, self._limit, self._drain_limit = receive, limit, drain_limit
        self._seen = 0
        self.exceeded = False

    async def __call__(self):
        if self.exceeded:
            return {"type": "http.disconnect"}
        message = await self._receive()
        if message["type"] == "http.request":
            self._seen += len(message.get("body", b""))
            if self._seen > self._limit:
                self.exceeded = True
                if message.get("more_body", False):
                    await _drain(self._receive, self._drain_limit)
                return {"type": "http.disconnect"}
        return message
