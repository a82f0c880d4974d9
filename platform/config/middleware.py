"""Middleware support for serving under ASGI without moving requests onto threads.

Django runs a request through the middleware stack in the mode of each middleware: one that is only
sync-capable makes the handler adapt the rest of the stack around it (sync_to_async, then
async_to_sync), so every request, the async inference views included, would hold a thread while it
runs. Every entry of settings.MIDDLEWARE is therefore sync- and async-capable.
"""

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
