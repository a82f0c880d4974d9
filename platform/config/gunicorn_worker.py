"""gunicorn's threaded worker, made to take a new connection only when one of its threads is free.

The web processes share one listening socket, and a stock ``gthread`` process accepts connections
up to ``worker_connections`` (1000) whatever its threads are doing: a connection it accepts while
all its threads relay streams waits in its thread pool's queue, for as long as a stream lasts
(seconds to minutes), even when another process has idle threads. On the H200 bench this held 5 of
128 streams back by a whole generation (~4 s) and cut the platform to 0.73 of the bare engine.

Here a process stops accepting while every thread is busy with a request, so the kernel hands the
connection to a process that can serve it at once. Idle keep-alive connections do not count: they
hold no thread. ``worker_connections`` still caps all connections of a process.
"""

from gunicorn.workers.gthread import ThreadWorker


class StreamingThreadWorker(ThreadWorker):
    @property
    def worker_connections(self) -> int:
        # gthread's run loop accepts while ``nr_conns < worker_connections``: answer a bound that
        # lets it accept only while a thread is free and the configured cap is not reached.
        idle = len(self.keepalived_conns) + len(self.pending_conns)
        busy = self.nr_conns - idle
        if busy < self.cfg.threads and self.nr_conns < self.cfg.worker_connections:
            return self.nr_conns + 1
        return self.nr_conns

    @worker_connections.setter
    def worker_connections(self, value: int) -> None:
        pass  # ThreadWorker.__init__ assigns the configured cap; it is read from cfg instead
