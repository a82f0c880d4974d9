"""The gateway gives its database connection back, answers a backing-service outage with a 503,
rides out a Redis restart mid-stream, and stops a request whose client went away."""

import asyncio
import json
import threading
import time

import pytest
from django import db
from django.test import Client
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ledger.models import UsageRecord
from tests.gateway import relaying
from tests.quotas.helpers import worker_reports


@pytest.fixture
def connections_close_at_request_end():
    """Per-request connections, as with the pool (CONN_MAX_AGE 0); the suite itself keeps them."""
    settings_dict = db.connection.settings_dict
    before = settings_dict["CONN_MAX_AGE"]
    db.connection.close()
    settings_dict["CONN_MAX_AGE"] = 0
    yield
    settings_dict["CONN_MAX_AGE"] = before


def _finished_request(make_tenant, redis_client, request_id: str):
    """A tenant whose request `request_id` just ended: its reservation held, the worker's usage pending."""
    from quotas.admission import quota_admit
    from quotas.limits import limits_for
    from tenants.models import ApiKey

    tenant, _ = make_tenant("erin")
    key_id = ApiKey.objects.get(tenant=tenant).id
    limits = limits_for(tenant_id=tenant.id, key_id=key_id)
    quota_admit(request_id=request_id, tenant_id=tenant.id, key_id=key_id, limits=limits, prompt_tokens=7,
                max_tokens=10, implicit_max_tokens=False)  # fmt: skip
    worker_reports(redis_client, request_id, tenant, key_id, prompt=7, completion=3)
    db.connection.close()
    return tenant


def _record_on_a_gateway_thread(request_id: str):
    """What `lifecycle.record` does with batching off: `ledger_flush` through run_blocking. Returns
    the database connection wrapper of the thread that ran it."""
    from gateway.offload import run_blocking
    from ledger.services import ledger_flush

    def record():
        ledger_flush(request_ids=[request_id])
        return db.connections["default"]  # this thread's own

    return asyncio.run(run_blocking(record))


def _record_as_the_views_do(request_id: str) -> None:
    from gateway import lifecycle

    asyncio.run(lifecycle.record(relaying.job(request_id)))


@pytest.mark.django_db(transaction=True)
def test_an_unbatched_reply_writes_its_row_and_its_thread_gives_the_connection_back(
    connections_close_at_request_end, make_tenant, redis_client, settings
):
    settings.LEDGER_BATCH_SECONDS = 0
    _finished_request(make_tenant, redis_client, "chatcmpl-conn")

    thread_connection = _record_on_a_gateway_thread("chatcmpl-conn")

    # The usage row was written, and the connection that wrote it was closed (returned to the pool):
    # one kept open stays with this idle gateway thread, and enough of those starve the pool.
    assert thread_connection.connection is None
    assert UsageRecord.objects.get(request_id="chatcmpl-conn").completion_tokens == 3
    assert not redis_client.exists("resv:chatcmpl-conn")


@pytest.mark.django_db(transaction=True)
def test_a_batched_reply_has_its_row_written_soon_without_a_database_connection_on_the_loop(
    connections_close_at_request_end, make_tenant, redis_client, settings
):
    settings.LEDGER_BATCH_SECONDS = 0.05
    _finished_request(make_tenant, redis_client, "chatcmpl-batch")

    _record_as_the_views_do("chatcmpl-batch")  # on the event loop: no thread, no database connection

    deadline = time.monotonic() + 10
    while not UsageRecord.objects.filter(request_id="chatcmpl-batch").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert UsageRecord.objects.get(request_id="chatcmpl-batch").completion_tokens == 3
    assert not redis_client.hexists("ledger:pending", "chatcmpl-batch")
    # The worker settles a request it ends (tests/workers/test_relay.py); the row's write settles
    # one it did not (an older worker during an upgrade).
    assert not redis_client.exists("resv:chatcmpl-batch")


