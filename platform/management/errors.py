"""One exception handler for the management API: every error in OpenAI's shape,
{"error": {"message", "type", "param", "code"}}; a validation error names the offending field.
The application's errors (core/errors.py), which the domain services raise, keep their status,
message, param, code and headers; their `type` is this API's for the status."""

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.http import Http404
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import set_rollback

from config.database import OUTAGE_ERRORS, DatabaseUnavailable
from core.errors import AppError, error_body

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
}


class Conflict(exceptions.APIException):
    status_code = status.HTTP_409_CONFLICT
    default_code = "conflict"


def _first_error(detail, path: str = ""):
    """(param, message, code) of the first error in a DRF ValidationError detail."""
    if isinstance(detail, dict):
        for field, inner in detail.items():
            name = path if field == "non_field_errors" else (f"{path}.{field}" if path else str(field))
            return _first_error(inner, name)
    if isinstance(detail, list) and detail:
        return _first_error(detail[0], path)
    code = getattr(detail, "code", None)
    return path or None, str(detail), code


def management_error_body(message: str, status_code: int, *, param=None, code=None) -> dict:
    """The OpenAI error object with this API's `type` for the status."""
    return error_body(message, type=_TYPES.get(status_code, "server_error"), param=param, code=code)


class DatabaseDown(exceptions.APIException):
    status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    default_detail = "The database is unavailable; try again shortly."
    default_code = "database_unavailable"


def exception_handler(exc, context):
    if isinstance(exc, AppError):
        set_rollback()
        body = management_error_body(exc.message, exc.status, param=exc.param, code=exc.code)
        return Response(body, status=exc.status, headers=dict(exc.headers))
    if isinstance(exc, (DatabaseUnavailable, *OUTAGE_ERRORS)):
        exc = DatabaseDown()
        exc.wait = 5
    if isinstance(exc, Http404):
        exc = exceptions.NotFound()
    elif isinstance(exc, DjangoPermissionDenied):
        exc = exceptions.PermissionDenied()
    if not isinstance(exc, exceptions.APIException):
        return None  # a bug: Django's 500 handling applies
    headers = {}
    if getattr(exc, "auth_header", None):
        headers["WWW-Authenticate"] = exc.auth_header
    if getattr(exc, "wait", None):
        headers["Retry-After"] = str(int(exc.wait))
    if isinstance(exc, exceptions.ValidationError):
        param, message, code = _first_error(exc.detail)
        message = f"{param}: {message}" if param else message
    else:
        param, message, code = None, str(exc.detail), exc.get_codes() if isinstance(exc.get_codes(), str) else None
    set_rollback()
    return Response(
        management_error_body(message, exc.status_code, param=param, code=code), status=exc.status_code, headers=headers
    )
