"""Input and output shapes of the management API. Inputs are strict: a field that is not writable
(a tenant, usage or billing field, or a typo) is a 400 naming it, never silently applied or ignored."""

from rest_framework import serializers

from adapters.models import Adapter
from billing.models import Invoice, InvoiceLine
from core.columns import column_max
from quotas.models import LimitFields, Plan
from tenants.models import ApiKey, Tenant


class StrictInput(serializers.Serializer):
    def to_internal_value(self, data):
        if isinstance(data, dict):
            writable = {name for name, field in self.fields.items() if not field.read_only}
            unknown = sorted(set(data) - writable)
            if unknown:
                raise serializers.ValidationError(
                    {unknown[0]: ["This field is not writable here."]}, code="not_writable"
                )
        return super().to_internal_value(data)


def _limit_field():
    return serializers.IntegerField(
        min_value=0, max_value=column_max(Plan, "rpm"), allow_null=True, required=False
    )  # the five limits share one column type (quotas.models.LimitFields)


def _plan_integer(name: str, *, min_value: int = 0, allow_null: bool = False):
    return serializers.IntegerField(
        min_value=min_value, max_value=column_max(Plan, name), required=False, allow_null=allow_null
    )


class LimitsInput(StrictInput):
    rpm = _limit_field()
    input_tpm = _limit_field()
    output_tpm = _limit_field()
    concurrency = _limit_field()
    budget_tokens = _limit_field()


class LimitsOutput(serializers.Serializer):
    rpm = serializers.IntegerField(allow_null=True)
    input_tpm = serializers.IntegerField(allow_null=True)
    output_tpm = serializers.IntegerField(allow_null=True)
    concurrency = serializers.IntegerField(allow_null=True)
    budget_tokens = serializers.IntegerField(allow_null=True)


# -- plans ---------------------------------------------------------------------------------------
PLAN_FIELDS = ["name", "display_name", *LimitFields.LIMITS, "allowed_models", "price_input_per_1m_micros",
               "price_cached_input_per_1m_micros", "price_output_per_1m_micros", "reserved_throughput_fee_micros",
               "guaranteed_tokens_per_second", "fair_share_weight", "price_adapter_input_per_1m_micros",
               "price_adapter_output_per_1m_micros", "max_adapters"]  # fmt: skip


class PlanOutput(serializers.ModelSerializer):
    class Meta:
        model = Plan
        fields = [*PLAN_FIELDS, "created_at"]


class PlanInput(LimitsInput):
    name = serializers.SlugField(max_length=64)
    display_name = serializers.CharField(max_length=200, required=False, allow_blank=True)
    allowed_models = serializers.ListField(child=serializers.CharField(max_length=200), required=False)
    price_input_per_1m_micros = _plan_integer("price_input_per_1m_micros")
    # null: cached input tokens cost the input price
    price_cached_input_per_1m_micros = _plan_integer("price_cached_input_per_1m_micros", allow_null=True)
    price_output_per_1m_micros = _plan_integer("price_output_per_1m_micros")
    reserved_throughput_fee_micros = _plan_integer("reserved_throughput_fee_micros")
    guaranteed_tokens_per_second = _plan_integer("guaranteed_tokens_per_second")
    fair_share_weight = _plan_integer("fair_share_weight", min_value=1)
    price_adapter_input_per_1m_micros = _plan_integer("price_adapter_input_per_1m_micros", allow_null=True)
    price_adapter_output_per_1m_micros = _plan_integer("price_adapter_output_per_1m_micros", allow_null=True)
    max_adapters = _plan_integer("max_adapters", allow_null=True)


# -- tenants -------------------------------------------------------------------------------------
class TenantOutput(serializers.ModelSerializer):
    plan = serializers.SerializerMethodField()

    class Meta:
        model = Tenant
        fields = ["name", "display_name", "is_active", "plan", "created_at"]

    def get_plan(self, tenant) -> str | None:
        quota = getattr(tenant, "quota", None)
        return quota.plan.name if quota is not None and quota.plan is not None else None


