"""Reads of the model catalog, always scoped to what the calling key may use.

The enabled models are cached per process for CACHE_SECONDS: the lookup runs on every inference
request, and the catalog changes rarely. A model id missing from the cache is looked up again, so a
newly registered model is served at once; a disabled one stops within CACHE_SECONDS.
"""

import threading
import time

from catalog.models import ServedModel
from gateway.errors import NotFound
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
    models = {m.model_id: m for m in ServedModel.objects.filter(is_enabled=True)}
    _cache["models"], _cache["at"] = models, time.monotonic()
    return models


def served_models_for(principal: KeyPrincipal) -> list[ServedModel]:
    return [m for model_id, m in sorted(_enabled_models().items()) if principal.may_use(model_id)]


def served_model_get(principal: KeyPrincipal, model_id: str) -> ServedModel:
    model = _enabled_models().get(model_id) or _enabled_models(refresh=True).get(model_id)
    # A model the key may not use looks exactly like one that does not exist.
    if model is None or not principal.may_use(model_id):
        raise NotFound(
            f"The model '{model_id}' does not exist or you do not have access to it.",
            param="model",
            code="model_not_found",
        )
    return model
