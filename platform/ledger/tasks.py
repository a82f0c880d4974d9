"""The ledger's periodic task (Celery, `control` queue; beat runs it every 5 s)."""

from celery import shared_task

from ledger.services import ledger_flush as flush


# The task's name predates this module: queued messages and the beat schedule name it.
@shared_task(name="ledger.flush", ignore_result=True)
def ledger_flush() -> int:
    """Drain buffered usage from Redis into the PostgreSQL ledger, settling each batch's quotas first
    (`ledger.services.pending_flushing`); idempotent."""
    return flush()
