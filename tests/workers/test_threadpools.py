"""A thread pool's threads are all started before it takes work (workers/threadpools.py)."""

import threading
from concurrent.futures import ThreadPoolExecutor

from workers.threadpools import prestart_threads


def test_every_thread_is_started_and_idle_afterwards():
    executor = ThreadPoolExecutor(max_workers=16)
    try:
        prestart_threads(executor, 16)
        assert len(executor._threads) == 16
        # All idle: 16 tasks that wait for each other all run at once, and no thread is added.
        barrier = threading.Barrier(16)
        assert all(f.result(timeout=10) is not None for f in [executor.submit(barrier.wait, 10) for _ in range(16)])
        assert len(executor._threads) == 16
    finally:
        executor.shutdown()


def test_nothing_to_start():
    executor = ThreadPoolExecutor(max_workers=4)
    prestart_threads(executor, 0)
    assert len(executor._threads) == 0
    executor.shutdown()
