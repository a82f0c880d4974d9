"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with the right HTTP status."""

import json

from django.http import HttpResponse


class OpenAIError(Exception):
    status = 400
    type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None, headers=None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> HttpResponse:
        response = HttpResponse(json.dumps(self.body()), status=self.status, content_type="application/json")
        for name, value in self.headers.items():
            response[name] = value
        return response


class InvalidRequest(OpenAIError):
    status = 400


class Unauthorized(OpenAIError):
    status = 401
    type = "invalid_request_error"


class PermissionDenied(OpenAIError):
    status = 403
    type = "permission_error"


class NotFound(OpenAIError):
    status = 404


class MethodNotAllowed(OpenAIError):
    status = 405


class PayloadTooLarge(OpenAIError):
    status = 413


class RateLimited(OpenAIError):
    status = 429
    type = "rate_limit_error"


class ServiceUnavailable(OpenAIError):
    status = 503
    type = "service_unavailable_error"
