"""Periodic quota bookkeeping (Celery, `control` queue)."""

from celery import shared_task

from quotas.settlement import reservations_reap


@shared_task(name="quotas.reap", ignore_result=True)
def quota_reap(limit: int = 1000) -> int:
    """Settle reservations that outlived their hold (quotas.settlement.reservations_reap)."""
    return reservations_reap(limit=limit)
