"""The settle of a request's quota reservation, which both sides run: its Lua (in lua/) and the
reservation keys it reads.

The gateway settles through the quotas app (quotas/settlement.py); a worker settles a request it
ends in the same write as its done event and usage entry (workers/relay.py), so a tenant's
concurrency slot and budget come back the moment the request's usage is durable, and the gateway
spends no round trip on it. The reservations themselves are taken by the quotas app's admission.
"""

from functools import cache
from pathlib import Path

from redis.commands.core import Script
from redis.connection import Encoder

from contract.protocol import LEDGER_PENDING

RESERVATIONS = "resv:deadlines"

_LUA = Path(__file__).resolve().parent / "lua"


def resv_key(request_id: str) -> str:
    return f"resv:{request_id}"


@cache
def lua_source(name: str) -> str:
    """`settle`, or `settle_pending`: `settle` as a local function of (KEYS, ARGV) ahead of the
    settle of a request from its own usage entry, so that one round trip does both."""
    parts = "".join(
        f"local function {part}(KEYS, ARGV)\n{(_LUA / f'{part}.lua').read_text()}\nend\n"
        for part in ({"settle_pending": ("settle",)}.get(name, ()))
    )
    return parts + (_LUA / f"{name}.lua").read_text()


class _Utf8:
    """What a `Script` asks of the client it is registered with: the encoder of its text, for its
    SHA1. Every client of ours encodes as UTF-8 (redis-py's default), so the digest needs none; the
    script runs by its digest in a pipeline, or with the caller's `client=`."""

    @staticmethod
    def get_encoder() -> Encoder:
        return Encoder(encoding="utf-8", encoding_errors="strict", decode_responses=False)


@cache
def _settle_pending() -> Script:
    return Script(_Utf8, lua_source("settle_pending"))


def settle_pending_call(request_id: str) -> tuple[Script, list, list]:
    """The settle of a finished request from its own usage entry in `ledger:pending`, as (script,
    keys, args) for a pipeline; idempotent, like every settle (quotas/settlement.py)."""
    return _settle_pending(), [LEDGER_PENDING, resv_key(request_id), RESERVATIONS], [request_id]
