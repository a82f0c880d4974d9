"""The management REST API under /api/v1/ (see docs/api.md). Views are thin: they resolve the tenant
through `tenants_visible` (a tenant outside the caller's reach is 404, like one that does not exist),
validate input with strict serializers and call the services of the apps that own the data. The
application errors those services raise (core/errors.py) become responses in one place, the
exception handler (management/errors.py)."""

import base64
import binascii
import datetime as dt
import json

from django.conf import settings
from django.db import transaction
from django.http import HttpResponse
from django.shortcuts import get_object_or_404
from django.utils import timezone
from drf_spectacular.utils import extend_schema
from rest_framework import exceptions, status
from rest_framework.parsers import FormParser, MultiPartParser
from rest_framework.response import Response
from rest_framework.views import APIView

from adapters.models import Adapter
from adapters.services import adapter_create, adapter_delete
from billing.models import Invoice
from billing.selectors import USAGE_MEASURES, throughput, usage_totals
from billing.services import invoice_as_csv, invoice_build, invoice_close
from catalog.models import ServedModel
from core.errors import InvalidRequest
from core.periods import Period
from management import serializers as s
from management.errors import Conflict, exception_handler
from management.parsers import StrictJSONParser
from management.permissions import OperatorOrTenantAdmin, is_operator, tenants_visible
from quotas.limits import limits_for
from quotas.models import KeyQuota, Plan
from quotas.services import CLEAR, key_quota_set, plan_create, plan_update, tenant_quota_get, tenant_quota_set
from tenants.models import ApiKey
from tenants.services import apikey_create, apikey_revoke, apikey_rotate, tenant_create


class ManagementView(APIView):
    # Authentication: REST_FRAMEWORK["DEFAULT_AUTHENTICATION_CLASSES"] (staff token, tenant admin key, session).
    permission_classes = [OperatorOrTenantAdmin]
    parser_classes = [StrictJSONParser, FormParser, MultiPartParser]

    def get_exception_handler(self):
        return exception_handler

    def require_operator(self) -> None:
        if not is_operator(self.request.user):
            raise exceptions.PermissionDenied("Only platform operators may do this.")

    def tenant(self, name: str):
        return get_object_or_404(tenants_visible(self.request.user).select_related("quota__plan"), name=name)

    def api_key(self, tenant, prefix: str) -> ApiKey:
        return get_object_or_404(ApiKey.objects.select_related("tenant"), tenant=tenant, prefix=prefix)

    def valid(self, serializer_class, data, **kwargs) -> dict:
        serializer = serializer_class(data=data, **kwargs)
        serializer.is_valid(raise_exception=True)
        return serializer.validated_data


def _plan_named(name):
    if name is None:
        return CLEAR
    plan = Plan.objects.filter(name=name).first()
    if plan is None:
        raise exceptions.ValidationError({"plan": [f"No plan named '{name}'."]}, code="not_found")
    return plan


# -- plans ---------------------------------------------------------------------------------------
class PlanListView(ManagementView):
    @extend_schema(responses=s.PlanOutput(many=True))
    def get(self, request):
        plans = Plan.objects.all()
        if not is_operator(request.user):
            plans = plans.filter(tenant_quotas__tenant=request.user.tenant)
        return Response(s.PlanOutput(plans, many=True).data)

    @extend_schema(request=s.PlanInput, responses={201: s.PlanOutput})
    def post(self, request):
        self.require_operator()
        data = self.valid(s.PlanInput, request.data)
        if Plan.objects.filter(name=data["name"]).exists():
            raise Conflict(f"A plan named '{data['name']}' exists already.")
        return Response(s.PlanOutput(plan_create(**data)).data, status=status.HTTP_201_CREATED)


class PlanDetailView(ManagementView):
    def plan(self, name: str) -> Plan:
        plans = Plan.objects.all()
        if not is_operator(self.request.user):
            plans = plans.filter(tenant_quotas__tenant=self.request.user.tenant)
        return get_object_or_404(plans, name=name)

    @extend_schema(responses=s.PlanOutput)
    def get(self, request, plan: str):
        return Response(s.PlanOutput(self.plan(plan)).data)

    @extend_schema(request=s.PlanInput, responses=s.PlanOutput)
    def patch(self, request, plan: str):
        found = self.plan(plan)
        self.require_operator()
        data = self.valid(s.PlanInput, request.data, partial=True)
        if data.pop("name", found.name) != found.name:
            raise exceptions.ValidationError({"name": ["A plan cannot be renamed."]})
        return Response(s.PlanOutput(plan_update(plan=found, **data)).data)


