"""Admission and settlement: the quota side of the request path, all in Redis (shared by every process).

`quota_admit` runs one Lua script that checks and reserves, for the tenant and for the key (when it
has limits of its own), requests per minute, prompt and completion tokens per minute, requests in
flight and the period's token budget: `prompt_tokens + max_tokens` is reserved. A request whose
max_tokens was not given has it lowered to what is left of its budget and output TPM, so a request
that fits is never refused. `quota_settle` replaces the reservation by the actual usage, exactly once
per request id: the reservation record `resv:<rid>` is consumed by the first settle.

Settle is called where usage becomes durable: when a usage entry is put into, or drained from, the
`ledger:pending` buffer (ledger.services), which covers a finished request, a client disconnect
(the worker reports what it generated), a request taken back from the queue and a lost worker.
`quota_reap` settles reservations nobody settled in time (a crashed gateway) from the ledger.
"""

import json
import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from config.redis_client import get_redis
from quotas.limits import Limits

RESERVATIONS = "resv:deadlines"
# A reservation (and the slot it holds) lives at most this long: the lifetime of a request's keys.
HOLD_SECONDS = 3600
UNLIMITED = -1

_LUA = Path(__file__).resolve().parent / "lua"


@cache
def _script(name: str):
    return get_redis().register_script((_LUA / f"{name}.lua").read_text())


def resv_key(request_id: str) -> str:
    return f"resv:{request_id}"


def tenant_scope(tenant_id: int) -> str:
    return f"q:t:{tenant_id}"


def key_scope(key_id: int) -> str:
    return f"q:k:{key_id}"


# The x-ratelimit-* header suffix of each limit, and how a refusal names it.
LIMIT_NAMES = {
    "requests": "requests per minute (RPM)",
    "input_tokens": "input tokens per minute (TPM)",
    "output_tokens": "output tokens per minute (TPM)",
    "concurrency": "concurrent requests",
    "budget_tokens": "token budget for the billing period",
}


@dataclass(frozen=True)
class Admitted:
    max_tokens: int
    headers: dict[str, str]


class QuotaExceeded(Exception):
    def __init__(self, *, limit: str, retry_after: int, headers: dict[str, str], too_large: bool = False):
        self.limit, self.retry_after, self.headers, self.too_large = limit, retry_after, headers, too_large
        what = LIMIT_NAMES[limit]
        if too_large:
            message = f"Request too large: it needs more than the {what} limit allows."
        elif limit == "budget_tokens":
            message = f"You exceeded your {what}; it renews in {retry_after}s."
        else:
            message = f"Rate limit reached for {what}; retry after {retry_after}s."
        super().__init__(message)


def _reset(seconds: float) -> str:
    return f"{max(0.0, seconds):.3f}s" if seconds < 60 else f"{math.ceil(seconds)}s"


def ratelimit_headers(state: dict) -> dict[str, str]:
    """OpenAI's x-ratelimit-* names; -tokens is prompt + completion tokens per minute."""
    headers = {}
    for limit, (maximum, remaining, reset) in state.items():
        suffix = limit.replace("_", "-")
        headers[f"x-ratelimit-limit-{suffix}"] = str(maximum)
        headers[f"x-ratelimit-remaining-{suffix}"] = str(remaining)
        if limit != "concurrency":
            headers[f"x-ratelimit-reset-{suffix}"] = _reset(reset)
    token_limits = [state[name] for name in ("input_tokens", "output_tokens") if name in state]
    if token_limits:
        headers["x-ratelimit-limit-tokens"] = str(sum(s[0] for s in token_limits))
        headers["x-ratelimit-remaining-tokens"] = str(sum(s[1] for s in token_limits))
        headers["x-ratelimit-reset-tokens"] = _reset(max(s[2] for s in token_limits))
    return headers


def _scope_args(limits: dict | None, used: int) -> list[int]:
    if limits is None:
        return [UNLIMITED] * 5 + [0]
    values = [limits[name] for name in ("rpm", "input_tpm", "output_tpm", "concurrency", "budget_tokens")]
    return [UNLIMITED if v is None else int(v) for v in values] + [used]


def quota_admit(
    *,
    request_id: str,
    tenant_id: int,
    key_id: int,
    limits: Limits,
    prompt_tokens: int,
    max_tokens: int,
    implicit_max_tokens: bool,
    redis=None,
) -> Admitted:
    """Check and reserve every limit for one request, or raise QuotaExceeded (nothing reserved).

    `redis`: a client to run on (default: the process's shared one)."""
    scopes = [tenant_scope(tenant_id)]
    args = [request_id, prompt_tokens, max_tokens, int(implicit_max_tokens), limits.period.id,
            int(limits.period.end.timestamp()), HOLD_SECONDS]  # fmt: skip
    args += _scope_args(limits.tenant, limits.tenant_used)
    if limits.key is not None:
        scopes.append(key_scope(key_id))
        args += _scope_args(limits.key, limits.key_used)
    reply = _script("admit")(keys=[resv_key(request_id), RESERVATIONS, *scopes], args=args, client=redis)
    if reply[0] == 1:
        return Admitted(max_tokens=int(reply[1]), headers=ratelimit_headers(json.loads(reply[2])))
    limit, retry_after = reply[1], int(reply[2])
    state = json.loads(reply[3])
    return_headers = ratelimit_headers(state)
    return_headers["Retry-After"] = str(retry_after)
    raise QuotaExceeded(
        limit=limit,
        retry_after=retry_after,
        headers=return_headers,
        too_large=_never_fits(limit, limits, prompt_tokens),
    )


def _never_fits(limit: str, limits: Limits, prompt_tokens: int) -> bool:
    field = {"input_tokens": "input_tpm", "budget_tokens": "budget_tokens"}.get(limit)
    if field is None:
        return False
    caps = [s[field] for s in (limits.tenant, limits.key) if s is not None and s[field] is not None]
    return any(prompt_tokens >= cap for cap in caps)


def quota_settle(*, request_id: str, prompt_tokens: int, completion_tokens: int, redis=None) -> bool:
    """Replace the reservation by the actual usage; False if it was settled already."""
    reply = _script("settle")(
        keys=[resv_key(request_id), RESERVATIONS], args=[request_id, prompt_tokens, completion_tokens], client=redis
    )
    return reply == 1


def quota_settle_many(usages) -> None:
    """Settle a batch of protocol.Usage entries in one round trip."""
    if not usages:
        return
    script = _script("settle")
    pipe = get_redis().pipeline(transaction=False)
    for usage in usages:
        script(
            keys=[resv_key(usage.request_id), RESERVATIONS],
            args=[usage.request_id, usage.prompt_tokens, usage.completion_tokens],
            client=pipe,
        )
    pipe.execute()


def quota_release(*, request_id: str) -> bool:
    """Give a reservation back whole (the request was never enqueued)."""
    return quota_settle(request_id=request_id, prompt_tokens=0, completion_tokens=0)
