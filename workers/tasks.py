"""Celery tasks. Each takes ids, never objects, and checks state before acting (safe on redelivery)."""

from workers.celery_app import app


@app.task(name="workers.generate", ignore_result=True, hands_off=True)
def generate(request_id: str) -> None:
    """Run one inference request on this worker's engine.

    Requires: req:<rid>:in in Redis (written by the gateway). If the gateway already took the
    request back (gave up waiting), the input is gone and this does nothing.
    Results: token events on req:<rid>:ev, then one usage entry in ledger:pending.
    The task holds its slot in the worker's pool until the request's end; in a model worker's
    `RequestPool` it holds no thread meanwhile (``hands_off``, workers/requestpool.py).
    """
    from workers.serving import runtime

    runtime().run_request(request_id)