# -- tenants -------------------------------------------------------------------------------------
class TenantListView(ManagementView):
    @extend_schema(responses=s.TenantOutput(many=True))
    def get(self, request):
        tenants = tenants_visible(request.user).select_related("quota__plan")
        return Response(s.TenantOutput(tenants, many=True).data)

    @extend_schema(request=s.TenantCreateInput, responses={201: s.TenantOutput})
    def post(self, request):
        self.require_operator()
        data = self.valid(s.TenantCreateInput, request.data)
        plan = _plan_named(data["plan"]) if data.get("plan") else None
        if tenants_visible(request.user).filter(name=data["name"]).exists():
            raise Conflict(f"A tenant named '{data['name']}' exists already.")
        with transaction.atomic():
            tenant = tenant_create(name=data["name"], display_name=data.get("display_name", ""))
            if plan is not None:
                tenant_quota_set(tenant=tenant, plan=plan)
        return Response(s.TenantOutput(self.tenant(tenant.name)).data, status=status.HTTP_201_CREATED)


class TenantDetailView(ManagementView):
    @extend_schema(responses=s.TenantOutput)
    def get(self, request, tenant: str):
        return Response(s.TenantOutput(self.tenant(tenant)).data)

    @extend_schema(request=s.TenantUpdateInput, responses=s.TenantOutput)
    def patch(self, request, tenant: str):
        found = self.tenant(tenant)
        self.require_operator()
        data = self.valid(s.TenantUpdateInput, request.data)
        with transaction.atomic():
            if "plan" in data:
                tenant_quota_set(tenant=found, plan=_plan_named(data.pop("plan")))
            for name, value in data.items():
                setattr(found, name, value)
            found.full_clean()
            found.save()  # clears its keys' cached auth records on commit (tenants.signals)
        return Response(s.TenantOutput(self.tenant(tenant)).data)


def _quota_body(tenant) -> dict:
    quota = tenant_quota_get(tenant=tenant)
    effective = limits_for(tenant_id=tenant.id, key_id=0)
    return {"plan": quota.plan.name if quota.plan else None, "overrides": quota.limits(), "effective": effective.tenant}


class TenantQuotaView(ManagementView):
    @extend_schema(responses=s.QuotaOutput)
    def get(self, request, tenant: str):
        return Response(_quota_body(self.tenant(tenant)))

    @extend_schema(request=s.QuotaInput, responses=s.QuotaOutput)
    def patch(self, request, tenant: str):
        found = self.tenant(tenant)
        self.require_operator()
        data = self.valid(s.QuotaInput, request.data)
        plan = _plan_named(data.pop("plan")) if "plan" in data else None
        limits = {name: CLEAR if value is None else value for name, value in data.items()}
        tenant_quota_set(tenant=found, plan=plan, **limits)
        return Response(_quota_body(found))


# -- keys ----------------------------------------------------------------------------------------
class KeyListView(ManagementView):
    @extend_schema(responses=s.KeyOutput(many=True))
    def get(self, request, tenant: str):
        return Response(s.KeyOutput(self.tenant(tenant).api_keys.all(), many=True).data)

    @extend_schema(request=s.KeyCreateInput, responses={201: s.KeyCreatedOutput})
    def post(self, request, tenant: str):
        found = self.tenant(tenant)
        data = self.valid(s.KeyCreateInput, request.data)
        api_key, plaintext = apikey_create(tenant=found, **data)
        api_key.key = plaintext
        return Response(s.KeyCreatedOutput(api_key).data, status=status.HTTP_201_CREATED)


class KeyDetailView(ManagementView):
    @extend_schema(responses=s.KeyOutput)
    def get(self, request, tenant: str, prefix: str):
        return Response(s.KeyOutput(self.api_key(self.tenant(tenant), prefix)).data)


class KeyRevokeView(ManagementView):
    @extend_schema(request=None, responses=s.KeyOutput)
    def post(self, request, tenant: str, prefix: str):
        api_key = self.api_key(self.tenant(tenant), prefix)
        apikey_revoke(api_key=api_key)
        return Response(s.KeyOutput(api_key).data)


class KeyRotateView(ManagementView):
    @extend_schema(request=s.KeyRotateInput, responses={201: s.KeyCreatedOutput})
    def post(self, request, tenant: str, prefix: str):
        api_key = self.api_key(self.tenant(tenant), prefix)
        data = self.valid(s.KeyRotateInput, request.data)
        new_key, plaintext = apikey_rotate(api_key=api_key, grace_seconds=data["grace_seconds"])
        new_key.key = plaintext
        body = s.KeyCreatedOutput(new_key).data
        body["replaces"] = {"prefix": api_key.prefix, "revoked_at": api_key.revoked_at}
        return Response(body, status=status.HTTP_201_CREATED)


