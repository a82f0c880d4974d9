"""Plans and quota overrides.

A tenant follows one plan; an operator may override any limit for one tenant (TenantQuota) or give one
key stricter limits of its own (KeyQuota). For every limit, None means "no limit at this level", and
where a tenant and a key both have one, both are enforced, so the stricter wins.
Money is integer micro-units (1 USD = 1,000,000); prices are per 1M tokens.
"""

from django.core.validators import MinValueValidator
from django.db import models

from tenants.models import ApiKey, Tenant

_LIMIT_HELP = "Empty: no limit."


def _limit(help_text: str):
    return models.PositiveBigIntegerField(null=True, blank=True, help_text=f"{help_text} {_LIMIT_HELP}")


class LimitFields(models.Model):
    """The five limits admission enforces, shared by plans and overrides."""

    rpm = _limit("Requests per minute.")
    input_tpm = _limit("Prompt tokens per minute.")
    output_tpm = _limit("Completion tokens per minute (max_tokens is reserved at admission).")
    concurrency = _limit("Requests in flight at once.")
    budget_tokens = _limit("Prompt + completion tokens per billing period (calendar month, UTC).")

    LIMITS = ("rpm", "input_tpm", "output_tpm", "concurrency", "budget_tokens")

    class Meta:
        abstract = True

    def limits(self) -> dict[str, int | None]:
        return {name: getattr(self, name) for name in self.LIMITS}


class Plan(LimitFields):
    name = models.SlugField(max_length=64, unique=True)
    display_name = models.CharField(max_length=200, blank=True)
    # Empty list: every served model.
    allowed_models = models.JSONField(default=list, blank=True)
    price_input_per_1m_micros = models.PositiveBigIntegerField(default=0)
    price_output_per_1m_micros = models.PositiveBigIntegerField(default=0)
    # Prompt tokens the engine served from its prefix cache cost it no prefill: a plan may price them
    # lower (empty: the input price, the adapter's for an adapter).
    price_cached_input_per_1m_micros = models.PositiveBigIntegerField(null=True, blank=True)
    reserved_throughput_fee_micros = models.PositiveBigIntegerField(
        default=0, help_text="Flat monthly fee for the guaranteed throughput below."
    )
    guaranteed_tokens_per_second = models.PositiveIntegerField(default=0)
    fair_share_weight = models.PositiveIntegerField(
        default=1, validators=[MinValueValidator(1)], help_text="Share of a saturated pool, relative to other tenants."
    )
    # Tenants' LoRA adapters (model "<base>:<adapter>"): their own token prices (empty: the base
    # prices above) and how many adapters a tenant may keep (empty: no limit).
    price_adapter_input_per_1m_micros = models.PositiveBigIntegerField(null=True, blank=True)
    price_adapter_output_per_1m_micros = models.PositiveBigIntegerField(null=True, blank=True)
    max_adapters = models.PositiveIntegerField(
        null=True, blank=True, help_text=f"LoRA adapters per tenant. {_LIMIT_HELP}"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class TenantQuota(LimitFields):
    """A tenant's plan and its per-tenant overrides (an override replaces the plan's value)."""

    tenant = models.OneToOneField(Tenant, on_delete=models.CASCADE, related_name="quota")
    plan = models.ForeignKey(Plan, on_delete=models.PROTECT, null=True, blank=True, related_name="tenant_quotas")
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"quota of {self.tenant_id}"


class KeyQuota(LimitFields):
    """Limits of one key of its own, enforced on top of its tenant's."""

    api_key = models.OneToOneField(ApiKey, on_delete=models.CASCADE, related_name="quota")
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"quota of key {self.api_key_id}"
