"""Reads of the model catalog, always scoped to what the caller may use (`model_access_allowed`).

The enabled models are cached per process for CACHE_SECONDS: the lookup runs on every inference
request, and the catalog changes rarely. A model id missing from the cache is looked up again, so a
newly registered model is served at once; a disabled one stops within CACHE_SECONDS.

A tenant's LoRA adapters are served as `<base>:<adapter name>` to that tenant only, under the same
rule as their base model; they are read from PostgreSQL on each request (not cached), so a deleted
adapter is a 404 at once; while PostgreSQL is down they are left out of the list and a request for
one is a 503.
"""

import threading
import time
from typing import Protocol

from adapters.selectors import adapter_get, adapters_for
from catalog.models import ServedModel
from config.database import read_with_fallback
from core.errors import NotFound
from tenants.services import KeyPrincipal

CACHE_SECONDS = 2.0


class Limits(Protocol):
    """What the model-access rule reads of the caller's limits (quotas.limits.Limits, resolved above
    this app): its plan's models, empty for every model."""

    allowed_models: tuple[str, ...]

_cache: dict = {"at": float("-inf"), "models": {}}
_refreshing = threading.Lock()


def _enabled_models(*, refresh: bool = False) -> dict[str, ServedModel]:
    if not refresh and time.monotonic() - _cache["at"] <= CACHE_SECONDS:
        return _cache["models"]
    # Never wait for another thread's refresh: the waiter may hold a pooled database connection (its
    # key check just used one) that the refreshing thread needs, and enough such waiters deadlocked
    # the pool until its timeout (benchmarks, 64 streams, right when the auth cache expired). So one
    # thread refreshes a stale snapshot while the others keep serving it; a model id missing from
    # the snapshot (`refresh`) or an empty one is looked up at once.
    if refresh or not _cache["models"]:
        return _load()
    if not _refreshing.acquire(blocking=False):
        return _cache["models"]
    try:
        return _load()
    finally:
        _refreshing.release()


def _load() -> dict[str, ServedModel]:
    """The enabled models from PostgreSQL; while it is unreachable, the last ones read."""
    models = read_with_fallback(_read_enabled, lambda: _cache["models"] or None, what="the model catalog")
    _cache["models"], _cache["at"] = models, time.monotonic()
    return models


def _read_enabled() -> dict[str, ServedModel]:
    return {m.model_id: m for m in ServedModel.objects.filter(is_enabled=True)}


def model_access_allowed(*, principal: KeyPrincipal, limits: Limits, model_id: str) -> bool:
    """The one rule of who may use a model, for the listing and for inference alike: the key's own
    `allowed_models` and its tenant's plan's `allowed_models` must both allow it (empty: every model)."""
    return all(not allowed or model_id in allowed for allowed in (principal.allowed_models, limits.allowed_models))


def served_models_for(*, principal: KeyPrincipal, limits: Limits) -> list[ServedModel]:
    """The models the caller may use, each followed by the caller's tenant's adapters on it."""
    bases = [
        model
        for model_id, model in sorted(_enabled_models().items())
        if model_access_allowed(principal=principal, limits=limits, model_id=model_id)
    ]
    by_base: dict[str, list] = {}
    # While PostgreSQL is down the list goes on without the adapters (the base models are cached).
    adapters: list = read_with_fallback(
        lambda: adapters_for(tenant_id=principal.tenant_id, base_models=[m.model_id for m in bases]),
        list, what="the tenant's adapters",
    )  # fmt: skip
    for adapter in adapters:
        by_base.setdefault(adapter.base_model, []).append(adapter)
    return [
        served
        for base in bases
        for served in (base, *(base.with_adapter(adapter) for adapter in by_base.get(base.model_id, [])))
    ]


def _adapter_model(principal: KeyPrincipal, limits: Limits, model_id: str) -> ServedModel | None:
    """`<base>:<name>`: the caller's tenant's adapter `name` on a base model it may use, or None.
    An adapter is usable wherever its base model is (`model_access_allowed` on the base's id)."""
    base_id, _, name = model_id.rpartition(":")
    base = (_enabled_models().get(base_id) or _enabled_models(refresh=True).get(base_id)) if base_id else None
    if base is None or not model_access_allowed(principal=principal, limits=limits, model_id=base_id):
        return None
    adapter = adapter_get(tenant_id=principal.tenant_id, base_model=base_id, name=name)
    return base.with_adapter(adapter) if adapter is not None else None


def served_model_get(*, principal: KeyPrincipal, limits: Limits, model_id: str) -> ServedModel:
    model = _enabled_models().get(model_id)
    if model is None and ":" in model_id:
        adapted = _adapter_model(principal, limits, model_id)
        if adapted is not None:
            return adapted
    model = model or _enabled_models(refresh=True).get(model_id)
    # A model the caller may not use looks exactly like one that does not exist.
    if model is None or not model_access_allowed(principal=principal, limits=limits, model_id=model_id):
        raise NotFound(
            f"The model '{model_id}' does not exist or you do not have access to it.",
            param="model",
            code="model_not_found",
        )
    return model
