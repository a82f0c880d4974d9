"""Tenants and their API keys.

An API key is shown once, at creation. We store only its public lookup prefix and an HMAC-SHA256
digest of the whole key (keyed by settings.API_KEY_HMAC_KEY), which is compared in constant time.
"""

from django.db import models

from core import clock


class Tenant(models.Model):
    name = models.SlugField(max_length=64, unique=True)
    display_name = models.CharField(max_length=200, blank=True)
    is_active = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class ApiKey(models.Model):
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100, blank=True)
    prefix = models.CharField(max_length=16, unique=True, help_text="Public part of the key, used to find it.")
    digest = models.CharField(max_length=64, help_text="HMAC-SHA256 of the whole key, hex.")
    # Empty list: every model served to the tenant.
    allowed_models = models.JSONField(default=list, blank=True)
    is_admin = models.BooleanField(default=False, help_text="May manage its own tenant through /api/v1/.")
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.tenant.name}/{self.prefix}"

    def is_usable(self, now=None) -> bool:
        now = now or clock.now()
        if self.revoked_at is not None and self.revoked_at <= now:
            return False
        return self.expires_at is None or self.expires_at > now
