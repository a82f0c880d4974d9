"""Console pages. Views stay thin: access control here, reads in selectors, writes in services.

Two kinds of user: operators (Django staff) see every page; tenant admins (a TenantMembership) see
only the pages under /console/tenants/<their tenant>/. Every other page is a 404 for them, exactly
like a tenant that does not exist, so nothing leaks which tenants there are.
"""

from __future__ import annotations

import functools

from django.contrib import messages
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.core.paginator import Paginator
from django.http import Http404, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse, reverse_lazy
from django.utils.cache import add_never_cache_headers
from django.views.decorators.http import require_http_methods, require_POST

from adapters.models import Adapter
from adapters.services import adapter_create, adapter_delete
from billing.services import invoice_as_csv, invoice_build
from console import selectors, services
from console.errors import form_error, message_error
from console.forms import (
    AdapterUploadForm,
    ApiKeyCreateForm,
    InvoiceBuildForm,
    KeyQuotaForm,
    KeyRotateForm,
    PlanForm,
    TenantAdminCreateForm,
    TenantCreateForm,
    TenantQuotaForm,
    UsageFilterForm,
)
from console.models import TenantMembership
from console.signin import ConsoleLoginForm
from core.errors import AppError, Conflict
from core.periods import Period
from quotas.models import KeyQuota, Plan
from quotas.services import CLEAR, key_quota_set, plan_create, plan_update, tenant_quota_get, tenant_quota_set
from tenants.services import apikey_create, apikey_revoke, apikey_rotate, tenant_create

TENANTS_PER_PAGE = 50
LOGIN_URL = reverse_lazy("console:login")


def operator_required(view):
    """Staff only; any other signed-in user gets a 404."""

    @login_required(login_url=LOGIN_URL)
    @functools.wraps(view)
    def wrapper(request, *args, **kwargs):
        if not request.user.is_staff:
            raise Http404
        return view(request, *args, **kwargs)

    return wrapper


def tenant_required(view):
    """Resolves the URL's tenant once, for staff or for that tenant's own admins; else 404."""

    @login_required(login_url=LOGIN_URL)
    @functools.wraps(view)
    def wrapper(request, tenant_name: str, *args, **kwargs):
        tenant = selectors.tenant_for_user(request.user, tenant_name)
        return view(request, tenant, *args, **kwargs)

    return wrapper


class LoginView(auth_views.LoginView):
    template_name = "console/login.html"
    authentication_form = ConsoleLoginForm
    redirect_authenticated_user = True

    def get_default_redirect_url(self):
        return reverse("console:home")


class LogoutView(auth_views.LogoutView):
    next_page = LOGIN_URL


@login_required(login_url=LOGIN_URL)
def home(request):
    if request.user.is_staff:
        return redirect("console:overview")
    tenant = selectors.tenant_of_member(request.user)
    if tenant is None:
        raise Http404
    return redirect("console:tenant_detail", tenant_name=tenant.name)


# --- operator pages ---------------------------------------------------------------------------


@operator_required
def overview(request):
    context = {"overview": selectors.platform_overview(), "nav": "overview"}
    if request.headers.get("HX-Request"):
        return render(request, "console/partials/overview_live.html", context)
    return render(request, "console/overview.html", context)


@operator_required
def tenant_list(request):
    query = request.GET.get("q", "")
    page = Paginator(selectors.tenant_search(query=query), TENANTS_PER_PAGE).get_page(request.GET.get("page"))
    stats = selectors.tenant_page_stats(tenant_ids=[t.id for t in page.object_list])
    rows = [(tenant, stats[tenant.id]) for tenant in page.object_list]
    context = {"page": page, "rows": rows, "query": query, "nav": "tenants"}
    if request.headers.get("HX-Request"):
        return render(request, "console/partials/tenant_table.html", context)
    return render(request, "console/tenant_list.html", context)


@operator_required
@require_http_methods(["GET", "POST"])
def tenant_new(request):
    form = TenantCreateForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        tenant = tenant_create(name=form.cleaned_data["name"], display_name=form.cleaned_data["display_name"])
        messages.success(request, f"Tenant {tenant.name} created. Create its first API key below.")
        return redirect("console:tenant_keys", tenant_name=tenant.name)
    return render(request, "console/tenant_new.html", {"form": form, "nav": "tenants"})


@operator_required
def usage_all(request):
    return _usage_page(request, tenant=None)


# --- tenant pages (operators and the tenant's own admins) -------------------------------------


def _tenant_context(request, tenant, section: str, **extra) -> dict:
    return {"tenant": tenant, "section": section, "nav": "tenants" if request.user.is_staff else "", **extra}


