"""The adapter upload path has a body limit of its own (ADAPTER_MAX_BYTES); every other path keeps
MAX_REQUEST_BYTES."""

import asyncio

from config.middleware import RequestBodyLimit

UPLOAD = r"^/api/v1/tenants/[^/]+/adapters/$"


def _status(path: str, size: int) -> int:
    async def app(scope, receive, send):
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    body = [{"type": "http.request", "body": b"x" * size, "more_body": False}]
    sent = []

    async def receive():
        return body.pop(0) if body else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    limited = RequestBodyLimit(app, limit=1000, drain_limit=8000, larger=((UPLOAD, 5000),))
    scope = {"type": "http", "path": path, "headers": [(b"content-length", str(size).encode())]}
    asyncio.run(limited(scope, receive, send))
    return sent[0]["status"]


def test_an_adapter_upload_may_be_larger_than_other_bodies():
    assert _status("/api/v1/tenants/alice/adapters/", 4000) == 201
    assert _status("/api/v1/tenants/alice/adapters/", 6000) == 413
    assert _status("/api/v1/tenants/alice/keys/", 4000) == 413
    assert _status("/v1/chat/completions", 999) == 201
