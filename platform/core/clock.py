"""The wall clock of time-limited grants: a key's rotation grace and expiry, the per-minute rate
windows and the reservations' deadlines. The product reads that time here and nowhere else, so that
a test moves it (tests/clock.py) instead of sleeping past a grace or waiting for a minute to turn.

``timestamp()`` and ``now()`` are the real clock plus ``offset()`` seconds, which is 0 in the product.
The admission script keeps reading Redis's own clock, one clock for every gateway, and adds the
offset it is handed.
"""

from __future__ import annotations

import datetime as dt
import time

# Seconds this clock runs ahead of the real one; only a test sets it (tests/clock.py).
_offset = 0.0


def offset() -> float:
    """Seconds added to the real clock: 0 in the product."""
    return _offset


def timestamp() -> float:
    """Now, in unix seconds."""
    return time.time() + _offset


def now() -> dt.datetime:
    """Now, as an aware UTC datetime (what ``django.utils.timezone.now()`` gives with USE_TZ)."""
    return dt.datetime.fromtimestamp(timestamp(), tz=dt.UTC)
