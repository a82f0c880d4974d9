"""Requests admission refused, kept per tenant for the console's "why was I throttled" page.

Admission (`quotas.gate`) records each refusal where it is decided: it knows the tenant, the key and
the limit hit, so nothing downstream has to re-read the request's credentials or the response's body.
The last REFUSALS_KEPT refusals of each tenant stay in a capped Redis list, newest first: a flood of
429s costs one pipelined LPUSH+LTRIM+EXPIRE each and never reaches PostgreSQL. The list's key is the
one the console has always read (`console:throttled:<tenant>`), so refusals recorded before this
module owned it stay listed.
"""

import json
import logging
import time
from dataclasses import dataclass, field

from config.redis_client import get_redis

log = logging.getLogger(__name__)

REFUSALS_KEPT = 200
REFUSALS_TTL_SECONDS = 7 * 86400


def refusals_key(tenant_id: int) -> str:
    return f"console:throttled:{tenant_id}"


@dataclass(frozen=True)
class Refusal:
    """One refused request: the limit it hit (a quotas.admission.LIMIT_NAMES key) and what the caller
    was told (the error's code and message, and Retry-After in seconds when a wait helps)."""

    key_prefix: str
    limit: str
    code: str
    message: str
    retry_after: int | None
    at: float = field(default_factory=time.time)


def refusal_record(*, tenant_id: int, refusal: Refusal) -> None:
    """Append the refusal to its tenant's list. Never raises: recording must not turn a 429 into a 500."""
    # The stored names are the ones the list has always held ("key" for the key's prefix).
    event = {"at": refusal.at, "key": refusal.key_prefix, "limit": refusal.limit, "code": refusal.code,
             "message": refusal.message, "retry_after": refusal.retry_after}  # fmt: skip
    key = refusals_key(tenant_id)
    try:
        pipe = get_redis().pipeline(transaction=False)
        pipe.lpush(key, json.dumps(event, separators=(",", ":")))
        pipe.ltrim(key, 0, REFUSALS_KEPT - 1)
        pipe.expire(key, REFUSALS_TTL_SECONDS)
        pipe.execute()
    except Exception:
        log.warning("could not record a refused request of tenant %s", tenant_id, exc_info=True)


def refusals_recent(*, tenant_id: int, count: int = 100) -> list[Refusal]:
    """The tenant's most recent refusals, newest first."""
    refusals = []
    for raw in get_redis().lrange(refusals_key(tenant_id), 0, count - 1):
        event = json.loads(raw)
        refusals.append(
            Refusal(
                key_prefix=event["key"],
                limit=event["limit"],
                code=event.get("code") or "",
                message=event.get("message") or "",
                retry_after=event.get("retry_after"),
                at=event["at"],
            )  # fmt: skip
        )
    return refusals
