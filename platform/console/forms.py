from __future__ import annotations

from decimal import Decimal

from django import forms
from django.core.exceptions import ValidationError

from catalog.models import ServedModel
from console.selectors import LIMIT_LABELS
from core.columns import column_max
from quotas.models import LimitFields, Plan
from quotas.services import CLEAR
from tenants.models import Tenant

# /console/tenants/new/ is the creation page.
RESERVED_TENANT_NAMES = {"new"}


class TenantCreateForm(forms.Form):
    name = forms.SlugField(max_length=64, help_text="Lowercase identifier, e.g. acme-corp. Cannot be changed.")
    display_name = forms.CharField(max_length=200, required=False)

    def clean_name(self):
        name = self.cleaned_data["name"].lower()
        if name in RESERVED_TENANT_NAMES:
            raise ValidationError("This name is reserved by the console.")
        if Tenant.objects.filter(name=name).exists():
            raise ValidationError("A tenant with this name already exists.")
        return name


class ApiKeyCreateForm(forms.Form):
    name = forms.CharField(max_length=100, required=False, help_text="What the key is for, e.g. production.")
    expires_at = forms.DateTimeField(
        required=False,
        widget=forms.DateTimeInput(attrs={"type": "datetime-local"}),
        help_text="Optional (UTC).",
    )
    allowed_models = forms.MultipleChoiceField(
        required=False,
        widget=forms.CheckboxSelectMultiple,
        help_text="None ticked: every served model.",
    )
    is_admin = forms.BooleanField(
        required=False,
        label="Management API",
        help_text="The key may also manage this tenant (its keys, usage, invoices) through /api/v1/.",
    )

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["allowed_models"].choices = [(m, m) for m in ServedModel.objects.values_list("model_id", flat=True)]


class TenantAdminCreateForm(forms.Form):
    username = forms.CharField(max_length=150)
    email = forms.EmailField(required=False)
    password = forms.CharField(widget=forms.PasswordInput, strip=False, help_text="At least 8 characters, not common.")


class UsageFilterForm(forms.Form):
    period = forms.ChoiceField(required=False)
    model = forms.ChoiceField(required=False)

    def __init__(self, *args, periods: dict, models: list[str], **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["period"].choices = [(key, p.label) for key, p in periods.items()]
        self.fields["model"].choices = [("", "all models")] + [(m, m) for m in models]


class KeyRotateForm(forms.Form):
    grace_seconds = forms.TypedChoiceField(
        coerce=int,
        initial=3600,
        label="Old key keeps working for",
        choices=[(0, "no time: revoke it now"), (900, "15 minutes"), (3600, "1 hour"), (86400, "24 hours")],
    )


MICROS = Decimal(1_000_000)


def _usd_field(label: str) -> forms.DecimalField:
    return forms.DecimalField(label=label, min_value=0, max_digits=14, decimal_places=6, initial=0)


class PlanForm(forms.ModelForm):
    """A plan; prices are entered in USD and stored as integer micro-units."""

    allowed_models = forms.MultipleChoiceField(
        required=False, widget=forms.CheckboxSelectMultiple, help_text="None ticked: every served model."
    )
    price_input = _usd_field("Price per 1M input tokens (USD)")
    price_cached_input = forms.DecimalField(
        label="Price per 1M cached input tokens (USD)", min_value=0, max_digits=14, decimal_places=6, required=False,
        help_text="Prompt tokens served from the prefix cache. Empty: the input price.",
    )
    price_output = _usd_field("Price per 1M output tokens (USD)")
    reserved_fee = _usd_field("Monthly reserved-throughput fee (USD)")

    PRICES = {
        "price_input": "price_input_per_1m_micros",
        "price_output": "price_output_per_1m_micros",
        "reserved_fee": "reserved_throughput_fee_micros",
    }

    class Meta:
        model = Plan
        fields = ["name", "display_name", *LimitFields.LIMITS, "guaranteed_tokens_per_second", "fair_share_weight"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["allowed_models"].choices = [(m, m) for m in ServedModel.objects.values_list("model_id", flat=True)]
        for name, label in LIMIT_LABELS.items():
            self.fields[name].label = label
            self.fields[name].help_text = "Empty: no limit."
        if self.instance.pk:
            self.fields["name"].disabled = True
            self.fields["allowed_models"].initial = self.instance.allowed_models
            for field, model_field in self.PRICES.items():
                self.fields[field].initial = Decimal(getattr(self.instance, model_field)) / MICROS
            cached = self.instance.price_cached_input_per_1m_micros
            self.fields["price_cached_input"].initial = None if cached is None else Decimal(cached) / MICROS

    def clean_name(self):
        name = self.cleaned_data["name"]
        if name in RESERVED_TENANT_NAMES:  # /console/plans/new/ is the creation page
            raise ValidationError("This name is reserved by the console.")
        return name

    def service_fields(self) -> dict:
        """cleaned_data in the model's terms, for quotas.services.plan_create / plan_update."""
        data = {name: self.cleaned_data[name] for name in self.Meta.fields if name != "name"}
        data["allowed_models"] = list(self.cleaned_data["allowed_models"])
        for field, model_field in self.PRICES.items():
            data[model_field] = int((self.cleaned_data[field] or 0) * MICROS)
        cached = self.cleaned_data["price_cached_input"]
        data["price_cached_input_per_1m_micros"] = None if cached is None else int(cached * MICROS)
        return data


class LimitsForm(forms.Form):
    """The five limits, each optional (empty: `empty_means`)."""

    empty_means = "no limit"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for name, label in LIMIT_LABELS.items():
            self.fields[name] = forms.IntegerField(
                min_value=0, max_value=column_max(Plan, name), required=False, label=label,
                help_text=f"Empty: {self.empty_means}.",
            )  # fmt: skip

    def limits(self) -> dict:
        """For quotas.services: an empty field clears the value (CLEAR)."""
        return {name: CLEAR if self.cleaned_data[name] is None else self.cleaned_data[name] for name in LIMIT_LABELS}


class TenantQuotaForm(LimitsForm):
    empty_means = "the plan's value"
    plan = forms.ModelChoiceField(queryset=Plan.objects.order_by("name"), required=False, empty_label="no plan")


class KeyQuotaForm(LimitsForm):
    empty_means = "only the tenant's limit applies"


class InvoiceBuildForm(forms.Form):
    period = forms.RegexField(regex=r"^\d{4}-\d{2}$", max_length=7, help_text="A month, YYYY-MM (UTC).")


class AdapterUploadForm(forms.Form):
    name = forms.CharField(max_length=64, help_text='Called as model "<base model>:<name>".')
    base_model = forms.ModelChoiceField(
        queryset=ServedModel.objects.filter(is_enabled=True), to_field_name="model_id", label="Base model"
    )
    config = forms.FileField(label="adapter_config.json")
    weights = forms.FileField(
        label="adapter_model.safetensors", help_text="Safetensors only; pickle files are refused."
    )
