"""Usage rollups and invoices. Money is integer micro-units (1 USD = 1,000,000); never floats.

Rollups are derived data: recomputed from the ledger for every bucket that received rows, so they
always equal the ledger's sums. Invoices snapshot prices into their lines; once closed, an invoice
and its lines never change (PostgreSQL triggers refuse it, see migration 0002).
"""

from django.db import models

from tenants.models import ApiKey, Tenant


class UsageRollup(models.Model):
    class Granularity(models.TextChoices):
        HOUR = "hour"
        DAY = "day"

    granularity = models.CharField(max_length=4, choices=Granularity.choices)
    bucket_start = models.DateTimeField()
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="usage_rollups")
    api_key = models.ForeignKey(ApiKey, on_delete=models.CASCADE, related_name="usage_rollups")
    model = models.CharField(max_length=200)
    requests = models.PositiveBigIntegerField(default=0)
    failed_requests = models.PositiveBigIntegerField(default=0, help_text="Status other than ok.")
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    cached_tokens = models.PositiveBigIntegerField(default=0, help_text="Of the prompt tokens, prefix-cache hits.")
    completion_tokens = models.PositiveBigIntegerField(default=0)
    queue_ms = models.PositiveBigIntegerField(default=0, help_text="Sum over the requests.")
    # Decode phase (after the first token) of requests that have one: tokens and time, for tokens/s.
    decode_tokens = models.PositiveBigIntegerField(default=0)
    decode_ms = models.PositiveBigIntegerField(default=0)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["bucket_start", "model"]
        constraints = [
            models.UniqueConstraint(
                fields=["granularity", "bucket_start", "tenant", "api_key", "model"], name="rollup_bucket_unique"
            )
        ]
        indexes = [models.Index(fields=["tenant", "granularity", "bucket_start"])]

    def __str__(self) -> str:
        return f"{self.granularity} {self.bucket_start:%Y-%m-%d %H:00} {self.tenant_id}/{self.api_key_id}/{self.model}"


class Invoice(models.Model):
    class Status(models.TextChoices):
        DRAFT = "draft"
        CLOSED = "closed"

    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="invoices")
    number = models.CharField(max_length=100, unique=True)
    period_start = models.DateTimeField()
    period_end = models.DateTimeField()
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.DRAFT)
    currency = models.CharField(max_length=3, default="USD")
    plan_name = models.CharField(max_length=64, blank=True)
    total_micros = models.BigIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    closed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-period_start", "tenant_id"]
        constraints = [models.UniqueConstraint(fields=["tenant", "period_start"], name="invoice_tenant_period_unique")]

    def __str__(self) -> str:
        return self.number


class InvoiceLine(models.Model):
    class Kind(models.TextChoices):
        INPUT_TOKENS = "input_tokens"
        CACHED_INPUT_TOKENS = "cached_input_tokens"
        OUTPUT_TOKENS = "output_tokens"
        RESERVED_THROUGHPUT = "reserved_throughput"

    invoice = models.ForeignKey(Invoice, on_delete=models.CASCADE, related_name="lines")
    kind = models.CharField(max_length=24, choices=Kind.choices)
    model = models.CharField(max_length=200, blank=True)
    description = models.CharField(max_length=300)
    quantity = models.PositiveBigIntegerField(help_text="Tokens, or guaranteed tokens/s for the throughput fee.")
    unit_price_micros = models.PositiveBigIntegerField(help_text="Per 1M tokens, or the flat monthly fee.")
    amount_micros = models.BigIntegerField()

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return f"{self.invoice_id}: {self.description}"
