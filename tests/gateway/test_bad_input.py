"""Bad input to the OpenAI endpoints is a 400 in OpenAI's error shape, decided when the body is parsed
(nothing enqueued, nothing billed), never a 500; a server error under /v1/ answers JSON too."""

import pytest
from django.test import Client

from ledger.models import UsageRecord

pytestmark = pytest.mark.django_db(transaction=True)  # the views do their work on gateway threads

ENDPOINTS = ["/v1/chat/completions", "/v1/completions"]
CHAT = b'"messages": [{"role": "user", "content": "hi"}]'
PROMPT = b'"prompt": "hi"'


@pytest.fixture
def key(make_tenant, redis_client):
    _, plaintext = make_tenant("fuzzed")
    return plaintext


def _post(path: str, key: str, raw: bytes, client=None):
    client = client or Client()
    return client.post(path, data=raw, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {key}")


def _body(path: str, extra: bytes) -> bytes:
    return b'{"model": "tiny-gemma4", ' + (CHAT if "chat" in path else PROMPT) + b", " + extra + b"}"


def _error(response, status: int) -> dict:
    assert response.status_code == status, response.content
    assert response["Content-Type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize("path", ENDPOINTS)
@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (b'"user": ' + b"[" * 5000 + b"]" * 5000, "nests deeper"),
        (b'"user": ' + b"[" * 40 + b"]" * 40, "nests deeper"),
        (b'"seed": ' + b"9" * 5000, "digits"),
        (b'"temperature": NaN', "NaN"),
        (b'"top_p": Infinity', "Infinity"),
        (b'"presence_penalty": -Infinity', "-Infinity"),
        (b'"frequency_penalty": -1e400', "out of range"),
    ],
    ids=["nested-5000", "nested-40", "int-5000-digits", "nan", "infinity", "minus-infinity", "overflowing-float"],
)
def test_bodies_json_cannot_hold_are_refused_at_parse_time(key, redis_client, path, extra, says):
    error = _error(_post(path, key, _body(path, extra)), 400)
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
    error = _error(_post(path, key, raw), 400)
    assert (error["param"], error["code"]) == (param, "invalid_value")
    assert not redis_client.keys("req:*")


def test_an_unknown_v1_path_is_an_openai_404(db):
    error = _error(Client().get("/v1/no-such-endpoint"), 404)
    assert (error["type"], error["code"]) == ("invalid_request_error", "unknown_url")


@pytest.mark.parametrize("path", ENDPOINTS)
def test_a_server_error_under_v1_is_an_openai_500(key, monkeypatch, path):
    from gateway import views

    def broken(request):
        raise RuntimeError("a bug")

    monkeypatch.setattr(views, "authenticate", broken)
    response = _post(path, key, _body(path, b'"seed": 1'), client=Client(raise_request_exception=False))
    error = _error(response, 500)
    assert (error["type"], error["code"]) == ("server_error", "internal_error")
    assert "a bug" not in error["message"]