class TenantCreateInput(StrictInput):
    name = serializers.SlugField(max_length=64)
    display_name = serializers.CharField(max_length=200, required=False, allow_blank=True)
    plan = serializers.SlugField(required=False, allow_null=True)


class TenantUpdateInput(StrictInput):
    display_name = serializers.CharField(max_length=200, required=False, allow_blank=True)
    is_active = serializers.BooleanField(required=False)
    plan = serializers.SlugField(required=False, allow_null=True)


class QuotaOutput(serializers.Serializer):
    plan = serializers.CharField(allow_null=True)
    overrides = LimitsOutput()
    effective = LimitsOutput()


class QuotaInput(LimitsInput):
    plan = serializers.SlugField(required=False, allow_null=True)


# -- keys ----------------------------------------------------------------------------------------
class KeyOutput(serializers.ModelSerializer):
    class Meta:
        model = ApiKey
        fields = [
            "prefix",
            "name",
            "is_admin",
            "allowed_models",
            "created_at",
            "expires_at",
            "revoked_at",
            "last_used_at",
        ]


class KeyCreatedOutput(KeyOutput):
    key = serializers.CharField(help_text="The secret key. Shown once: store it now.")

    class Meta(KeyOutput.Meta):
        fields = [*KeyOutput.Meta.fields, "key"]


class KeyCreateInput(StrictInput):
    name = serializers.CharField(max_length=100, required=False, allow_blank=True)
    expires_at = serializers.DateTimeField(required=False, allow_null=True)
    allowed_models = serializers.ListField(child=serializers.CharField(max_length=200), required=False)
    is_admin = serializers.BooleanField(required=False, default=False)


class KeyRotateInput(StrictInput):
    grace_seconds = serializers.IntegerField(min_value=0, max_value=30 * 86400, required=False, default=3600)


# -- usage ---------------------------------------------------------------------------------------
class UsageQuery(StrictInput):
    period = serializers.RegexField(r"^\d{4}-\d{2}$", required=False, help_text="A billing month, YYYY-MM.")
    start = serializers.DateTimeField(required=False)
    end = serializers.DateTimeField(required=False)
    model = serializers.CharField(required=False)
    key = serializers.CharField(required=False, help_text="A key prefix.")
    granularity = serializers.ChoiceField(choices=["hour", "day", "total"], required=False, default="day")

    def validate(self, attrs):
        if "period" in attrs and ("start" in attrs or "end" in attrs):
            raise serializers.ValidationError({"period": ["Give either period or start/end, not both."]})
        if "start" in attrs and "end" in attrs and attrs["start"] >= attrs["end"]:
            raise serializers.ValidationError({"end": ["end must be after start."]})
        return attrs


# -- invoices ------------------------------------------------------------------------------------
class InvoiceLineOutput(serializers.ModelSerializer):
    class Meta:
        model = InvoiceLine
        fields = ["kind", "model", "description", "quantity", "unit_price_micros", "amount_micros"]


class InvoiceOutput(serializers.ModelSerializer):
    tenant = serializers.CharField(source="tenant.name")
    plan = serializers.CharField(source="plan_name")
    lines = InvoiceLineOutput(many=True)

    class Meta:
        model = Invoice
        fields = ["number", "tenant", "period_start", "period_end", "status", "currency", "plan", "total_micros",
                  "created_at", "closed_at", "lines"]  # fmt: skip


class InvoiceBuildInput(StrictInput):
    period = serializers.RegexField(r"^\d{4}-\d{2}$", help_text="The billing month, YYYY-MM.")


# -- adapters ------------------------------------------------------------------------------------
class AdapterOutput(serializers.ModelSerializer):
    id = serializers.CharField(source="model_id")

    class Meta:
        model = Adapter
        fields = ["id", "name", "base_model", "rank", "target_modules", "size_bytes", "digest", "created_at"]


class AdapterUpload(serializers.Serializer):
    """The multipart upload (for the schema; the body is read by `views._adapter_files`)."""

    name = serializers.CharField(max_length=64)
    base_model = serializers.CharField(max_length=200)
    config = serializers.FileField(help_text="adapter_config.json")
    weights = serializers.FileField(help_text="adapter_model.safetensors")