@pytest.mark.django_db
def test_an_unreachable_redis_is_a_503_in_openai_shape(monkeypatch):
    from gateway import lifecycle

    def redis_down(*args, **kwargs):
        raise RedisConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    monkeypatch.setattr(lifecycle, "authenticate", redis_down)  # the first step of every request
    body = {"model": "tiny-gemma4", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    reply = Client().post(
        "/v1/chat/completions", json.dumps(body), content_type="application/json",
        headers={"Authorization": "Bearer gpk_x"},
    )  # fmt: skip

    assert reply.status_code == 503, reply.content
    assert reply["Retry-After"] == "2"
    assert reply.json()["error"] == {
        "message": "The service is temporarily unavailable; try again shortly.",
        "type": "service_unavailable_error",
        "param": None,
        "code": "service_unavailable",
    }


def test_redis_reads_outlast_the_gateways_blocking_reads(settings):
    """redis-py 8 times reads out after 5 s by default, as long as the relay's XREAD blocks: a stream
    waiting for its first token behind a busy pool died with "Timeout reading from socket"."""
    from config.redis_client import get_async_redis, get_redis

    async def async_timeout():
        return get_async_redis().connection_pool.connection_kwargs["socket_timeout"]

    for timeout in (get_redis().connection_pool.connection_kwargs["socket_timeout"], asyncio.run(async_timeout())):
        assert timeout >= settings.SSE_KEEPALIVE_SECONDS + 10


async def _frames(stream) -> str:
    return b"".join([part async for part in stream]).decode()


def test_a_redis_failure_mid_stream_ends_it_with_an_error_event(monkeypatch):
    from gateway import dispatch, lifecycle, views
    from gateway.validation import completion_request

    async def relay(job, model):
        yield [dispatch.Delta("Hello", 1)]
        raise RedisTimeoutError("Timeout reading from socket")

    abandoned, recorded = [], []

    async def abandon(job):  # Redis is still down: telling the worker to stop fails too
        abandoned.append(job)
        raise RedisConnectionError("Connection refused")

    monkeypatch.setattr(dispatch, "relay", relay)
    monkeypatch.setattr(dispatch, "abandon", abandon)
    monkeypatch.setattr(lifecycle, "record", relaying.async_append(recorded))
    enqueued = relaying.enqueued("cmpl-cut", completion_request({"model": "m", "prompt": "hi", "stream": True}))
    job = enqueued.request

    frames = asyncio.run(_frames(views._stream(enqueued)))

    events = [line[6:] for line in frames.splitlines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["text"] == "Hello"
    assert json.loads(events[1])["error"]["code"] == "stream_interrupted"
    assert json.loads(events[1])["error"]["type"] == "service_unavailable_error"
    assert events[2] == "[DONE]"
    assert abandoned == [job]  # the worker is asked to stop; either way it records what it generated
    assert recorded == []  # no fast path into the ledger without Redis: the periodic flush writes it


class _Waiting:
    """A relay that yields one delta, then waits for tokens that never come; says when it waits."""

    def __init__(self):
        self.waiting = asyncio.Event()

    async def relay(self, job, model):
        from gateway import dispatch

        yield [dispatch.Delta("Hello", 1)]
        self.waiting.set()
        await asyncio.Event().wait()
        yield [dispatch.Delta("never", 1)]  # pragma: no cover


def _stream_spec():
    from gateway.validation import completion_request

    return completion_request({"model": "m", "prompt": "hi", "stream": True})


def test_a_stream_cancelled_while_it_waits_for_tokens_abandons_its_request(monkeypatch):
    """Django cancels the response task when the ASGI server reports the client gone."""
    from gateway import dispatch, lifecycle, views

    relay, abandoned, recorded = _Waiting(), [], []

    async def abandon(job):
        abandoned.append(job.request_id)

    monkeypatch.setattr(dispatch, "relay", relay.relay)
    monkeypatch.setattr(dispatch, "abandon", abandon)
    monkeypatch.setattr(lifecycle, "record", relaying.async_append(recorded))

    async def scenario():
        stream = views._stream(relaying.enqueued("cmpl-gone", _stream_spec()))
        consumer = asyncio.ensure_future(_frames(stream))
        await relay.waiting.wait()
        consumer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await consumer

    asyncio.run(scenario())
    assert abandoned == ["cmpl-gone"]
    assert recorded == []  # the worker records what it generated before it stopped


def test_a_stream_the_server_stops_consuming_abandons_its_request_at_once(monkeypatch):
    """A cancel that lands while the server waits on the client's socket closes only the iterator
    the server holds: the response closes the stream's own generator with it."""
    from gateway import dispatch, views

    abandoned = []

    async def abandon(job):
        abandoned.append(job.request_id)

    async def relay(job, model):
        while True:
            yield [dispatch.Delta("x", 1)]

    monkeypatch.setattr(dispatch, "relay", relay)
    monkeypatch.setattr(dispatch, "abandon", abandon)

    async def scenario():
        response = views._EventStreamResponse(views._stream(relaying.enqueued("cmpl-stuck", _stream_spec())))
        frames = aiter(response)
        await anext(frames)  # the opening frame
        await anext(frames)  # a delta: the stream's generator now waits at a yield
        await frames.aclose()  # what Django's send_response does when its send is cancelled

    asyncio.run(scenario())
    assert abandoned == ["cmpl-stuck"]


def test_every_middleware_runs_on_the_event_loop_under_asgi(settings, caplog):
    """A sync-only middleware would make Django adapt the stack around it, moving every request,
    the async inference views included, onto a thread (it logs each adaptation when DEBUG is on)."""
    from config.asgi import PlatformASGIHandler

    settings.DEBUG = True
    with caplog.at_level("DEBUG", logger="django.request"):
        PlatformASGIHandler()  # loads the middleware stack in async mode

    assert not [r.getMessage() for r in caplog.records if "adapted" in r.getMessage()]


async def _asgi_get(app, path: str) -> tuple[int, dict[bytes, bytes]]:
    from asgiref.testing import ApplicationCommunicator

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"host", b"testserver")], "client": ("127.0.0.1", 1234), "server": ("testserver", 80),
    }  # fmt: skip
    communicator = ApplicationCommunicator(app, scope)
    await communicator.send_input({"type": "http.request", "body": b"", "more_body": False})
    start = await communicator.receive_output(timeout=60)
    await communicator.receive_output(timeout=60)  # the body
    await communicator.wait(timeout=60)  # the handler's end (the response's close)
    return start["status"], dict(start["headers"])


