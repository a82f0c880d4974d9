"""The quota scripts (Lua, in lua/) and the reservation keys they share.

Free of Django and of the rest of the app, because a worker runs one of them too: the settle of a
finished request goes into the same write as its done event and usage entry (workers/relay.py), so
a tenant's concurrency slot and budget come back the moment the request's usage is durable, and
the gateway spends no round trip on it.
"""

from functools import cache
from pathlib import Path

from redis.commands.core import Script

from config.redis_client import get_redis
from workers.protocol import LEDGER_PENDING

RESERVATIONS = "resv:deadlines"

_LUA = Path(__file__).resolve().parent / "lua"

# Scripts made of others, so that one round trip does what each does alone: each part becomes a
# local function of (KEYS, ARGV) ahead of the script's own text.
_PARTS = {"admit_and_take_slot": ("admit", "fair_acquire"), "settle_pending": ("settle",)}


def resv_key(request_id: str) -> str:
    return f"resv:{request_id}"


@cache
def lua_source(name: str) -> str:
    parts = "".join(
        f"local function {part}(KEYS, ARGV)\n{(_LUA / f'{part}.lua').read_text()}\nend\n"
        for part in _PARTS.get(name, ())
    )
    return parts + (_LUA / f"{name}.lua").read_text()


@cache
def quota_script(name: str) -> Script:
    return get_redis().register_script(lua_source(name))


def settle_pending_call(request_id: str) -> tuple[Script, list, list]:
    """The settle of a finished request from its own usage entry in `ledger:pending`, as (script,
    keys, args) for a pipeline; idempotent, like every settle (quotas/settlement.py)."""
    return quota_script("settle_pending"), [LEDGER_PENDING, resv_key(request_id), RESERVATIONS], [request_id]
