"""The gateway's admission step: plan's models, quotas (429) and the pool's fair share, in that order."""

from catalog.models import ServedModel
from gateway.errors import NotFound, RateLimited
from quotas.admission import Admitted, QuotaExceeded, quota_admit, quota_release
from quotas.fairshare import fair_share_acquire, pool_capacity
from quotas.limits import limits_for
from tenants.services import KeyPrincipal


def admission_gate(
    *,
    principal: KeyPrincipal,
    model: ServedModel,
    request_id: str,
    prompt_tokens: int,
    max_tokens: int,
    implicit_max_tokens: bool,
    ready_workers: list[str] | None = None,
) -> Admitted:
    """Reserve the request's quota and a fair share of the pool, or raise the OpenAI error to return.

    On success the caller owns the reservation: it is settled through the ledger once the request is
    enqueued; if enqueueing fails, the caller must `quota_release` it.
    """
    limits = limits_for(tenant_id=principal.tenant_id, key_id=principal.key_id)
    if not limits.may_use(model.model_id):
        raise NotFound(
            f"The model '{model.model_id}' does not exist or you do not have access to it.",
            param="model",
            code="model_not_found",
        )
    try:
        admitted = quota_admit(
            request_id=request_id, tenant_id=principal.tenant_id, key_id=principal.key_id, limits=limits,
            prompt_tokens=prompt_tokens, max_tokens=max_tokens, implicit_max_tokens=implicit_max_tokens,
        )  # fmt: skip
    except QuotaExceeded as exc:
        param = "max_tokens" if exc.too_large and not implicit_max_tokens else None
        code = "insufficient_quota" if exc.limit == "budget_tokens" else "rate_limit_exceeded"
        raise RateLimited(
            str(exc), param=param, code=code, headers={**exc.headers, "x-ratelimit-exceeded": exc.limit}
        ) from None
    try:
        fair_share_acquire(
            pool=model.pool, request_id=request_id, tenant_id=principal.tenant_id,
            weight=limits.fair_share_weight, capacity=pool_capacity(model.pool, ready_workers),
        )  # fmt: skip
    except BaseException:
        quota_release(request_id=request_id)
        raise
    return admitted
