"""The models the platform serves, and which worker pool serves each."""

import copy

from django.core.validators import MinValueValidator, RegexValidator
from django.db import models

pool_name_validator = RegexValidator(r"^[a-z0-9][a-z0-9-]{0,62}$", "lowercase letters, digits and dashes")


class ServedModel(models.Model):
    model_id = models.CharField(max_length=200, unique=True, help_text="The id clients pass as `model`.")
    path = models.CharField(
        max_length=500, help_text="Where the engine and tokenizer load it from: a directory or hub id."
    )
    pool = models.CharField(
        max_length=63, validators=[pool_name_validator], help_text="Worker pool; Celery queue pool.<pool>."
    )
    context_length = models.PositiveIntegerField(validators=[MinValueValidator(16)])
    is_enabled = models.BooleanField(default=True)
    # Takes `image_url` content parts in chat messages (a multimodal model such as gemma-4-E4B-it).
    accepts_images = models.BooleanField(default=False)
    # Requests wait this long for a worker to come up (scale from zero) before a 503.
    cold_start_wait_seconds = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)

    # Set on the copy `with_adapter` makes: the tenant's LoRA adapter this request runs with.
    adapter = None

    class Meta:
        ordering = ["model_id"]

    def __str__(self) -> str:
        return self.model_id

    @property
    def queue(self) -> str:
        return f"pool.{self.pool}"

    def with_adapter(self, adapter) -> "ServedModel":
        """This model as served with `adapter` (adapters.models.Adapter): same pool, engine and
        context, the adapter's model id. A copy for one request, never saved."""
        served = copy.copy(self)
        served.model_id, served.created_at, served.adapter = adapter.model_id, adapter.created_at, adapter
        return served