class KeyQuotaView(ManagementView):
    """A key's own limits, on top of its tenant's (a tenant admin may restrict its own keys)."""

    @extend_schema(responses=s.LimitsOutput)
    def get(self, request, tenant: str, prefix: str):
        api_key = self.api_key(self.tenant(tenant), prefix)
        quota = KeyQuota.objects.filter(api_key=api_key).first()
        return Response(quota.limits() if quota else dict.fromkeys(s.LimitsOutput().fields))

    @extend_schema(request=s.LimitsInput, responses=s.LimitsOutput)
    def patch(self, request, tenant: str, prefix: str):
        api_key = self.api_key(self.tenant(tenant), prefix)
        data = self.valid(s.LimitsInput, request.data)
        quota = key_quota_set(api_key=api_key, **{k: CLEAR if v is None else v for k, v in data.items()})
        return Response(quota.limits())


# -- usage ---------------------------------------------------------------------------------------
def _usage_range(query: dict) -> tuple[dt.datetime, dt.datetime]:
    if "period" in query:
        try:
            period = Period.parse(query["period"])
        except ValueError:
            raise exceptions.ValidationError({"period": ["Not a month: use YYYY-MM."]}) from None
        return period.start, period.end
    current = Period.current()
    return query.get("start", current.start), query.get("end", current.end)


class UsageView(ManagementView):
    @extend_schema(
        parameters=[s.UsageQuery],
        responses={200: {"type": "object"}},
        description="Usage from the hourly/daily rollups (refreshed every minute), with delivered tokens/s.",
    )
    def get(self, request, tenant: str):
        found = self.tenant(tenant)
        query = self.valid(s.UsageQuery, request.query_params.dict())
        start, end = _usage_range(query)
        granularity = query["granularity"]
        scope = {
            "granularity": "day" if granularity == "day" else "hour", "start": start, "end": end,
            "tenant_id": found.id, "model": query.get("model") or "",
            "api_key_id": self.api_key(found, query["key"]).id if query.get("key") else None,
        }  # fmt: skip
        (totals,) = usage_totals(**scope)
        if granularity == "total":  # one bucket, the whole range (none when it holds no usage)
            whole = _usage_bucket({**totals, "bucket": start}, (end - start).total_seconds())
            data = [whole] if totals["requests"] else []
        else:
            step = {"hour": 3600, "day": 86400}[granularity]
            data = [_usage_bucket(bucket, step) for bucket in usage_totals(**scope, group="bucket")]
        return Response({
            "tenant": found.name, "start": start, "end": end, "granularity": granularity,
            "model": query.get("model"), "key": query.get("key"), "data": data,
            "total": _usage_bucket(totals, (min(end, timezone.now()) - start).total_seconds()),
        })  # fmt: skip


def _usage_bucket(bucket: dict, seconds: float) -> dict:
    values = {m: int(bucket.get(m) or 0) for m in USAGE_MEASURES}
    out = {"bucket_start": bucket.get("bucket")}
    shown = ("requests", "failed_requests", "prompt_tokens", "cached_tokens", "completion_tokens")
    out.update({m: values[m] for m in shown})
    out.update(throughput(completion_tokens=values["completion_tokens"], decode_tokens=values["decode_tokens"],
                          decode_ms=values["decode_ms"], seconds=seconds))  # fmt: skip
    return out


# -- invoices ------------------------------------------------------------------------------------
class InvoiceListView(ManagementView):
    @extend_schema(responses=s.InvoiceOutput(many=True))
    def get(self, request, tenant: str):
        invoices = Invoice.objects.filter(tenant=self.tenant(tenant)).select_related("tenant").prefetch_related("lines")
        return Response(s.InvoiceOutput(invoices, many=True).data)

    @extend_schema(request=s.InvoiceBuildInput, responses={201: s.InvoiceOutput})
    def post(self, request, tenant: str):
        """Build (or refresh, while it is a draft) the tenant's invoice for a month."""
        found = self.tenant(tenant)
        self.require_operator()
        data = self.valid(s.InvoiceBuildInput, request.data)
        try:
            period = Period.parse(data["period"])
        except ValueError:
            raise exceptions.ValidationError({"period": ["Not a month: use YYYY-MM."]}) from None
        return Response(
            s.InvoiceOutput(invoice_build(tenant=found, period=period)).data, status=status.HTTP_201_CREATED
        )


class InvoiceDetailView(ManagementView):
    def invoice(self, tenant: str, number: str) -> Invoice:
        return get_object_or_404(Invoice.objects.select_related("tenant"), tenant=self.tenant(tenant), number=number)

    @extend_schema(responses=s.InvoiceOutput)
    def get(self, request, tenant: str, number: str):
        return Response(s.InvoiceOutput(self.invoice(tenant, number)).data)


