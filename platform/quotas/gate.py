"""The gateway's admission steps: refuse early what cannot be admitted now, then reserve the quotas
and a fair share of the pool.

The view calls `admission_check` before each expensive step (with a lower bound of the prompt's size
before tokenizing it, with the exact size before waiting for a worker) and `admission_gate` last,
which reserves. A request larger than a limit's whole capacity is an InvalidRequest (400) naming the
parameter to shrink, without Retry-After (no wait helps); one over a limit for now is a RateLimited
(429) with Retry-After, and is recorded for the tenant's console (quotas/refusals.py).
"""

from collections.abc import Mapping

from catalog.models import ServedModel
from catalog.readiness import ready_workers_call, ready_workers_from
from config.redis_client import scripts_in_one_round_trip
from core.errors import InvalidRequest, RateLimited
from quotas.admission import (
    Admitted,
    QuotaExceeded,
    RequestTooLarge,
    admitted_from,
    quota_admit_call,
    quota_release,
    quota_size_check,
)
from quotas.fairshare import fair_share_acquire, pool_capacity, quota_admit_with_slot
from quotas.limits import Limits
from quotas.refusals import Refusal, refusal_record
from tenants.services import KeyPrincipal


def admission_check(
    *,
    principal: KeyPrincipal,
    limits: Limits,
    prompt_tokens: int,
    max_tokens: int,
    implicit_max_tokens: bool,
    prompt_param: str,
    choices: int = 1,
    at_least: bool = False,
    counters: bool = True,
    ready_pool: str | None = None,
) -> dict[str, int] | None:
    """Raise the error admission would answer now, reserving nothing.

    `prompt_param`: the request's prompt field ("messages" or "prompt"), named by a 400 about it.
    `choices`: the request's n (`max_tokens` counts all of them; see `admission_gate`).
    `at_least`: `prompt_tokens` is a lower bound (the prompt is not tokenized yet); any refusal is
    then one the exact size would get too. `counters=False` checks only what can never fit (no
    Redis call), not the tenant's current usage. `ready_pool` (with the counters): that pool's
    ready workers are read in the same round trip as the counters and returned
    (catalog/readiness.py `ready_workers`): on a busy core each round trip is a wait for Redis
    and another for the CPU, on the path of every request."""
    try:
        quota_size_check(
            limits=limits, prompt_tokens=prompt_tokens, max_tokens=max_tokens,
            implicit_max_tokens=implicit_max_tokens, at_least=at_least, choices=choices,
        )  # fmt: skip
        if not counters:
            return None
        check = quota_admit_call(
            request_id="check", tenant_id=principal.tenant_id, key_id=principal.key_id, limits=limits,
            prompt_tokens=prompt_tokens, max_tokens=max_tokens, implicit_max_tokens=implicit_max_tokens,
            choices=choices, check_only=True,
        )  # fmt: skip
        read = [ready_workers_call(ready_pool)] if ready_pool is not None else []
        checked, *rows = scripts_in_one_round_trip([check, *read])
        admitted_from(checked)
        return ready_workers_from(rows[0]) if rows else None
    except RequestTooLarge as exc:
        param = {"prompt": prompt_param, "completion": "max_tokens"}.get(exc.part or "")
        raise InvalidRequest(str(exc), param=param, code="exceeds_limit") from None
    except QuotaExceeded as exc:
        raise _rate_limited(principal, exc) from None


def admission_gate(
    *,
    principal: KeyPrincipal,
    limits: Limits,
    model: ServedModel,
    request_id: str,
    prompt_tokens: int,
    max_tokens: int,
    implicit_max_tokens: bool,
    choices: int = 1,
    ready_workers: Mapping[str, int] | None = None,
) -> Admitted:
    """Reserve the request's quota and a fair share of the pool, or raise the error to answer.

    `max_tokens` counts every one of the request's `choices` (its n). An implicit max_tokens is
    lowered to what the limits leave, in `Admitted.max_tokens`, and never below one token per
    choice: with less left, the request is refused (429, recorded) like any other over a limit.
    On success the caller owns the reservation: it is settled through the ledger once the request is
    enqueued; if enqueueing fails, the caller must `quota_release` it.
    """
    capacity = pool_capacity(model.pool, ready_workers)
    try:
        # With fair share on, the reservation and the first try for a pool slot are one script.
        admitted, slot_taken = quota_admit_with_slot(
            request_id=request_id, tenant_id=principal.tenant_id, key_id=principal.key_id, limits=limits,
            prompt_tokens=prompt_tokens, max_tokens=max_tokens, implicit_max_tokens=implicit_max_tokens,
            choices=choices, pool=model.pool, weight=limits.fair_share_weight, capacity=capacity,
        )  # fmt: skip
    except QuotaExceeded as exc:
        raise _rate_limited(principal, exc) from None
    if slot_taken:
        return admitted
    try:
        fair_share_acquire(
            pool=model.pool, request_id=request_id, tenant_id=principal.tenant_id,
            weight=limits.fair_share_weight, capacity=capacity, queued=True,
        )  # fmt: skip
    except BaseException:
        quota_release(request_id=request_id)
        raise
    return admitted


def _rate_limited(principal: KeyPrincipal, exc: QuotaExceeded) -> RateLimited:
    """The 429 of a limit used up for now, recorded for the tenant's console."""
    code = "insufficient_quota" if exc.limit == "budget_tokens" else "rate_limit_exceeded"
    refusal = Refusal(
        key_prefix=principal.key_prefix, limit=exc.limit, code=code, message=str(exc), retry_after=exc.retry_after
    )
    refusal_record(tenant_id=principal.tenant_id, refusal=refusal)
    return RateLimited(str(exc), code=code, headers={**exc.headers, "x-ratelimit-exceeded": exc.limit})
