"""A clock a test moves instead of sleeping: the product reads the time of its time-limited grants
(a key's grace, the per-minute rate windows, the reservations' deadlines) through core/clock.py, and
the ``clock`` fixture shifts it for the test's own process (the stack's processes keep real time)."""

import pytest

from core import clock as product_clock


class MovedClock:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._monkeypatch = monkeypatch

    def advance(self, seconds: float) -> None:
        """Move the clock ``seconds`` ahead."""
        self._monkeypatch.setattr(product_clock, "_offset", product_clock.offset() + seconds)

    def to_window_start(self, redis_client) -> None:
        """Move the clock to just after the next minute begins by Redis's clock (the one the admission
        script reads): a rate-window test then has the whole window before it."""
        seconds, micros = redis_client.time()
        now = seconds + micros / 1e6 + product_clock.offset()
        self.advance(60 - now % 60 + 0.05)


@pytest.fixture
def clock(monkeypatch) -> MovedClock:
    return MovedClock(monkeypatch)