class InvoiceCsvView(InvoiceDetailView):
    @extend_schema(responses={(200, "text/csv"): {"type": "string"}})
    def get(self, request, tenant: str, number: str):
        invoice = self.invoice(tenant, number)
        response = HttpResponse(invoice_as_csv(invoice), content_type="text/csv; charset=utf-8")
        response["Content-Disposition"] = f'attachment; filename="{invoice.number}.csv"'
        return response


class InvoiceCloseView(InvoiceDetailView):
    @extend_schema(request=None, responses=s.InvoiceOutput)
    def post(self, request, tenant: str, number: str):
        invoice = self.invoice(tenant, number)
        self.require_operator()
        invoice = invoice_close(invoice=invoice)
        return Response(s.InvoiceOutput(invoice).data)


# -- adapters ------------------------------------------------------------------------------------
# An upload is multipart (fields `name`, `base_model`, files `config` = adapter_config.json and
# `weights` = adapter_model.safetensors) or JSON (`name`, `base_model`, `config` as an object,
# `weights_base64`). An adapter is addressed by the model id clients call it with, `<base>:<name>`;
# another tenant's adapter is a 404 like one that does not exist.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def _required(data, name: str) -> str:
    value = data.get(name)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{name}: this field is required.", param=name, code="required")
    return value


def _adapter_files(request) -> tuple[bytes, bytes]:
    """(adapter_config.json, adapter_model.safetensors) from a multipart or a JSON body."""
    if request.FILES:
        return _uploaded(request, "config"), _uploaded(request, "weights")
    config = request.data.get("config")
    if isinstance(config, dict):
        config_raw = json.dumps(config).encode()
    elif isinstance(config, str) and config:
        config_raw = config.encode()
    else:
        raise InvalidRequest("config: the adapter_config.json object is required.", param="config", code="required")
    try:
        weights = base64.b64decode(_required(request.data, "weights_base64"), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest("weights_base64 is not valid base64.", param="weights_base64", code="invalid") from None
    return config_raw, weights


def _uploaded(request, field: str) -> bytes:
    upload = request.FILES.get(field)
    if upload is None:
        raise InvalidRequest(f"{field}: this file is required.", param=field, code="required")
    if field == "weights" and upload.name.lower().endswith(PICKLE_SUFFIXES):
        raise InvalidRequest("Pickle weights (.bin, .pt, ...) are not accepted; upload adapter_model.safetensors.",
                             param=field, code="adapter_not_safetensors")  # fmt: skip
    if upload.size > settings.ADAPTER_MAX_BYTES:  # before reading it
        raise InvalidRequest(f"The adapter is over {settings.ADAPTER_MAX_BYTES} bytes.", param=field,
                             code="adapter_too_large")  # fmt: skip
    return upload.read()


class AdapterListView(ManagementView):
    @extend_schema(responses=s.AdapterOutput(many=True))
    def get(self, request, tenant: str):
        found = self.tenant(tenant)
        return Response(s.AdapterOutput(Adapter.objects.filter(tenant=found), many=True).data)

    @extend_schema(request={"multipart/form-data": s.AdapterUpload}, responses={201: s.AdapterOutput})
    def post(self, request, tenant: str):
        found = self.tenant(tenant)
        name, base_id = _required(request.data, "name"), _required(request.data, "base_model")
        base = ServedModel.objects.filter(model_id=base_id, is_enabled=True).first()
        if base is None:
            raise InvalidRequest(f"base_model: no served model '{base_id}'.", param="base_model",
                                 code="model_not_found")  # fmt: skip
        config, weights = _adapter_files(request)
        adapter = adapter_create(tenant=found, base_model=base, name=name, config=config, weights=weights)
        return Response(s.AdapterOutput(adapter).data, status=status.HTTP_201_CREATED)


class AdapterDetailView(ManagementView):
    def adapter(self, tenant: str, model_id: str) -> Adapter:
        base, _, name = model_id.rpartition(":")
        return get_object_or_404(Adapter, tenant=self.tenant(tenant), base_model=base, name=name)

    @extend_schema(responses=s.AdapterOutput)
    def get(self, request, tenant: str, adapter: str):
        return Response(s.AdapterOutput(self.adapter(tenant, adapter)).data)

    @extend_schema(responses={204: None})
    def delete(self, request, tenant: str, adapter: str):
        adapter_delete(adapter=self.adapter(tenant, adapter))
        return Response(status=status.HTTP_204_NO_CONTENT)
