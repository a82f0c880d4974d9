"""The usage ledger: one append-only row per inference request, unique on its request id."""

from django.db import models

from tenants.models import ApiKey, Tenant


class UsageRecord(models.Model):
    class Status(models.TextChoices):
        OK = "ok"
        CANCELLED = "cancelled"  # the client went away; billed for what was generated
        ERROR = "error"
        WORKER_LOST = "worker_lost"

    request_id = models.CharField(max_length=64, unique=True)
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="usage_records")
    api_key = models.ForeignKey(ApiKey, on_delete=models.PROTECT, related_name="usage_records")
    model = models.CharField(max_length=200)
    prompt_tokens = models.PositiveIntegerField()
    cached_tokens = models.PositiveIntegerField(default=0, help_text="Prompt tokens served from the prefix cache.")
    completion_tokens = models.PositiveIntegerField()
    queue_ms = models.PositiveIntegerField(default=0, help_text="Time from admission to a worker starting it.")
    ttft_ms = models.PositiveIntegerField(null=True, help_text="Time from the worker starting it to the first token.")
    total_ms = models.PositiveIntegerField(help_text="Time from admission to the last token.")
    decode_tokens_per_second = models.FloatField(null=True)
    finish_reason = models.CharField(max_length=20, blank=True)
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.OK)
    worker = models.CharField(max_length=200, blank=True)
    finished_at = models.DateTimeField(db_index=True)
    recorded_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-finished_at"]
        indexes = [models.Index(fields=["tenant", "finished_at"]), models.Index(fields=["api_key", "finished_at"])]

    def __str__(self) -> str:
        return f"{self.request_id} {self.prompt_tokens}+{self.completion_tokens}"
