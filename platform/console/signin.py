"""Every form that checks a password, rate limited by the same counters (`console.services.login_*`).

The console's login, the Django admin's login and the admin's password change (its current-password
check) share one budget per client address and username, so a password cannot be guessed at a
higher rate through another form.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import redis
from django.contrib.admin.forms import AdminAuthenticationForm, AdminPasswordChangeForm
from django.contrib.auth.forms import AuthenticationForm
from django.contrib.auth.views import PasswordChangeView
from django.core.exceptions import ValidationError

from console import services

log = logging.getLogger(__name__)

T = TypeVar("T")

THROTTLE_MESSAGES = {
    "throttled": "Too many failed sign-in attempts. Try again in %(minutes)s minute(s).",
    "unavailable": "Sign-in is unavailable right now; try again shortly.",
}


def throttled_password_check(form, *, username: str, check: Callable[[], T]) -> T:
    """``check()`` (which raises ValidationError for a wrong password) under the sign-in rate limit:
    the limit is checked before the password, and each failure is counted. ``form`` has ``request``
    (its client's address) and THROTTLE_MESSAGES among its ``error_messages``."""
    address = form.request.META.get("REMOTE_ADDR", "") if form.request else ""
    try:
        throttle = services.login_throttle_check(address=address, username=username)
    except redis.RedisError:
        # Fail closed: without the counter a password could be guessed at any rate.
        log.exception("login rate limiter unreachable")
        raise ValidationError(form.error_messages["unavailable"], code="unavailable") from None
    if not throttle.allowed:
        minutes = max(1, -(-throttle.retry_after // 60))
        raise ValidationError(form.error_messages["throttled"], code="throttled", params={"minutes": minutes})
    try:
        result = check()
    except ValidationError:
        services.login_failure_record(address=address, username=username)
        raise
    services.login_success_record(address=address, username=username)
    return result


class ThrottledSignInMixin:
    """For an AuthenticationForm: checks the rate limit before the password, counts each failure."""

    def clean(self):
        return throttled_password_check(self, username=self.cleaned_data.get("username") or "", check=super().clean)


class AdminLoginForm(ThrottledSignInMixin, AdminAuthenticationForm):
    """The Django admin's login form (staff only), rate limited like the console's."""

    error_messages = {**AdminAuthenticationForm.error_messages, **THROTTLE_MESSAGES}


class ConsoleLoginForm(ThrottledSignInMixin, AuthenticationForm):
    """The console's login form: staff, or a tenant admin (a user with a tenant membership)."""

    error_messages = {
        **AuthenticationForm.error_messages,
        **THROTTLE_MESSAGES,
        "no_console": "This account has no access to the console.",
    }

    def confirm_login_allowed(self, user):
        super().confirm_login_allowed(user)
        if not user.is_staff and not hasattr(user, "tenant_membership"):
            raise ValidationError(self.error_messages["no_console"], code="no_console")


class AdminPasswordChangeThrottledForm(AdminPasswordChangeForm):
    """The Django admin's password change: its current-password check is rate limited like a sign-in
    (a stolen session must not become a way to guess the password)."""

    error_messages = {**AdminPasswordChangeForm.error_messages, **THROTTLE_MESSAGES}

    def __init__(self, user, *args, request=None, **kwargs):
        super().__init__(user, *args, **kwargs)
        self.request = request

    def clean_old_password(self):
        return throttled_password_check(self, username=self.user.get_username(), check=super().clean_old_password)


class ThrottledPasswordChangeView(PasswordChangeView):
    """Django's password change view, giving the form its request (for the client's address)."""

    form_class = AdminPasswordChangeThrottledForm

    def get_form_kwargs(self):
        return {**super().get_form_kwargs(), "request": self.request}
