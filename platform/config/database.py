"""PostgreSQL's health as this process last saw it, for the inference path's reads.

The inference path reads PostgreSQL only when Redis's copy of a record is missing or old (an API
key, a tenant's limits, the model catalog). When PostgreSQL is down, such a read fails; it then
falls back to the last copy Redis (or the process) holds, and this process stops trying PostgreSQL
for RETRY_SECONDS: an outage costs one failed attempt per window, not one per request, and known
keys keep being served from their last known records. Usage never needs PostgreSQL on that path:
it is buffered in Redis (`ledger:pending`) and written once the database is back.
"""

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from django import db

log = logging.getLogger(__name__)

T = TypeVar("T")
RETRY_SECONDS = 5.0
# What a lost or refused connection raises; other database errors are bugs or bad data, not outages.
OUTAGE_ERRORS = (db.OperationalError, db.InterfaceError)

_down_until = 0.0  # while down: when the next attempt may be made
_down = False
_probe = threading.Lock()  # guards _down_until: while down, one caller per window tries again


class DatabaseUnavailable(Exception):
    """PostgreSQL is unreachable and no earlier copy of what was asked for is at hand."""


def database_reachable() -> bool:
    """False from a failure until a later read succeeds (writes that can wait skip PostgreSQL)."""
    return not _down


def database_failed(error: BaseException) -> None:
    """Note an outage: skip PostgreSQL for RETRY_SECONDS; drop the broken connection."""
    global _down, _down_until
    if not _down:
        log.warning("PostgreSQL unreachable (%s); serving from cached records", error)
    _down, _down_until = True, time.monotonic() + RETRY_SECONDS
    try:
        db.connection.close()
    except OUTAGE_ERRORS:
        pass


def _database_recovered() -> None:
    global _down
    if _down:
        log.warning("PostgreSQL reachable again")
    _down = False


def read_with_fallback(read: Callable[[], T], fallback: Callable[[], T | None], *, what: str) -> T:
    """`read()` from PostgreSQL; if it is down, `fallback()` (the last known copy), or
    DatabaseUnavailable when there is none.

    While it is down, one caller per RETRY_SECONDS tries it again; the others do not wait for that
    attempt (which can last the connection pool's timeout) and use the fallback."""
    if not _down or _claim_probe():
        try:
            value = read()
        except OUTAGE_ERRORS as exc:
            database_failed(exc)
        else:
            _database_recovered()
            return value
    last_known = fallback()
    if last_known is None:
        raise DatabaseUnavailable(f"the database is unreachable and {what} is not cached")
    return last_known


def _claim_probe() -> bool:
    """True for the one caller that may try PostgreSQL again now; the others wait RETRY_SECONDS."""
    global _down_until
    with _probe:
        if time.monotonic() < _down_until:
            return False
        _down_until = time.monotonic() + RETRY_SECONDS
        return True
