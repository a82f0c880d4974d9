"""The gateway's fast path into the ledger: the rows of finished requests, written in batches.

When a request ends, its quota reservation is settled already (by its worker, in the write that
carried its end: the tenant's concurrency slot and budget come back before the response ends), and
its request id is handed to a thread of the web process that writes the ledger rows of every
request that ended in the last `LEDGER_BATCH_SECONDS` with one INSERT: one INSERT and commit per
response cost ~15% of the gateway's CPU samples at 32 streams, and a commit's wait before the
stream closed.

Nothing is lost when the process dies before a batch is written: the usage entries stay in
Redis (`ledger:pending`) until written, and the periodic flush (beat, every 5 s) writes them.
"""

import logging
import os
import threading
import time

from django import db
from django.conf import settings

from ledger.services import ledger_flush

log = logging.getLogger(__name__)


class _BatchWriter:
    """Collects request ids and writes their ledger rows from one thread per process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: list[str] = []
        self._pid: int | None = None  # the process the thread runs in (gunicorn forks after import)

    def add(self, request_id: str) -> None:
        with self._lock:
            if self._pid != os.getpid():
                self._pid, self._ids = os.getpid(), []
                interval = settings.LEDGER_BATCH_SECONDS  # read once: a later 0 must not make it spin
                threading.Thread(target=self._run, args=(interval,), name="ledger-writer", daemon=True).start()
            self._ids.append(request_id)

    def _run(self, interval: float) -> None:
        while True:
            time.sleep(interval)
            with self._lock:
                batch, self._ids = self._ids, []
            if batch:
                self._write(batch)

    @staticmethod
    def _write(batch: list[str]) -> None:
        try:
            # Their workers settled them already: the settle this flush announces is a no-op for
            # them (one pipelined call per batch); entries it cannot write stay pending for the periodic flush.
            ledger_flush(request_ids=batch)
        except Exception:
            log.exception("ledger batch of %d failed; the periodic flush will write it", len(batch))
        finally:
            db.connection.close()  # back to the pool between batches


_writer = _BatchWriter()


def ledger_write_soon(request_id: str) -> None:
    """Write the request's pending usage entry into the ledger with the next batch."""
    _writer.add(request_id)
