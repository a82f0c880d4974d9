"""Admission and settlement: the quota side of the request path, all in Redis (shared by every process).

`quota_admit` runs one Lua script that checks and reserves, for the tenant and for the key (when it
has limits of its own), requests per minute, prompt and completion tokens per minute, requests in
flight and the period's token budget: `prompt_tokens + max_tokens` is reserved. A request whose
max_tokens was not given has it lowered to what is left of its budget and output TPM, so a request
that fits is never refused. `quota_settle` replaces the reservation by the actual usage, exactly once
per request id: the reservation record `resv:<rid>` is consumed by the first settle.

Before that, the gateway refuses early what admission would refuse, so a refused request costs no
tokenization and no wait for a worker: `quota_size_check` (no Redis) raises RequestTooLarge for a
request larger than a limit's whole capacity, which no wait can admit; `quota_admit` with
`check_only` runs the same script without reserving anything and raises QuotaExceeded for a request
over a limit right now.

Settle is called where usage becomes durable (quotas/settlement.py); every such path is listed in
gateway/lifecycle.py, "How usage becomes final".
"""

import json
import math
from dataclasses import dataclass
from typing import Any

from redis.commands.core import Script

from contract.settle import RESERVATIONS, resv_key
from core import clock
from quotas.limits import Limits
from quotas.scripts import quota_script

# A reservation (and the slot it holds) lives at most this long: the lifetime of a request's keys.
HOLD_SECONDS = 3600
UNLIMITED = -1


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
    """A limit is used up for now: the request fits once its window (or period) frees up."""

    def __init__(self, *, limit: str, retry_after: int, headers: dict[str, str]):
        self.limit, self.retry_after, self.headers = limit, retry_after, headers
        what = LIMIT_NAMES[limit]
        if limit == "budget_tokens":
            message = f"You exceeded your {what}; it renews in {retry_after}s."
        else:
            message = f"Rate limit reached for {what}; retry after {retry_after}s."
        super().__init__(message)


class RequestTooLarge(Exception):
    """The request needs more than a limit's whole capacity: no wait can ever admit it.

    `part` is what to shrink: "prompt", "completion" (max_tokens), or None when the limit admits
    no request at all (a limit of 0)."""

    def __init__(self, *, limit: str, cap: int, needed: int, part: str | None, at_least: bool = False):
        self.limit, self.cap, self.needed, self.part = limit, cap, needed, part
        what = LIMIT_NAMES[limit]
        counted = f"at least {needed}" if at_least else str(needed)
        if part is None:
            message = f"Your {what} limit is {cap}: no request can be admitted."
        elif part == "prompt":
            message = (
                f"The prompt has {counted} tokens, more than your {what} limit of {cap} allows; "
                "shorten it: no wait can admit this request."
            )
        else:
            message = (
                f"This request needs {counted} tokens, more than your {what} limit of {cap} allows; "
                "lower max_tokens: no wait can admit this request."
            )
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


def quota_size_check(
    *, limits: Limits, prompt_tokens: int, max_tokens: int, implicit_max_tokens: bool, at_least: bool = False,
    choices: int = 1,
) -> None:  # fmt: skip
    """Raise RequestTooLarge if some limit, even unused, could never admit the request.

    An implicit max_tokens is lowered at admission down to one token per choice (`choices`: the
    request's n), so only that much of it can make a request too large.
    `at_least`: `prompt_tokens` is a lower bound of the prompt's size (it is not tokenized yet)."""
    completion = choices if implicit_max_tokens else max_tokens
    for scope in (limits.tenant, limits.key):
        if scope is not None:
            _scope_size_check(scope, prompt_tokens, completion, at_least)


