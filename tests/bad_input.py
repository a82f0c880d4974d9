"""Bad input shared by the tests of both API faces (the OpenAI endpoints and the management API):
JSON values that strict parsing must refuse, a body builder that writes values as they are (what
json.dumps cannot or will not write), and the check that an error answer has the documented shape."""

NESTED_5000 = b"[" * 5000 + b"]" * 5000  # deeper than Python's recursion limit
NESTED_40 = b"[" * 40 + b"]" * 40  # deeper than the parsers allow
DIGITS_5000 = b"9" * 5000  # beyond Python's int-from-text limit


def raw_json(**fields: bytes) -> bytes:
    """A JSON object of ``fields``, each value raw JSON text written as given."""
    return b"{" + b", ".join(b'"' + name.encode() + b'": ' + value for name, value in fields.items()) + b"}"


def post_raw(client, path: str, token: str, raw: bytes, method: str = "post"):
    """Send ``raw`` as a JSON body with a bearer token (a Django test client)."""
    send = getattr(client, method)
    return send(path, data=raw, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {token}")


def error_of(response, status: int) -> dict:
    """The answer's error object, after checking its status and the one error shape both faces use."""
    assert response.status_code == status, response.content
    assert response["Content-Type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error
