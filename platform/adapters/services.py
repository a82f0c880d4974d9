"""Creating and deleting tenants' adapters. Files are checked in full before anything is stored
(adapters/files.py); a refused upload leaves no row and no file."""

import logging
import time
from typing import Protocol

from django.conf import settings
from django.db import IntegrityError, transaction

from adapters.files import adapter_check
from adapters.models import Adapter, adapter_name_validator
from config.redis_client import get_redis
from contract import protocol
from contract.adapter_store import CONFIG_NAME, WEIGHTS_NAME, AdapterStoreUnavailable, adapter_digest, adapter_store
from contract.outage import REDIS_UNAVAILABLE
from core.errors import Conflict, InvalidRequest, ServiceUnavailable
from tenants.models import Tenant

log = logging.getLogger(__name__)


class ServedModel(Protocol):
    """What an adapter needs of its base model (catalog.models.ServedModel; the catalog reads adapters,
    so this app names only the fields it uses): the model id clients use and where its files are."""

    model_id: str
    path: str


class AdapterConflict(Conflict):
    """A name in use on that base model, or a tenant at its plan's adapter limit (409)."""


def _check_name(name: str) -> None:
    from django.core.exceptions import ValidationError

    try:
        adapter_name_validator(name)
    except ValidationError as exc:
        raise InvalidRequest(f"name: {exc.messages[0]}.", param="name", code="invalid_name") from None


def adapter_limit(*, tenant: Tenant) -> int | None:
    """How many adapters the tenant may keep (its plan's max_adapters; None: no limit)."""
    quota = getattr(tenant, "quota", None)
    plan = getattr(quota, "plan", None) if quota is not None else None
    return getattr(plan, "max_adapters", None) if plan is not None else None


def _check_room(*, tenant: Tenant, base_model: ServedModel, name: str) -> None:
    """AdapterConflict when the name is taken or the tenant is at its plan's adapter limit."""
    if Adapter.objects.filter(tenant=tenant, base_model=base_model.model_id, name=name).exists():
        raise AdapterConflict(f"An adapter named '{name}' exists already on {base_model.model_id}.",
                              param="name", code="adapter_exists")  # fmt: skip
    limit = adapter_limit(tenant=tenant)
    if limit is not None and Adapter.objects.filter(tenant=tenant).count() >= limit:
        raise AdapterConflict(f"The plan allows {limit} adapters; delete one first.", code="adapter_limit_reached")


def adapter_create(*, tenant: Tenant, base_model: ServedModel, name: str, config: bytes, weights: bytes) -> Adapter:
    """Check, store and register an adapter for `tenant` on `base_model`, named `name`.

    Raises InvalidRequest (400) for a bad name or bad files, AdapterConflict (409) for a name in use
    or a tenant at its plan's adapter limit. The limit holds under concurrent uploads: the count and
    the insert run in one transaction holding the tenant's row lock (checked once before, without
    it, so that a refused upload costs no validation and stores nothing)."""
    _check_name(name)
    _check_room(tenant=tenant, base_model=base_model, name=name)
    spec = adapter_check(
        config_raw=config, weights=weights, base_path=base_model.path,
        max_rank=settings.ADAPTER_MAX_RANK, max_bytes=settings.ADAPTER_MAX_BYTES,
    )  # fmt: skip
    files = {CONFIG_NAME: config, WEIGHTS_NAME: weights}
    digest = adapter_digest(files)
    try:
        adapter_store().put(digest, files)
    except AdapterStoreUnavailable as exc:
        log.warning("adapter upload refused for now: %s", exc)
        raise ServiceUnavailable("The adapter store cannot be reached right now; try again later.",
                                 code="adapter_store_unavailable", headers={"Retry-After": "10"}) from None  # fmt: skip
    try:
        with transaction.atomic():
            # Uploads of one tenant queue here until the one ahead commits: each counts the others.
            Tenant.objects.select_for_update().filter(pk=tenant.pk).first()
            _check_room(tenant=tenant, base_model=base_model, name=name)
            adapter = Adapter.objects.create(
                tenant=tenant, name=name, base_model=base_model.model_id, digest=digest, rank=spec.rank,
                target_modules=spec.target_modules, size_bytes=spec.size_bytes,
            )  # fmt: skip
            # Again once the row exists: a delete of the last other adapter with the same files may have
            # removed them between the first put and the row (a no-op when they are there).
            transaction.on_commit(lambda: adapter_store().put(digest, files))
            return adapter
    except IntegrityError:
        _forget_files_if_unused(digest)
        raise AdapterConflict(f"An adapter named '{name}' exists already on {base_model.model_id}.",
                              param="name", code="adapter_exists") from None  # fmt: skip
    except BaseException:
        _forget_files_if_unused(digest)
        raise


def adapter_delete(*, adapter: Adapter) -> None:
    """Delete the adapter: requests naming it are a 404 from now on; workers that loaded it unload it
    within a heartbeat (workers/adapters.py); its files go once no adapter row of any tenant names
    them."""
    digest, adapter_id = adapter.digest, adapter.pk
    adapter.delete()
    transaction.on_commit(lambda: _announce_deleted(adapter_id))
    transaction.on_commit(lambda: _forget_files_if_unused(digest))


def _announce_deleted(adapter_id: int) -> None:
    """Tell the workers (`adapters:deleted`, contract/protocol.py). Without Redis they keep the adapter
    until their engine evicts it: nothing can call it any more, so the deletion stands."""
    now = time.time()
    try:
        pipe = get_redis().pipeline(transaction=True)
        pipe.zadd(protocol.ADAPTERS_DELETED, {str(adapter_id): now})
        pipe.zremrangebyscore(protocol.ADAPTERS_DELETED, "-inf", now - protocol.ADAPTERS_DELETED_KEEP_SECONDS)
        pipe.execute()
    except REDIS_UNAVAILABLE:
        log.warning("adapter %d deleted, but Redis is unavailable: workers unload it when they evict it", adapter_id)


def _forget_files_if_unused(digest: str) -> None:
    if Adapter.objects.filter(digest=digest).exists():
        return
    try:
        adapter_store().delete(digest)
    except AdapterStoreUnavailable:
        # The row is gone, so nothing serves them; an upload of the same files reuses them.
        log.warning("the files of adapter %s stay in the store: it cannot be reached", digest, exc_info=True)