@tenant_required
@require_http_methods(["GET", "POST"])
def tenant_detail(request, tenant):
    if request.method == "POST" and not request.user.is_staff:
        raise Http404
    period = selectors.period_get("24h")
    admin_form = TenantAdminCreateForm(request.POST or None) if request.user.is_staff else None
    if request.method == "POST" and admin_form.is_valid():
        try:
            services.tenant_admin_create(tenant=tenant, **admin_form.cleaned_data)
        except ValidationError as exc:
            admin_form.add_error(None, exc)
        else:
            messages.success(request, f"Tenant admin {admin_form.cleaned_data['username']} can now sign in.")
            return redirect("console:tenant_detail", tenant_name=tenant.name)
    context = _tenant_context(
        request,
        tenant,
        "detail",
        stats=selectors.tenant_page_stats(tenant_ids=[tenant.id])[tenant.id],
        by_model=selectors.usage_by_model(tenant=tenant, period=period),
        members=TenantMembership.objects.filter(tenant=tenant).select_related("user"),
        admin_form=admin_form,
    )
    return render(request, "console/tenant_detail.html", context)


@tenant_required
@require_http_methods(["GET", "POST"])
def tenant_keys(request, tenant):
    form = ApiKeyCreateForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        api_key, plaintext = apikey_create(tenant=tenant, **form.cleaned_data)
        # Rendered, not redirected: the secret must never be stored (session, message) to show it later.
        response = render(
            request,
            "console/key_created.html",
            _tenant_context(request, tenant, "keys", api_key=api_key, plaintext=plaintext),
        )
        add_never_cache_headers(response)
        return response
    keys = selectors.apikey_list(tenant=tenant)
    return render(request, "console/tenant_keys.html", _tenant_context(request, tenant, "keys", keys=keys, form=form))


@tenant_required
@require_http_methods(["GET", "POST"])
def key_revoke(request, tenant, key_id: int):
    api_key = selectors.apikey_get(tenant=tenant, key_id=key_id)
    if request.method == "POST":
        if apikey_revoke(api_key=api_key):
            messages.success(request, f"Key {api_key.prefix} revoked; requests with it are refused from now on.")
        return redirect("console:tenant_keys", tenant_name=tenant.name)
    return render(request, "console/key_revoke.html", _tenant_context(request, tenant, "keys", api_key=api_key))


@tenant_required
def tenant_usage(request, tenant):
    return _usage_page(request, tenant=tenant)


def _usage_page(request, *, tenant):
    models = selectors.usage_models()
    form = UsageFilterForm(request.GET or None, periods=selectors.PERIODS, models=models)
    form.is_valid()  # an unknown value falls back to the default; the valid fields still apply
    cleaned = getattr(form, "cleaned_data", {})
    period = selectors.period_get(cleaned.get("period"))
    model = cleaned.get("model", "")
    series = selectors.usage_series(tenant=tenant, period=period, model=model)
    by_model = selectors.usage_by_model(tenant=tenant, period=period)
    context = {
        "form": form,
        "period": period,
        "model": model,
        "series": series,
        "chart_data": series.chart_data(),
        "by_model": by_model,
        "hit_rate": selectors.usage_hit_rate(by_model),
        "cache_hits": selectors.cache_hits(tenant=tenant, period=period),
        "percentile_note": selectors.percentile_window_label(period, tenant=tenant),
    }
    if tenant is None:
        return render(request, "console/usage.html", {**context, "nav": "usage"})
    return render(request, "console/usage.html", _tenant_context(request, tenant, "usage", **context))


@tenant_required
@require_http_methods(["GET", "POST"])
def key_rotate(request, tenant, key_id: int):
    api_key = selectors.apikey_get(tenant=tenant, key_id=key_id)
    form = KeyRotateForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            new_key, plaintext = apikey_rotate(api_key=api_key, grace_seconds=form.cleaned_data["grace_seconds"])
        except Conflict as exc:
            message_error(request, exc)
            return redirect("console:tenant_keys", tenant_name=tenant.name)
        context = _tenant_context(request, tenant, "keys", api_key=new_key, plaintext=plaintext, replaced=api_key)
        response = render(request, "console/key_created.html", context)
        add_never_cache_headers(response)
        return response
    context = _tenant_context(request, tenant, "keys", api_key=api_key, form=form)
    return render(request, "console/key_rotate.html", context)


@tenant_required
@require_http_methods(["GET", "POST"])
def tenant_limits(request, tenant):
    form = None
    if request.user.is_staff:
        quota = tenant_quota_get(tenant=tenant)
        initial = {"plan": quota.plan, **quota.limits()}
        form = TenantQuotaForm(request.POST or None, initial=initial)
        if request.method == "POST" and form.is_valid():
            tenant_quota_set(tenant=tenant, plan=form.cleaned_data["plan"] or CLEAR, **form.limits())
            messages.success(request, "Limits saved; admission applies them within seconds.")
            return redirect("console:tenant_limits", tenant_name=tenant.name)
    context = _tenant_context(request, tenant, "limits", limits=selectors.tenant_limits(tenant=tenant), form=form)
    return render(request, "console/tenant_limits.html", context)


@tenant_required
def tenant_throttles(request, tenant):
    events = selectors.throttle_events(tenant=tenant)
    context = _tenant_context(
        request,
        tenant,
        "throttles",
        events=events,
        summary=selectors.throttle_summary(events),
        limits=selectors.tenant_limits(tenant=tenant),
    )
    return render(request, "console/tenant_throttles.html", context)


