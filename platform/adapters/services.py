"""Creating and deleting tenants' adapters. Files are checked in full before anything is stored
(adapters/files.py); a refused upload leaves no row and no file."""

import logging

from django.conf import settings
from django.db import IntegrityError, transaction

from adapters.files import adapter_check
from adapters.models import Adapter, adapter_name_validator
from adapters.store import CONFIG_NAME, WEIGHTS_NAME, adapter_digest, adapter_store
from catalog.models import ServedModel
from gateway.errors import InvalidRequest, OpenAIError
from tenants.models import Tenant

log = logging.getLogger(__name__)


class AdapterConflict(OpenAIError):
    status = 409


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


def adapter_create(*, tenant: Tenant, base_model: ServedModel, name: str, config: bytes, weights: bytes) -> Adapter:
    """Check, store and register an adapter for `tenant` on `base_model`, named `name`.

    Raises InvalidRequest (400) for a bad name or bad files, AdapterConflict (409) for a name in use
    or a tenant at its plan's adapter limit."""
    _check_name(name)
    if Adapter.objects.filter(tenant=tenant, base_model=base_model.model_id, name=name).exists():
        raise AdapterConflict(f"An adapter named '{name}' exists already on {base_model.model_id}.",
                              param="name", code="adapter_exists")  # fmt: skip
    limit = adapter_limit(tenant=tenant)
    if limit is not None and Adapter.objects.filter(tenant=tenant).count() >= limit:
        raise AdapterConflict(f"The plan allows {limit} adapters; delete one first.", code="adapter_limit_reached")
    spec = adapter_check(
        config_raw=config, weights=weights, base_path=base_model.path,
        max_rank=settings.ADAPTER_MAX_RANK, max_bytes=settings.ADAPTER_MAX_BYTES,
    )  # fmt: skip
    files = {CONFIG_NAME: config, WEIGHTS_NAME: weights}
    digest = adapter_digest(files)
    adapter_store().put(digest, files)
    try:
        with transaction.atomic():
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
    """Delete the adapter: requests naming it are a 404 from now on; its files go once no adapter
    row of any tenant names them."""
    digest = adapter.digest
    adapter.delete()
    transaction.on_commit(lambda: _forget_files_if_unused(digest))


def _forget_files_if_unused(digest: str) -> None:
    if not Adapter.objects.filter(digest=digest).exists():
        adapter_store().delete(digest)
