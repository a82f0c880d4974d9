"""The console's adapters page: a tenant's LoRA adapters, upload and delete (staff and that tenant's
admins; another tenant's page is a 404, as every tenant page of the console)."""

from django import forms
from django.contrib import messages
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_http_methods, require_POST

from adapters.models import Adapter
from adapters.services import adapter_create, adapter_delete
from catalog.models import ServedModel
from console.views import _tenant_context, tenant_required
from gateway.errors import OpenAIError

# The form field an upload refusal belongs to, by the refusal's `param`.
_FIELDS = {"config": "config", "weights": "weights", "name": "name", "base_model": "base_model"}


class AdapterUploadForm(forms.Form):
    name = forms.CharField(max_length=64, help_text='Called as model "<base model>:<name>".')
    base_model = forms.ModelChoiceField(
        queryset=ServedModel.objects.filter(is_enabled=True), to_field_name="model_id", label="Base model"
    )
    config = forms.FileField(label="adapter_config.json")
    weights = forms.FileField(
        label="adapter_model.safetensors", help_text="Safetensors only; pickle files are refused."
    )


@tenant_required
@require_http_methods(["GET", "POST"])
def tenant_adapters(request, tenant):
    form = AdapterUploadForm(request.POST or None, request.FILES or None)
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        try:
            adapter = adapter_create(
                tenant=tenant, base_model=data["base_model"], name=data["name"],
                config=data["config"].read(), weights=data["weights"].read(),
            )  # fmt: skip
        except OpenAIError as exc:
            form.add_error(_FIELDS.get(exc.param or ""), exc.message)
        else:
            messages.success(request, f'Adapter {adapter.model_id} uploaded; call it as model "{adapter.model_id}".')
            return redirect("console:tenant_adapters", tenant_name=tenant.name)
    adapters = Adapter.objects.filter(tenant=tenant)
    context = _tenant_context(request, tenant, "adapters", adapters=adapters, form=form)
    return render(request, "adapters/tenant_adapters.html", context)


@tenant_required
@require_POST
def adapter_remove(request, tenant, adapter_id: int):
    adapter = get_object_or_404(Adapter, tenant=tenant, pk=adapter_id)
    adapter_delete(adapter=adapter)
    messages.success(request, f"Adapter {adapter.model_id} deleted; requests naming it are refused from now on.")
    return redirect("console:tenant_adapters", tenant_name=tenant.name)
