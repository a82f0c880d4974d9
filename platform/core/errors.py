"""The application's errors: what went wrong, in terms every face can render.

Domain apps raise these (never a face's HTTP errors, never a bare ValueError for a refusal the
caller should show). Each carries the HTTP status it means, the OpenAI error `type`, an optional
machine-readable `code`, the request `param` at fault and response `headers` (Retry-After,
x-ratelimit-*). `body()` is the OpenAI error object, {"error": {"message", "type", "param", "code"}},
which `error_body` builds: the one place that shape is made, for every face and every path.

Data only: each face renders them in one place of its own, the inference API as that body
(`gateway.errors.error_response`), the management API with its own types in its exception handler
(management/errors.py), the console as a message on the page (console/errors.py).
"""


def error_body(message: str, *, type: str, param: str | None = None, code: str | None = None) -> dict:  # noqa: A002
    """The OpenAI error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


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
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


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


class BadGateway(AppError):
    """A worker failed the request (an engine error, a lost worker)."""

    status = 502
    type = "server_error"


class ServiceUnavailable(AppError):
    status = 503
    type = "service_unavailable_error"
