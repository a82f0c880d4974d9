"""Start a thread pool's threads before it takes work, not on the hot path.

``concurrent.futures.ThreadPoolExecutor`` starts a thread on a ``submit`` that finds none idle, and
holds a lock shared by every executor of the process (``_global_shutdown_lock``) until the new
thread has run. A py-spy dump during a burst of 32 requests caught the Celery worker's consumer
there, with vLLM's engine loop blocked on the same lock in its own executor's ``submit``: while a
new thread is slow to start (GIL and CPU contention on a small machine), the consumer takes no task
and no token moves for any request in flight. Starting the threads up front takes that off the path.
"""

import threading
from concurrent.futures import ThreadPoolExecutor

PRESTART_TIMEOUT_S = 120.0


def prestart_threads(executor: ThreadPoolExecutor, count: int) -> None:
    """Make ``executor`` start ``count`` threads now (it never stops them): one blocking task per
    thread, all released together once every one of them runs, so none could take two."""
    if count <= 0:
        return
    barrier = threading.Barrier(count + 1)
    for _ in range(count):
        executor.submit(_wait, barrier)
    _wait(barrier)


def _wait(barrier: threading.Barrier) -> None:
    try:
        barrier.wait(PRESTART_TIMEOUT_S)
    except threading.BrokenBarrierError:
        pass  # a thread that did not start in time will start on demand later, as without this
