"""Bad input to the OpenAI endpoints is a 400 in OpenAI's error shape, decided when the body is parsed
(nothing enqueued, nothing billed), never a 500; a server error under /v1/ answers JSON too."""

import pytest
from django.test import Client

from ledger.models import UsageRecord
from tests.bad_input import DIGITS_5000, NESTED_40, NESTED_5000, error_of, post_raw, raw_json

pytestmark = pytest.mark.django_db(transaction=True)  # the views do their work on gateway threads

ENDPOINTS = ["/v1/chat/completions", "/v1/completions"]


@pytest.fixture
def key(make_tenant, redis_client):
    _, plaintext = make_tenant("fuzzed")
    return plaintext


def _body(path: str, **fields: bytes) -> bytes:
    """A valid request to `path` with `fields` (raw JSON text) added."""
    question = {"messages": b'[{"role": "user", "content": "hi"}]'} if "chat" in path else {"prompt": b'"hi"'}
    return raw_json(model=b'"tiny-gemma4"', **question, **fields)


@pytest.mark.parametrize("path", ENDPOINTS)
@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("user", NESTED_5000, "nests deeper"),
        ("user", NESTED_40, "nests deeper"),
        ("seed", DIGITS_5000, "digits"),
        ("temperature", b"NaN", "NaN"),
        ("top_p", b"Infinity", "Infinity"),
        ("presence_penalty", b"-Infinity", "-Infinity"),
        ("frequency_penalty", b"-1e400", "out of range"),
    ],
    ids=["nested-5000", "nested-40", "int-5000-digits", "nan", "infinity", "minus-infinity", "overflowing-float"],
)
def test_bodies_json_cannot_hold_are_refused_at_parse_time(key, redis_client, path, field, value, says):
    error = error_of(post_raw(Client(), path, key, _body(path, **{field: value})), 400)
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_json")
    assert says in error["message"]
    assert not redis_client.keys("req:*") and not UsageRecord.objects.exists()  # nothing enqueued or billed


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        ("/v1/completions", rb'{"model": "tiny-gemma4", "prompt": "caf\ud800"}', "prompt"),
        ("/v1/completions", rb'{"model": "tiny-gemma4", "prompt": ["\udc00"]}', "prompt[0]"),
        (
            "/v1/chat/completions",
            rb'{"model": "tiny-gemma4", "messages": [{"role": "user", "content": "\ud83d"}]}',
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            rb'{"model": "tiny-gemma4", "messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}',  # noqa: E501
            "messages[0].content[0].text",
        ),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_param(key, redis_client, path, raw, param):
    error = error_of(post_raw(Client(), path, key, raw), 400)
    assert (error["param"], error["code"]) == (param, "invalid_value")
    assert not redis_client.keys("req:*")


def test_an_unknown_v1_path_is_an_openai_404(db):
    error = error_of(Client().get("/v1/no-such-endpoint"), 404)
    assert (error["type"], error["code"]) == ("invalid_request_error", "unknown_url")


@pytest.mark.parametrize("path", ENDPOINTS)
def test_a_server_error_under_v1_is_an_openai_500(key, monkeypatch, path):
    from gateway import lifecycle

    def broken(http_request):
        raise RuntimeError("a bug")

    monkeypatch.setattr(lifecycle, "authenticate", broken)
    response = post_raw(Client(raise_request_exception=False), path, key, _body(path, seed=b"1"))
    error = error_of(response, 500)
    assert (error["type"], error["code"]) == ("server_error", "internal_error")
    assert "a bug" not in error["message"]
