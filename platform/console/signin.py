"""Password sign-in forms, all rate limited by the same counters (`console.services.login_*`).

The console's login and the Django admin's share one budget per client address and username, so a
password cannot be guessed at a higher rate through the other form.
"""

from __future__ import annotations

import logging

import redis
from django.contrib.admin.forms import AdminAuthenticationForm
from django.contrib.auth.forms import AuthenticationForm
from django.core.exceptions import ValidationError

from console import services

log = logging.getLogger(__name__)

THROTTLE_MESSAGES = {
    "throttled": "Too many failed sign-in attempts. Try again in %(minutes)s minute(s).",
    "unavailable": "Sign-in is unavailable right now; try again shortly.",
}


class ThrottledSignInMixin:
    """For an AuthenticationForm: checks the rate limit before the password, counts each failure."""

    def _address(self) -> str:
        return self.request.META.get("REMOTE_ADDR", "") if self.request else ""

    def clean(self):
        username = self.cleaned_data.get("username") or ""
        address = self._address()
        try:
            throttle = services.login_throttle_check(address=address, username=username)
        except redis.RedisError:
            # Fail closed: without the counter a password could be guessed at any rate.
            log.exception("login rate limiter unreachable")
            raise ValidationError(self.error_messages["unavailable"], code="unavailable") from None
        if not throttle.allowed:
            minutes = max(1, -(-throttle.retry_after // 60))
            raise ValidationError(self.error_messages["throttled"], code="throttled", params={"minutes": minutes})
        try:
            cleaned = super().clean()
        except ValidationError:
            services.login_failure_record(address=address, username=username)
            raise
        services.login_success_record(address=address, username=username)
        return cleaned


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
