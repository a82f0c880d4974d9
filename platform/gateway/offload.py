"""The blocking steps of the async inference path (ORM, sync Redis, tokenization), run off the event loop.

They run on a thread pool of the gateway's own, sized by GATEWAY_THREADS, not on asgiref's
thread-sensitive thread (one per process, shared by every sync view and middleware) nor on the
event loop's default executor (a handful of threads). A thread is held only while such a step runs
(authentication to enqueue, a ledger write), never while a stream is relayed.
"""

import asyncio
import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

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
    """Run `func(*args, **kwargs)` on a gateway thread, in a copy of the caller's context; return its
    result or raise its exception.

    The thread's database connection is given back when `func` ends. A plain executor call, not
    asgiref's `sync_to_async`: what that adds (thread-sensitive routing, its own context and
    deadlock bookkeeping) serves none of these calls, and was 5% of a web process's py-spy samples
    for 1-token requests (docs/benchmarks.md). Django's database connections are per thread either
    way.
    """
    call = functools.partial(_releasing_connection(func), *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(_executor(), contextvars.copy_context().run, call)