@tenant_required
@require_http_methods(["GET", "POST"])
def tenant_invoices(request, tenant):
    form = InvoiceBuildForm(request.POST or None, initial={"period": Period.current().id})
    if request.method == "POST":
        if not request.user.is_staff:
            raise Http404
        if form.is_valid():
            try:
                period = Period.parse(form.cleaned_data["period"])
            except ValueError:
                form.add_error("period", "Not a month: use YYYY-MM.")
            else:
                invoice = invoice_build(tenant=tenant, period=period)
                messages.success(request, f"Invoice {invoice.number} computed from the ledger.")
                return redirect("console:invoice_detail", tenant_name=tenant.name, number=invoice.number)
    page = Paginator(selectors.invoice_list(tenant=tenant), 24).get_page(request.GET.get("page"))
    context = _tenant_context(request, tenant, "invoices", page=page, form=form if request.user.is_staff else None)
    return render(request, "console/tenant_invoices.html", context)


@tenant_required
def invoice_detail(request, tenant, number: str):
    invoice = selectors.invoice_get(tenant=tenant, number=number)
    if request.GET.get("format") == "csv":
        response = HttpResponse(invoice_as_csv(invoice), content_type="text/csv")
        response["Content-Disposition"] = f'attachment; filename="{invoice.number}.csv"'
        return response
    return render(request, "console/invoice_detail.html", _tenant_context(request, tenant, "invoices", invoice=invoice))


# --- operator: plans and all invoices ---------------------------------------------------------


@operator_required
def plan_list(request):
    return render(request, "console/plan_list.html", {"plans": selectors.plan_list(), "nav": "plans"})


@operator_required
@require_http_methods(["GET", "POST"])
def plan_edit(request, plan_name: str | None = None):
    plan = get_object_or_404(Plan, name=plan_name) if plan_name else None
    form = PlanForm(request.POST or None, instance=plan)
    if request.method == "POST" and form.is_valid():
        if plan is None:
            plan = plan_create(name=form.cleaned_data["name"], **form.service_fields())
        else:
            plan = plan_update(plan=Plan.objects.get(pk=plan.pk), **form.service_fields())
        messages.success(request, f"Plan {plan.name} saved.")
        return redirect("console:plans")
    return render(request, "console/plan_edit.html", {"form": form, "plan": plan, "nav": "plans"})


@operator_required
def invoice_list(request):
    status = request.GET.get("status", "")
    page = Paginator(selectors.invoice_list(tenant=None, status=status), 50).get_page(request.GET.get("page"))
    context = {"page": page, "status": status, "nav": "invoices", "unwritten": selectors.usage_not_in_ledger()}
    return render(request, "console/invoice_list.html", context)


@tenant_required
@require_http_methods(["GET", "POST"])
def key_limits(request, tenant, key_id: int):
    """A key's own limits, enforced on top of the tenant's (so a tenant admin can only restrict)."""
    api_key = selectors.apikey_get(tenant=tenant, key_id=key_id)
    quota = KeyQuota.objects.filter(api_key=api_key).first()
    form = KeyQuotaForm(request.POST or None, initial=quota.limits() if quota else {})
    if request.method == "POST" and form.is_valid():
        key_quota_set(api_key=api_key, **form.limits())
        messages.success(request, f"Limits of key {api_key.prefix} saved.")
        return redirect("console:tenant_limits", tenant_name=tenant.name)
    return render(
        request, "console/key_limits.html", _tenant_context(request, tenant, "keys", api_key=api_key, form=form)
    )


# --- tenant: LoRA adapters --------------------------------------------------------------------


@tenant_required
@require_http_methods(["GET", "POST"])
def tenant_adapters(request, tenant):
    """A tenant's LoRA adapters, upload and delete (staff and that tenant's admins)."""
    form = AdapterUploadForm(request.POST or None, request.FILES or None)
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        try:
            adapter = adapter_create(
                tenant=tenant, base_model=data["base_model"], name=data["name"],
                config=data["config"].read(), weights=data["weights"].read(),
            )  # fmt: skip
        except AppError as exc:
            form_error(form, exc)
        else:
            messages.success(request, f'Adapter {adapter.model_id} uploaded; call it as model "{adapter.model_id}".')
            return redirect("console:tenant_adapters", tenant_name=tenant.name)
    adapters = Adapter.objects.filter(tenant=tenant)
    context = _tenant_context(request, tenant, "adapters", adapters=adapters, form=form)
    return render(request, "console/tenant_adapters.html", context)


@tenant_required
@require_POST
def adapter_remove(request, tenant, adapter_id: int):
    adapter = get_object_or_404(Adapter, tenant=tenant, pk=adapter_id)
    adapter_delete(adapter=adapter)
    messages.success(request, f"Adapter {adapter.model_id} deleted; requests naming it are refused from now on.")
    return redirect("console:tenant_adapters", tenant_name=tenant.name)
