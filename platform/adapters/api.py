"""Management API for adapters: /api/v1/tenants/<tenant>/adapters/ (docs/api.md, "Adapters").

An upload is multipart (fields `name`, `base_model`, files `config` = adapter_config.json and
`weights` = adapter_model.safetensors) or JSON (`name`, `base_model`, `config` as an object,
`weights_base64`). An adapter is addressed by the model id clients call it with, `<base>:<name>`;
another tenant's adapter is a 404 like one that does not exist.
"""

import base64
import binascii
import json

from django.conf import settings
from django.shortcuts import get_object_or_404
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response

from adapters.models import Adapter
from adapters.services import adapter_create, adapter_delete
from api.views import ManagementView
from catalog.models import ServedModel
from gateway.errors import InvalidRequest, OpenAIError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


class AdapterOutput(serializers.ModelSerializer):
    id = serializers.CharField(source="model_id")

    class Meta:
        model = Adapter
        fields = ["id", "name", "base_model", "rank", "target_modules", "size_bytes", "digest", "created_at"]


class AdapterUpload(serializers.Serializer):
    """The multipart upload (for the schema; the body is read by `_upload_files`)."""

    name = serializers.CharField(max_length=64)
    base_model = serializers.CharField(max_length=200)
    config = serializers.FileField(help_text="adapter_config.json")
    weights = serializers.FileField(help_text="adapter_model.safetensors")


def _error(exc: OpenAIError) -> Response:
    return Response(exc.body(), status=exc.status)


def _field(data, name: str) -> str:
    value = data.get(name)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{name}: this field is required.", param=name, code="required")
    return value


def _upload_files(request) -> tuple[bytes, bytes]:
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
        weights = base64.b64decode(_field(request.data, "weights_base64"), validate=True)
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
    @extend_schema(responses=AdapterOutput(many=True))
    def get(self, request, tenant: str):
        found = self.tenant(tenant)
        return Response(AdapterOutput(Adapter.objects.filter(tenant=found), many=True).data)

    @extend_schema(request={"multipart/form-data": AdapterUpload}, responses={201: AdapterOutput})
    def post(self, request, tenant: str):
        found = self.tenant(tenant)
        try:
            name, base_id = _field(request.data, "name"), _field(request.data, "base_model")
            base = ServedModel.objects.filter(model_id=base_id, is_enabled=True).first()
            if base is None:
                raise InvalidRequest(f"base_model: no served model '{base_id}'.", param="base_model",
                                     code="model_not_found")  # fmt: skip
            config, weights = _upload_files(request)
            adapter = adapter_create(tenant=found, base_model=base, name=name, config=config, weights=weights)
        except OpenAIError as exc:
            return _error(exc)
        return Response(AdapterOutput(adapter).data, status=status.HTTP_201_CREATED)


class AdapterDetailView(ManagementView):
    def adapter(self, tenant: str, model_id: str) -> Adapter:
        base, _, name = model_id.rpartition(":")
        return get_object_or_404(Adapter, tenant=self.tenant(tenant), base_model=base, name=name)

    @extend_schema(responses=AdapterOutput)
    def get(self, request, tenant: str, adapter: str):
        return Response(AdapterOutput(self.adapter(tenant, adapter)).data)

    @extend_schema(responses={204: None})
    def delete(self, request, tenant: str, adapter: str):
        adapter_delete(adapter=self.adapter(tenant, adapter))
        return Response(status=status.HTTP_204_NO_CONTENT)
