"""The application's errors: what went wrong, in terms every face can render.

Domain apps raise these (never a face's HTTP errors, never a bare ValueError for a refusal the
caller should show). Each carries the HTTP status it means, the OpenAI error `type`, an optional
machine-readable `code`, the request `param` at fault and response `headers` (Retry-After,
x-ratelimit-*). `body()` is the OpenAI error object, {"error": {"message", "type", "param", "code"}},
which the inference API returns as is; the management API maps the same fields to its own types
in its one exception handler (api/errors.py).
"""

import json

from django.http import HttpResponse


class AppError(Exception):
    status = 400
    type = "invalid_request_error"

    def __init__(
        self, message: str, *, param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code
        self.headers: dict[str, str] = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> HttpResponse:
        """The error as the inference API's JSON response (`gateway.errors` names this family
        `OpenAIError`): its `body()`, status and headers."""
        response = HttpResponse(json.dumps(self.body()), status=self.status, content_type="application/json")
        for name, value in self.headers.items():
            response[name] = value
        return response


class InvalidRequest(AppError):
    status = 400


class Unauthorized(AppError):
    status = 401
    type = "invalid_request_error"


class PermissionDenied(AppError):
    status = 403
    type = "permission_error"


class NotFound(AppError):
    status = 404


class MethodNotAllowed(AppError):
    status = 405


class Conflict(AppError):
    """The request contradicts the current state (a key already revoked, an invoice period not over)."""

    status = 409


class PayloadTooLarge(AppError):
    status = 413


class RateLimited(AppError):
    status = 429
    type = "rate_limit_error"


class ServiceUnavailable(AppError):
    status = 503
    type = "service_unavailable_error"
