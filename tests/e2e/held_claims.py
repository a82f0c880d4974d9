"""The stack's Celery worker, except that it holds every request it claims and never starts it.

A test double for the window between a worker's claim of a request (`workers.claims.claim_requests`
takes its input and records the claimer) and the request's start entry: run with
``celery -A tests.e2e.held_claims worker ...`` (``Stack.start_worker(app=...)``). Each claim it
makes is announced in Redis (HELD_KEY, a set of request ids) and the claim then waits, on the
engine's loop, until the process is killed, so a test can kill the worker exactly inside that
window, found by state.

The claim is replaced only in a worker process (``worker_init``): a test process that imports this
module for HELD_KEY keeps the real one.
"""

import asyncio

from celery.signals import worker_init

from workers import claims
from workers.worker import app  # noqa: F401  (the worker's application, which celery -A loads)

HELD_KEY = "test:held-claims"

_claim = claims.claim_requests


async def _claim_and_hold(client, rids: list[str], worker: str) -> list[str | None]:
    inputs = await _claim(client, rids, worker)
    held = [rid for rid, raw in zip(rids, inputs, strict=True) if raw is not None]
    if held:
        await client.sadd(HELD_KEY, *held)
        await asyncio.Event().wait()  # held: never started, until the process is killed
    return inputs


@worker_init.connect
def _hold_claims(**kwargs) -> None:
    claims.claim_requests = _claim_and_hold
