"""The inference API's errors: the application's error family (core/errors.py) under the names the
gateway has always used, and their one rendering, `error_response`. `OpenAIError` is
`core.errors.AppError` itself, not a subclass, so that the OpenAI views' one handler
(`gateway.views.openai_endpoint`) also catches, and renders, the errors the domain apps raise (an
unknown model, a refused admission)."""

import json

from django.http import HttpResponse

from core.errors import AppError as OpenAIError
from core.errors import (
    BadGateway,
    Conflict,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    PermissionDenied,
    RateLimited,
    ServiceUnavailable,
    Unauthorized,
)

__all__ = [
    "BadGateway",
    "Conflict",
    "InvalidRequest",
    "MethodNotAllowed",
    "NotFound",
    "OpenAIError",
    "PayloadTooLarge",
    "PermissionDenied",
    "RateLimited",
    "ServiceUnavailable",
    "Unauthorized",
    "error_response",
]


def error_response(exc: OpenAIError) -> HttpResponse:
    """The error as the inference API's JSON response: its OpenAI body, status and headers."""
    response = HttpResponse(json.dumps(exc.body()), status=exc.status, content_type="application/json")
    for name, value in exc.headers.items():
        response[name] = value
    return response
