"""How the console shows the application's errors (core/errors.py) that the services raise: the
console's one mapping of them, as the exception handler is the management API's and
`gateway.errors.error_response` the inference API's. The page is rendered again (or the next one
shown) with the error's message; nothing of its status, type or headers reaches a person."""

from django.contrib import messages
from django.forms import Form

from core.errors import AppError


def form_error(form: Form, exc: AppError) -> None:
    """Show the error on the form's field its `param` names, else on the form as a whole."""
    form.add_error(exc.param if exc.param in form.fields else None, exc.message)


def message_error(request, exc: AppError) -> None:
    """Show the error as a message on the next page (after a redirect)."""
    messages.error(request, exc.message)
