"""Reads of the model catalog, always scoped to what the caller may use (`model_access_allowed`).

The enabled models are cached per process for CACHE_SECONDS: the lookup runs on every inference
request, and the catalog changes rarely. A model id missing from the cache is looked up again, so a
newly registered model is served at once; a disabled one stops within CACHE_SECONDS.
"""

import threading
import time

from catalog.models import ServedModel
from config.database import read_with_fallback
from gateway.errors import NotFound
from quotas.limits import Limits
from tenants.services import KeyPrincipal

CACHE_SECONDS = 2.0
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
    return [
        model
        for model_id, model in sorted(_enabled_models().items())
        if model_access_allowed(principal=principal, limits=limits, model_id=model_id)
    ]


def served_model_get(*, principal: KeyPrincipal, limits: Limits, model_id: str) -> ServedModel:
    model = _enabled_models().get(model_id) or _enabled_models(refresh=True).get(model_id)
    # A model the caller may not use looks exactly like one that does not exist.
    if model is None or not model_access_allowed(principal=principal, limits=limits, model_id=model_id):
        raise NotFound(
            f"The model '{model_id}' does not exist or you do not have access to it.",
            param="model",
            code="model_not_found",
        )
    return model
