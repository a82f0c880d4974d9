"""Time spans of the platform, all in UTC: the billing period (a calendar month) and bucket truncation.

Admission's token budget, the ledger's monthly usage, invoices, the management API's usage range and
the console's limit and invoice pages all use `Period`; usage charts cut time with `truncate`.
"""

import datetime as dt
from dataclasses import dataclass

UNITS = ("minute", "hour", "day")


def truncate(moment: dt.datetime, unit: str) -> dt.datetime:
    """The start, in UTC, of the minute, hour or day that holds `moment`."""
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {UNITS}, got {unit!r}")
    moment = moment.astimezone(dt.UTC).replace(second=0, microsecond=0)
    if unit in ("hour", "day"):
        moment = moment.replace(minute=0)
    if unit == "day":
        moment = moment.replace(hour=0)
    return moment


@dataclass(frozen=True)
class Period:
    """A billing period: a calendar month in UTC, [start, end)."""

    start: dt.datetime
    end: dt.datetime

    @property
    def id(self) -> str:
        return self.start.strftime("%Y-%m")

    @classmethod
    def containing(cls, when: dt.datetime) -> "Period":
        start = truncate(when, "day").replace(day=1)
        end = (start + dt.timedelta(days=32)).replace(day=1)
        return cls(start, end)

    @classmethod
    def parse(cls, period_id: str) -> "Period":
        """'2026-11' → that month; ValueError for anything else."""
        start = dt.datetime.strptime(period_id, "%Y-%m").replace(tzinfo=dt.UTC)
        return cls.containing(start)

    @classmethod
    def current(cls) -> "Period":
        return cls.containing(dt.datetime.now(dt.UTC))

    def previous(self) -> "Period":
        return Period.containing(self.start - dt.timedelta(days=1))
