"""ASGI entry point: what gunicorn's uvicorn workers serve (`config.asgi:application`, named in
deploy/gunicorn.conf.py)."""

import asyncio
import contextlib
import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

import django  # noqa: E402
from django.core import signals  # noqa: E402
from django.core.exceptions import RequestAborted  # noqa: E402
from django.core.handlers.asgi import ASGIHandler, get_script_prefix  # noqa: E402
from django.urls import set_script_prefix  # noqa: E402

from config.streaming import FinalPart  # noqa: E402

# Requests whose thread-sensitive calls run on asgiref's process-wide sync thread (see below).
THREADLESS_PREFIX = "/v1/"


class PlatformASGIHandler(ASGIHandler):
    """Django's ASGI handler, except that the inference API's requests get no thread of their own
    and pass through none of the middleware that serves the console and the management API.

    Django serves each request inside a ThreadSensitiveContext: the request's first thread-sensitive
    sync call (request_started's receivers, the hooks of Django's own middleware) starts a thread
    for it, which lives until the response ends: an idle thread per open stream. Requests under
    /v1/ run those calls (brief, no I/O) on asgiref's one process-wide sync thread instead, and
    their blocking work on the gateway's thread pool (gateway/offload.py). They are served by
    `InferenceASGIHandler`, whose middleware is INFERENCE_MIDDLEWARE. Other requests (the console
    and the management API, sync views) keep a thread of their own, so a slow page never holds up
    another request.
    """

    def __init__(self):
        super().__init__()
        self.inference = InferenceASGIHandler()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(THREADLESS_PREFIX):
            await self.inference.handle(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)


class InferenceASGIHandler(ASGIHandler):
    """Serves /v1/* behind settings.INFERENCE_MIDDLEWARE instead of settings.MIDDLEWARE, and sends
    request_started and request_finished on the event loop.

    The inference views use no session, user, message or CSRF token, and each of Django's own
    middleware classes runs its hooks through a sync thread: two thread hops per class and
    request, a fifth of a web process's CPU under load, for nothing this API uses.

    Django's own `handle` also sends request_started and closes the response (which sends
    request_finished) through the sync thread: two more hops per request, each a thread wake-up and
    an interpreter-lock hand-over while the loop relays other streams. Their receivers (Django's
    close_old_connections, reset_queries, close_caches) act on what the calling thread opened, and
    the inference API opens no database connection on the event loop (its ORM work runs on gateway
    threads, which give their connection back after each call: gateway/offload.py), so here they
    run on the loop, where they find nothing to do. Otherwise `handle` is Django 5.2's, and so is
    `send_response`, but for a streamed response's last part (config/streaming.py).
    """

    def load_middleware(self, is_async=False):
        # Django builds the chain from settings.MIDDLEWARE; this runs once, when the process starts.
        full = settings.MIDDLEWARE
        settings.MIDDLEWARE = settings.INFERENCE_MIDDLEWARE
        try:
            super().load_middleware(is_async=is_async)
        finally:
            settings.MIDDLEWARE = full

    async def handle(self, scope, receive, send):
        try:
            body_file = await self.read_body(receive)
        except RequestAborted:
            return
        set_script_prefix(get_script_prefix(scope))
        signals.request_started.send(sender=self.__class__, scope=scope)
        request, error_response = self.create_request(scope, body_file)
        if request is None:
            body_file.close()
            await self.send_response(error_response, send)
            error_response.close()
            return
        response = await self._respond_unless_disconnected(request, receive, send)
        if response is None:
            signals.request_finished.send(sender=self.__class__)
        else:
            response.close()
        body_file.close()

    async def send_response(self, response, send):
        """Django's, except that a streamed response's FinalPart goes out in the message that ends
        the body (config/streaming.py), not followed by an empty one."""
        if not response.streaming:
            return await super().send_response(response, send)
        headers = [(_encoded(name, "ascii"), _encoded(value, "latin1")) for name, value in response.items()]
        headers += [(b"Set-Cookie", c.output(header="").encode("ascii").strip()) for c in response.cookies.values()]
        await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
        async with contextlib.aclosing(aiter(response)) as content:
            async for part in content:
                final = isinstance(part, FinalPart)
                for chunk, last in self.chunk_bytes(part):
                    await send({"type": "http.response.body", "body": chunk, "more_body": not (final and last)})
                if final:
                    return
        await send({"type": "http.response.body"})

    async def _respond_unless_disconnected(self, request, receive, send):
        """Get and send the response while listening for the client's disconnect, which cancels the
        view (as Django does); the response, or None if it was cancelled.

        Unlike Django's, a response whose body is sent is let finish: uvicorn answers the listener
        with `http.disconnect` as soon as the body's last message is out (and starts the
        connection's next request), while the response's task may still be closing its stream
        (gateway/streams.py: the reader's wake). That is not a client leaving."""
        body_sent = False

        async def send_noting_the_end(message):
            nonlocal body_sent
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                body_sent = True

        async def process_request():
            response = await self.run_get_response(request)
            with contextlib.suppress(asyncio.CancelledError):  # the client left during the send
                await self.send_response(response, send_noting_the_end)
            return response

        responder = asyncio.create_task(process_request())
        tasks = [asyncio.create_task(self.listen_for_disconnect(receive)), responder]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        if body_sent and not responder.done():
            await asyncio.wait([responder])
        for task in tasks:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            else:
                with contextlib.suppress(RequestAborted):
                    task.result()
        try:
            return tasks[1].result()
        except asyncio.CancelledError:
            return None


def _encoded(value: str | bytes, encoding: str) -> bytes:
    return value if isinstance(value, bytes) else value.encode(encoding)


# What django.core.asgi.get_asgi_application() does, with the handler above, behind the request body
# limit (a body over MAX_REQUEST_BYTES: 413 before Django reads it; a declared one up to 8 times that is
# drained first, so the client reads the 413 rather than a reset connection).
django.setup(set_prefix=False)
from django.conf import settings  # noqa: E402

from config.middleware import RequestBodyLimit  # noqa: E402

application = RequestBodyLimit(
    PlatformASGIHandler(),
    limit=settings.MAX_REQUEST_BYTES,
    drain_limit=8 * settings.MAX_REQUEST_BYTES,
    # An adapter upload (multipart: files go to disk, not memory) may be as large as ADAPTER_MAX_BYTES.
    larger=((r"^/api/v1/tenants/[^/]+/adapters/$", settings.ADAPTER_MAX_BYTES + 65536),),
)
