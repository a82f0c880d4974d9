"""Django's error views (400, 403, 404, 500) and the 413 body: JSON in the API's documented error
shape under /v1/ (OpenAI's) and /api/v1/ (the management API's, docs/api.md), Django's HTML pages
elsewhere (the console, the admin). Used when DEBUG is off; with DEBUG on Django shows its debug pages.
"""

import json

from django.http import HttpResponse
from django.urls import Resolver404
from django.views import defaults

from core.errors import error_body
from management.errors import management_error_body

OPENAI_PREFIX = "/v1/"
MANAGEMENT_PREFIX = "/api/v1/"


def is_api_path(path: str) -> bool:
    return path.startswith((OPENAI_PREFIX, MANAGEMENT_PREFIX)) or path in {"/v1", "/api/v1"}


def api_error_body(path: str, status: int, message: str, code: str) -> dict:
    """The error body of an API path (is_api_path) in that API's shape."""
    if path.startswith(OPENAI_PREFIX) or path == "/v1":
        kind = "server_error" if status >= 500 else "permission_error" if status == 403 else "invalid_request_error"
        return error_body(message, type=kind, code=code)
    return management_error_body(message, status, code=code)


def _json(request, status: int, message: str, code: str) -> HttpResponse:
    body = api_error_body(request.path, status, message, code)
    return HttpResponse(json.dumps(body), status=status, content_type="application/json")


def bad_request(request, exception):
    if not is_api_path(request.path):
        return defaults.bad_request(request, exception)
    return _json(request, 400, "The request could not be processed.", "bad_request")


def permission_denied(request, exception):
    if not is_api_path(request.path):
        return defaults.permission_denied(request, exception)
    return _json(request, 403, "You may not do this.", "permission_denied")


def not_found(request, exception):
    if not is_api_path(request.path):
        return defaults.page_not_found(request, exception)
    if isinstance(exception, Resolver404):
        return _json(request, 404, f"Unknown endpoint: {request.method} {request.path}", "unknown_url")
    return _json(request, 404, "Not found.", "not_found")


def server_error(request):
    if not is_api_path(request.path):
        return defaults.server_error(request)
    # The exception is in the server's log (django.request); the client learns nothing of its details.
    return _json(request, 500, "The server had an error while processing the request.", "internal_error")
