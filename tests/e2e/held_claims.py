"""The stack's Celery worker, except that it holds every request it claims and never starts it.

A test double for the window between a worker's claim of a request (`workers.serving.claim_request`
takes its input and records the claimer) and the request's start entry: run with
``celery -A tests.e2e.held_claims worker ...`` (``Stack.start_worker(app=...)``). Each claim it
makes is announced in Redis (HELD_KEY, a set of request ids) and its task thread then waits until
the process is killed, so a test can kill the worker exactly inside that window, found by state.

The claim is replaced only in a worker process (``worker_init``): a test process that imports this
module for HELD_KEY keeps the real one.
"""

import threading

from celery.signals import worker_init

from workers import serving
from workers.worker import app  # noqa: F401  (the worker's application, which celery -A loads)

HELD_KEY = "test:held-claims"

_claim = serving.claim_request


def _claim_and_hold(client, rid: str, worker: str) -> str | None:
    raw = _claim(client, rid, worker)
    if raw is not None:
        client.sadd(HELD_KEY, rid)
        threading.Event().wait()  # held: never started, until the process is killed
    return raw


@worker_init.connect
def _hold_claims(**kwargs) -> None:
    serving.claim_request = _claim_and_hold
