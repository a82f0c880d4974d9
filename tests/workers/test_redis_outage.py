"""A worker's writes to Redis wait out an outage (workers/serving.py `_through_outage`)."""

import pytest
import redis

from workers import serving


def _flaky(failures: int):
    calls = []

    def call():
        calls.append(1)
        if len(calls) <= failures:
            raise redis.ConnectionError("Error while reading from 127.0.0.1:6379 : (104, 'Connection reset by peer')")
        return "written"

    return call, calls


def test_a_write_is_retried_until_redis_is_back(monkeypatch):
    monkeypatch.setattr(serving.time, "sleep", lambda seconds: None)
    call, calls = _flaky(failures=3)
    assert serving._through_outage(call, seconds=30, what="testing") == "written"
    assert len(calls) == 4


def test_a_write_gives_up_after_its_bound():
    call, calls = _flaky(failures=10**6)
    with pytest.raises(redis.ConnectionError):
        serving._through_outage(call, seconds=0.2, what="testing")
    assert 2 <= len(calls) < 10  # backed off, not spun


def test_other_errors_are_not_retried():
    def call():
        raise redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value")

    with pytest.raises(redis.ResponseError):
        serving._through_outage(call, seconds=30, what="testing")


class _ReplyLost:
    """A Redis client whose first XADD (or EXEC) reaches the server but whose reply is lost."""

    def __init__(self, client):
        self.client, self.lost = client, False

    def _lose_once(self, result):
        if not self.lost:
            self.lost = True
            raise redis.ConnectionError("Connection closed by server.")
        return result

    def xadd(self, *args, **kwargs):
        return self._lose_once(self.client.xadd(*args, **kwargs))

    def pipeline(self, **kwargs):
        pipe, lose = self.client.pipeline(**kwargs), self._lose_once
        execute = pipe.execute
        pipe.execute = lambda **kw: lose(execute(**kw))
        return pipe


def _usage(rid: str):
    from workers.protocol import Usage

    return Usage(request_id=rid, tenant_id=1, key_id=1, model="m", prompt_tokens=3, completion_tokens=2)


def test_an_event_retried_after_its_reply_was_lost_is_written_once(redis_client, monkeypatch):
    from workers import protocol

    monkeypatch.setattr(serving.time, "sleep", lambda seconds: None)
    events = serving.RequestEvents(_ReplyLost(redis_client), "cmpl-1")
    events.append({"t": "delta", "x": "Hello", "n": "1"})
    events.append({"t": "delta", "x": " world", "n": "1"})

    entries = redis_client.xrange(protocol.events_key("cmpl-1"))
    assert [fields["x"] for _, fields in entries] == ["Hello", " world"]  # not "Hello" twice


def test_a_done_event_retried_after_its_reply_was_lost_is_written_once(redis_client, monkeypatch):
    from workers import protocol

    monkeypatch.setattr(serving.time, "sleep", lambda seconds: None)
    events = serving.RequestEvents(_ReplyLost(redis_client), "cmpl-2")
    events.finish(_usage("cmpl-2"))

    entries = redis_client.xrange(protocol.events_key("cmpl-2"))
    assert [fields["t"] for _, fields in entries] == ["done"]
    assert redis_client.hexists(protocol.LEDGER_PENDING, "cmpl-2")
    assert redis_client.ttl(protocol.events_key("cmpl-2")) > 0
