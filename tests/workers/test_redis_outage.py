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
