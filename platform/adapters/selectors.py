"""Reads of tenants' adapters; every read is scoped to one tenant."""

from adapters.models import Adapter


def adapters_for(*, tenant_id: int, base_models=None) -> list[Adapter]:
    """The tenant's adapters (on `base_models` only, when given)."""
    adapters = Adapter.objects.filter(tenant_id=tenant_id)
    if base_models is not None:
        adapters = adapters.filter(base_model__in=list(base_models))
    return list(adapters)


def adapter_get(*, tenant_id: int, base_model: str, name: str) -> Adapter | None:
    """The tenant's adapter `name` on `base_model`, or None (another tenant's is None too)."""
    return Adapter.objects.filter(tenant_id=tenant_id, base_model=base_model, name=name).first()
