"""The inference API's errors: the application's error family (core/errors.py) under the names the
gateway has always used. `OpenAIError` is `core.errors.AppError` itself, not a subclass, so that the
OpenAI views' one handler (`gateway.views.openai_endpoint`) also catches, and renders with
`response()`, the errors the domain apps raise (an unknown model, a refused admission)."""

from core.errors import AppError as OpenAIError
from core.errors import (
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
]
