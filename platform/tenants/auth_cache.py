"""The Redis cache of API key records (`auth:<prefix>`), safe against lookups racing a change.

A lookup that misses the cache reads the key's row from PostgreSQL and writes it back. If the row
changes (revoked, tenant suspended) between that read and that write, a plain write would put the
stale record back after the change had cleared it, for up to AUTH_CACHE_SECONDS. So each prefix has
a generation counter (`authgen:<prefix>`): a change bumps it and deletes the record after its
transaction commits, and a lookup writes only if the generation it read *before* its database
query is still current (checked and written atomically in Lua). Hence: once `forget` has returned,
no lookup can leave an older record in the cache.

Each record is also kept as the key's last known record (`authlast:<prefix>`, LAST_KNOWN_SECONDS),
which a lookup uses while PostgreSQL is unreachable (`config.database`); `forget` drops it too, so a
revoked key never comes back from it.
"""

import functools
from collections.abc import Iterable, Sequence

from django.conf import settings

from config.redis_client import get_redis

MISSING = "missing"
# A short negative cache keeps a flood of bad keys off the database.
MISSING_SECONDS = 5
# Far longer than any lookup's database query takes: a lookup that read a generation which has
# expired since sees "0" instead and does not write. Expiring keeps revoked keys from piling up.
GENERATION_SECONDS = 86400
# How long a key unused since keeps being served through a database outage.
LAST_KNOWN_SECONDS = 86400

_STORE_IF_CURRENT = """
if (redis.call('GET', KEYS[2]) or '0') ~= ARGV[1] then
    return 0
end
if ARGV[3] ~= '0' then
    redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
end
if ARGV[4] ~= '0' then
    redis.call('SET', KEYS[3], ARGV[2], 'EX', ARGV[4])
end
return 1
"""


@functools.cache
def _store_if_current():
    return get_redis().register_script(_STORE_IF_CURRENT)


def _record_key(prefix: str) -> str:
    return f"auth:{prefix}"


def _generation_key(prefix: str) -> str:
    return f"authgen:{prefix}"


def _last_known_key(prefix: str) -> str:
    return f"authlast:{prefix}"


def read(prefix: str, also: Sequence[str] = ()) -> tuple[str | None, str, list[str | None]]:
    """The cached record (JSON, MISSING or None), the generation to pass back to `store`, and the
    values of the Redis keys `also` (None where absent), read in the same round trip."""
    cached, generation, *values = get_redis().mget(_record_key(prefix), _generation_key(prefix), *also)
    return cached, generation or "0", values


def store(prefix: str, value: str, *, generation: str, seconds: int, last_known_seconds: int = 0) -> bool:
    """Cache `value` (and keep it as the last known record for `last_known_seconds`) unless the key
    changed since `generation` was read; True if written."""
    if seconds <= 0 and last_known_seconds <= 0:
        return False
    keys = [_record_key(prefix), _generation_key(prefix), _last_known_key(prefix)]
    return bool(_store_if_current()(keys=keys, args=[generation, value, max(seconds, 0), max(last_known_seconds, 0)]))


def store_record(prefix: str, record: str, *, generation: str) -> bool:
    return store(
        prefix, record, generation=generation, seconds=settings.AUTH_CACHE_SECONDS,
        last_known_seconds=LAST_KNOWN_SECONDS,
    )  # fmt: skip


def store_missing(prefix: str, *, generation: str) -> bool:
    return store(prefix, MISSING, generation=generation, seconds=MISSING_SECONDS)


def last_known(prefix: str) -> str | None:
    """The key's last record read from PostgreSQL (JSON), for a database outage."""
    return get_redis().get(_last_known_key(prefix))


def forget(prefixes: Iterable[str]) -> None:
    """Drop the cached records and invalidate every lookup in flight (call after the change commits)."""
    pipe = get_redis().pipeline(transaction=True)
    for prefix in prefixes:
        pipe.incr(_generation_key(prefix))
        pipe.expire(_generation_key(prefix), GENERATION_SECONDS)
        pipe.delete(_record_key(prefix), _last_known_key(prefix))
    pipe.execute()
