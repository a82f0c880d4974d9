"""Celery's execution pool for a worker that serves a model: a task slot per request, no thread.

An inference request is one Celery task (`workers.generate`) from its receipt to its end: its slot
in the pool is what bounds the requests a worker runs at once, what the consumer counts before it
takes more from the queue (`worker_disable_prefetch`, workers/broker.py) and what a warm shutdown
waits for. Under Celery's threads pool each such task also held a thread for its whole life, doing
nothing but wait for the engine's loop to relay the request, and every request cost two hand-offs
between threads: the consumer waking a task thread, the loop waking it again at the end. Each of
those is a wait for the interpreter lock beside the engine's output handling, on the path of every
request (on 2 cores, `threading.Condition.notify` and `ThreadPoolExecutor.submit` were a third of
the worker's samples for 1-token requests).

`RequestPool` is the threads pool with one change: a task whose class sets `hands_off = True` runs
on the consumer's thread, where its body gives its work to the engine's loop and returns at once
(`hand_off`), and its slot is released (Celery's success callback) only when that work's future
completes, on the loop. Every other task (the control queue's bookkeeping, which blocks on
PostgreSQL) runs on the pool's threads as in the threads pool; a handful serve them. A worker started with
`--pool threads` that serves a model gets this pool (workers/serving.py), so deployments keep their
command line.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import Any

from celery.concurrency import thread
from celery.concurrency.base import apply_target

log = logging.getLogger(__name__)

# Threads for the tasks that do not hand off (control-queue bookkeeping a model worker may also
# consume): they block on PostgreSQL, and none of them is on a request's path.
BLOCKING_TASK_THREADS = 4

_handing_off = threading.local()


def hand_off(future: concurrent.futures.Future) -> bool:
    """Called by a task body that has given its work to another thread: under `RequestPool` the
    task's slot stays taken until `future` completes and the body may return at once (True);
    anywhere else (another pool, a direct call) the caller must wait itself (False)."""
    if not getattr(_handing_off, "open", False):
        return False
    _handing_off.future = future
    return True


class RequestPool(thread.TaskPool):
    """Celery's threads pool, less a thread per task that hands its work off (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.executor.shutdown(wait=False)
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=min(self.limit, BLOCKING_TASK_THREADS))
        self._handed_off: set[concurrent.futures.Future] = set()
        self._handed_off_lock = threading.Lock()

    def on_apply(
        self,
        target: Callable[..., Any],
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
        callback: Callable[..., Any] | None = None,
        accept_callback: Callable[..., Any] | None = None,
        **options: Any,
    ) -> thread.ApplyResult:
        # Celery's tracers take the task's name first (Request.execute_using_pool).
        if not args or not getattr(self.app.tasks.get(args[0]), "hands_off", False):
            return super().on_apply(target, args, kwargs, callback, accept_callback, **options)
        ended: concurrent.futures.Future = concurrent.futures.Future()

        def traced(result: Any) -> None:
            handed_off, _handing_off.future = getattr(_handing_off, "future", None), None
            if handed_off is None:  # the body failed, or did its work itself
                self._end(ended, callback, result)
                return
            with self._handed_off_lock:
                self._handed_off.add(ended)
            handed_off.add_done_callback(lambda work: self._end_handed_off(ended, callback, result, work))

        _handing_off.open, _handing_off.future = True, None
        try:
            apply_target(target, args, kwargs, traced, accept_callback)
        finally:
            _handing_off.open = False
        return thread.ApplyResult(ended)

    def _end_handed_off(self, ended, callback, result: Any, work: concurrent.futures.Future) -> None:
        """The handed-off work completed (on the thread that completed it: the engine's loop)."""
        if not work.cancelled() and work.exception() is not None:
            # The task itself has already returned: what failed after the hand-off is logged here.
            log.error("a handed-off task failed after its hand-off", exc_info=work.exception())
        with self._handed_off_lock:
            self._handed_off.discard(ended)
        self._end(ended, callback, result)

    @staticmethod
    def _end(ended: concurrent.futures.Future, callback, result: Any) -> None:
        try:
            if callback is not None:
                callback(result)  # Celery's Request.on_success: frees the task's slot
        finally:
            ended.set_result(result)

    def on_stop(self) -> None:
        """A warm shutdown waits for the handed-off tasks too, as the threads pool does for its threads."""
        with self._handed_off_lock:
            pending = list(self._handed_off)
        concurrent.futures.wait(pending)
        super().on_stop()

    def _get_info(self) -> dict:
        info = super()._get_info()
        with self._handed_off_lock:
            info["handed-off"] = len(self._handed_off)
        return info
