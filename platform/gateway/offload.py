"""The blocking steps of the async inference path (ORM, sync Redis, tokenization), run off the event loop.

They run on a thread pool of the gateway's own, sized by GATEWAY_THREADS, not on asgiref's
thread-sensitive thread (one per process, shared by every sync view and middleware) nor on the
event loop's default executor (a handful of threads). A thread is held only while such a step runs
(authentication to enqueue, a ledger write), never while a stream is relayed.
"""

import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

from asgiref.sync import sync_to_async
from django import db
from django.conf import settings

P = ParamSpec("P")
R = TypeVar("R")


@functools.cache
def _executor() -> ThreadPoolExecutor:
    # Created on first use, in the serving process (after gunicorn's fork); threads start on demand.
    return ThreadPoolExecutor(max_workers=settings.GATEWAY_THREADS, thread_name_prefix="gateway")


def _releasing_connection(func: Callable[P, R]) -> Callable[P, R]:
    @functools.wraps(func)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return func(*args, **kwargs)
        finally:
            # Given back (to the pool) at the end of every call, never kept by an idle thread:
            # Django's request_finished, which would do it, does not run in this thread.
            db.connection.close()

    return run


async def run_blocking(func: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
    """Run `func(*args, **kwargs)` on a gateway thread; return its result or raise its exception.

    The thread's database connection is given back when `func` ends.
    """
    call = sync_to_async(_releasing_connection(func), thread_sensitive=False, executor=_executor())
    return await call(*args, **kwargs)
