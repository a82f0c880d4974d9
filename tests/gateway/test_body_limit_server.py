"""An over-size request body under the real server (gunicorn + uvicorn worker, deploy/gunicorn.conf.py):
a 413 that leaves the client's keep-alive connection usable, or closed cleanly."""

import httpx
import pytest

from tests.gateway.web_server import web_server

pytestmark = pytest.mark.django_db(transaction=True)

MAX_REQUEST_BYTES = 4096


@pytest.fixture
def server(redis_client, make_tenant, tmp_path):
    """The web tier with MAX_REQUEST_BYTES small; yields (url, key)."""
    _, key = make_tenant("big-bodies", is_admin=True)  # may call /api/v1/ too
    # No tokenizer is needed: no request gets past its body.
    with web_server(tmp_path, GUNICORN_WARM_IMPORTS="", MAX_REQUEST_BYTES=str(MAX_REQUEST_BYTES)) as (base_url, _):
        yield base_url, key


def _body(size: int) -> bytes:
    return b'{"model": "m", "prompt": "' + b"x" * size + b'"}'


# A body the server drains before it answers (up to 8 times the limit), and one far beyond that.
@pytest.mark.parametrize("size", [MAX_REQUEST_BYTES * 2, MAX_REQUEST_BYTES * 256])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/api/v1/plans/"])
def test_an_over_size_body_gets_a_413_and_the_connection_stays_usable(server, path, size):
    base_url, key = server
    body = _body(size)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    with httpx.Client(base_url=base_url, timeout=30) as client:
        too_big = client.post(path, content=body, headers=headers)
        assert too_big.status_code == 413
        assert too_big.json()["error"]["code"] == "payload_too_large"
        assert too_big.headers["connection"] == "close"
        # The same client again: a new connection, transparently (the server closed the old one cleanly).
        assert client.get("/healthz").status_code == 200
        small = client.post(path, content=b"{}", headers=headers)  # served: a 400 (or the plans' 403)
        assert small.status_code in (400, 403), small.text


def test_an_over_size_chunked_body_gets_a_413(server):
    base_url, key = server
    chunks = iter([_body(MAX_REQUEST_BYTES)[:-2], b"xxxxxxxx" * 64, b'"}'])  # no Content-Length: chunked
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    with httpx.Client(base_url=base_url, timeout=30) as client:
        too_big = client.post("/v1/completions", content=chunks, headers=headers)
        assert too_big.status_code == 413
        assert too_big.json()["error"]["code"] == "payload_too_large"
        assert client.get("/healthz").status_code == 200


def test_a_body_within_the_limit_is_served_on_the_same_connection(server):
    base_url, key = server
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    with httpx.Client(base_url=base_url, timeout=30) as client:
        for _ in range(2):
            answer = client.post("/v1/completions", content=_body(MAX_REQUEST_BYTES // 2), headers=headers)
            assert answer.status_code == 404  # model "m" does not exist: the body was read and parsed
            assert answer.headers.get("connection") != "close"