def _scope_size_check(scope: dict, prompt: int, completion: int, at_least: bool) -> None:
    def over(field: str, needed: int) -> int | None:
        cap = scope[field]
        return cap if cap is not None and needed > cap else None

    for limit, field in (("requests", "rpm"), ("concurrency", "concurrency")):
        if (cap := over(field, 1)) is not None:
            raise RequestTooLarge(limit=limit, cap=cap, needed=1, part=None)
    if (cap := over("input_tpm", prompt)) is not None:
        raise RequestTooLarge(limit="input_tokens", cap=cap, needed=prompt, part="prompt", at_least=at_least)
    if (cap := over("budget_tokens", prompt + 1)) is not None:
        raise RequestTooLarge(limit="budget_tokens", cap=cap, needed=prompt + 1, part="prompt", at_least=at_least)
    if (cap := over("output_tpm", completion)) is not None:
        raise RequestTooLarge(limit="output_tokens", cap=cap, needed=completion, part="completion")
    if (cap := over("budget_tokens", prompt + completion)) is not None:
        needed = prompt + completion
        raise RequestTooLarge(limit="budget_tokens", cap=cap, needed=needed, part="completion", at_least=at_least)


def quota_admit(
    *,
    request_id: str,
    tenant_id: int,
    key_id: int,
    limits: Limits,
    prompt_tokens: int,
    max_tokens: int,
    implicit_max_tokens: bool,
    choices: int = 1,
    check_only: bool = False,
    redis=None,
) -> Admitted:
    """Check and reserve every limit for one request, or raise QuotaExceeded (nothing reserved).

    `max_tokens` counts every choice; an implicit one is lowered to what the limits leave, but never
    below one token per choice (`choices`: the request's n): with less left, the request is refused
    by the limit that has too little.
    `check_only`: decide the same way but reserve nothing (`request_id` then names no reservation).
    Given a lower bound of the prompt's size, a refusal then is one that admission with the exact
    size would make too. `redis`: a client to run on (default: the process's shared one)."""
    script, keys, args = quota_admit_call(
        request_id=request_id, tenant_id=tenant_id, key_id=key_id, limits=limits, prompt_tokens=prompt_tokens,
        max_tokens=max_tokens, implicit_max_tokens=implicit_max_tokens, choices=choices, check_only=check_only,
    )  # fmt: skip
    return admitted_from(script(keys=keys, args=args, client=redis))


def quota_admit_call(**admit: Any) -> tuple[Script, list, list]:
    """`quota_admit` (same arguments, less `redis`) as a script call (script, keys, args), to run
    beside others in one round trip (config/redis_client.py `scripts_in_one_round_trip`);
    `admitted_from` reads its reply."""
    return quota_script("admit"), *admit_call(**admit)


def admit_call(
    *, request_id: str, tenant_id: int, key_id: int, limits: Limits, prompt_tokens: int, max_tokens: int,
    implicit_max_tokens: bool, choices: int, check_only: bool = False,
) -> tuple[list[str], list]:  # fmt: skip
    """The keys and arguments of the admit script (`quota_admit`)."""
    scopes = [tenant_scope(tenant_id)]
    args = [request_id, prompt_tokens, max_tokens, int(implicit_max_tokens), limits.period.id,
            int(limits.period.end.timestamp()), HOLD_SECONDS, int(check_only), max(1, choices),
            clock.offset()]  # fmt: skip
    args += _scope_args(limits.tenant, limits.tenant_used)
    if limits.key is not None:
        scopes.append(key_scope(key_id))
        args += _scope_args(limits.key, limits.key_used)
    return [resv_key(request_id), RESERVATIONS, *scopes], args


def admitted_from(reply: list) -> Admitted:
    """The admit script's reply as an Admitted, or QuotaExceeded."""
    if reply[0] == 1:
        return Admitted(max_tokens=int(reply[1]), headers=ratelimit_headers(json.loads(reply[2])))
    limit, retry_after = reply[1], int(reply[2])
    headers = ratelimit_headers(json.loads(reply[3]))
    headers["Retry-After"] = str(retry_after)
    raise QuotaExceeded(limit=limit, retry_after=retry_after, headers=headers)


def quota_settle(*, request_id: str, prompt_tokens: int, completion_tokens: int, redis=None) -> bool:
    """Replace the reservation by the actual usage; False if it was settled already."""
    reply = quota_script("settle")(
        keys=[resv_key(request_id), RESERVATIONS], args=[request_id, prompt_tokens, completion_tokens], client=redis
    )
    return reply == 1


def quota_release(*, request_id: str) -> bool:
    """Give a reservation back whole (the request was never enqueued)."""
    return quota_settle(request_id=request_id, prompt_tokens=0, completion_tokens=0)
