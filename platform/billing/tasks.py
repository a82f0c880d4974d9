"""Periodic billing tasks (Celery, `control` queue). Both are idempotent: safe to run twice."""

import datetime as dt

from celery import shared_task
from django.utils import timezone

from billing.services import invoices_close_period, rollup_refresh
from core.periods import Period


@shared_task(name="billing.rollup", ignore_result=True)
def billing_rollup() -> int:
    """Recompute the hourly and daily rollups of buckets that received ledger rows since the last run."""
    return rollup_refresh()


@shared_task(name="billing.close_invoices", ignore_result=True)
def billing_close_invoices(grace_hours: int = 1) -> int:
    """Close last month's invoices once the month has been over for `grace_hours` (late ledger rows land first)."""
    now = timezone.now()
    last_month = Period.current().previous()
    if now < last_month.end + dt.timedelta(hours=grace_hours):
        return 0
    return invoices_close_period(period=last_month)
