"""Tenants' LoRA adapters: fine-tunes served on a shared base model.

A tenant calls one as `model: "<base>:<name>"`. The files live in the adapter store, addressed by
`digest` (contract/adapter_store.py); this row is the tenant's handle on them. Two tenants who upload
the same files share one stored copy, never one handle.
"""

from django.core.validators import RegexValidator
from django.db import models

from tenants.models import Tenant

# No ':' (it separates the base model from the adapter name in a model id) and no '/'.
adapter_name_validator = RegexValidator(
    r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", "1-64 letters, digits, dots, dashes and underscores; a letter or digit first"
)


class Adapter(models.Model):
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="adapters")
    name = models.CharField(max_length=64, validators=[adapter_name_validator])
    base_model = models.CharField(max_length=200, help_text="The ServedModel.model_id it was trained on.")
    digest = models.CharField(max_length=64, db_index=True, help_text="SHA-256 of its files in the adapter store.")
    rank = models.PositiveIntegerField()
    target_modules = models.JSONField(default=list)
    size_bytes = models.PositiveBigIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["base_model", "name"]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "base_model", "name"], name="adapter_unique_per_tenant_base")
        ]

    def __str__(self) -> str:
        return self.model_id

    @property
    def model_id(self) -> str:
        """What a client passes as `model`."""
        return f"{self.base_model}:{self.name}"