@pytest.mark.django_db(transaction=True)
def test_the_inference_api_passes_through_none_of_djangos_own_middleware(monkeypatch):
    """Each of Django's own middleware classes runs its hooks on a sync thread: the inference API
    (none of whose views use a session, a user or a CSRF token) is served without them, with the
    security headers an API response needs; the console still gets the whole stack."""
    from django.contrib.sessions.middleware import SessionMiddleware
    from django.middleware.security import SecurityMiddleware

    from config.asgi import PlatformASGIHandler

    hooks: list[str] = []
    for cls in (SessionMiddleware, SecurityMiddleware):
        original = cls.process_request

        def recording(self, request, original=original, name=cls.__name__):
            hooks.append(f"{name} {request.path}")
            return original(self, request)

        monkeypatch.setattr(cls, "process_request", recording)
    app = PlatformASGIHandler()

    status, headers = asyncio.run(_asgi_get(app, "/v1/models"))
    assert status == 401  # no key: answered by the view, behind the inference middleware only
    assert hooks == []
    assert headers[b"X-Content-Type-Options"] == b"nosniff"

    asyncio.run(_asgi_get(app, "/console/login/"))
    assert hooks == ["SecurityMiddleware /console/login/", "SessionMiddleware /console/login/"]


@pytest.mark.django_db(transaction=True)
def test_the_inference_api_sends_the_request_signals_on_the_event_loop():
    """Django sends request_started and request_finished (the response's close) through its sync
    thread: two thread hops per request. The inference API sends them on the event loop; the console
    keeps Django's way."""
    from django.core import signals

    from config.asgi import PlatformASGIHandler

    threads: list[tuple[str, str]] = []

    def started(sender, **kwargs):
        threads.append(("started", threading.current_thread().name))

    def finished(sender, **kwargs):
        threads.append(("finished", threading.current_thread().name))

    signals.request_started.connect(started)
    signals.request_finished.connect(finished)
    try:
        app = PlatformASGIHandler()

        async def served(path: str) -> tuple[int, str]:
            status, _ = await _asgi_get(app, path)
            return status, threading.current_thread().name

        status, loop_thread = asyncio.run(served("/v1/models"))
        assert status == 401
        assert threads == [("started", loop_thread), ("finished", loop_thread)]

        threads.clear()
        status, loop_thread = asyncio.run(served("/console/login/"))
        assert status == 200
        assert [name for name, _ in threads] == ["started", "finished"]
        assert all(thread != loop_thread for _, thread in threads)
    finally:
        signals.request_started.disconnect(started)
        signals.request_finished.disconnect(finished)
