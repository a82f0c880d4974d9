"""The platform's side of kombu's Redis transport: a transport that takes waves of tasks and keeps
one client object per channel (the task message the gateway pushes itself is contract/task.py's).

``Transport``: kombu's Redis transport with two changes.

- **A wave of tasks in one round trip.** kombu's consumer takes one message per ``BRPOP``, on the
  worker's consumer thread: a wave of 256 requests (a level of clients that ended together) is
  256 round trips in a row, each waiting for the interpreter lock beside the engine's output
  handling, and the last request of the wave reaches the engine that much later. A GPU worker
  (``take_waves``) follows each ``BRPOP`` that delivered a message with one ``RPOP <queue> <n>``
  for the rest of the wave, ``n`` being its free task slots, so it never holds more than it can run
  (the point of ``worker_disable_prefetch``: a busy worker leaves the queue to the others).
  ``RPOP`` with a count needs Redis 6.2, the platform's minimum. A lone message costs one ``RPOP``
  that finds nothing. On an H200 (docs/gpu.md) the waves were real (1-17 more tasks
  after 206 of 320 ``BRPOP``s) but the hop did not shrink beyond the spread between calls: most of
  it is Celery's own work per message and the engine loop's backlog, not the round trips.
- **One client per channel.** kombu builds a new ``redis.Redis`` around its connection pool for
  every message it publishes (``Channel.conn_or_acquire`` → ``_create_client``); redis-py 8's
  client constructor is heavy enough to be ~18% of Celery's ``send_task`` (profiled in
  docs/benchmarks.md). The client is a thin, thread-safe handle on the same pool, so one per
  channel serves every publish (beat's periodic tasks); connections, retries and the consumer's
  asynchronous client are kombu's own, unchanged.
Selected by ``broker_transport`` in workers/celery_app.py.
"""

from collections.abc import Callable
from queue import Empty

from kombu.transport import redis as kombu_redis
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads


class Channel(kombu_redis.Channel):
    _sync_client = None
    # How many more tasks this process may take now; None: one per BRPOP, as kombu does (take_waves).
    free_slots: Callable[[], int] | None = None

    def _brpop_read(self, **options):
        if self.free_slots is None:
            return super()._brpop_read(**options)
        # kombu 5.7's own _brpop_read, which drops the name of the queue it delivered from ...
        try:
            try:
                dest__item = self.client.parse_response(self.client.connection, "BRPOP", **options)
            except self.connection_errors:
                self.client.connection.disconnect()  # reconnects on the next BRPOP
                raise
            if not dest__item:
                raise Empty()
            dest, item = dest__item
            queue = bytes_to_str(dest).rsplit(self.sep, 1)[0]
            self._queue_cycle.rotate(queue)
            self.connection._deliver(loads(bytes_to_str(item)), queue)
        finally:
            self._in_poll = None
            self._flush_brpop_reauth()
        # ... then the rest of the wave.
        self._take_rest_of_wave(queue)
        return True

    def _take_rest_of_wave(self, queue: str) -> None:
        """Deliver up to ``free_slots()`` more messages of ``queue``'s list (its default priority) in
        one round trip, in the order ``BRPOP`` would have taken them."""
        free = self.free_slots() if self.free_slots is not None else 0
        if free <= 0 or self.global_keyprefix:  # kombu's key prefixing knows BRPOP's keys, not RPOP's
            return
        with self.conn_or_acquire() as client:
            items = client.rpop(self._q_for_pri(queue, 0), free)
        for item in items or ():
            self.connection._deliver(loads(bytes_to_str(item)), queue)

    def _create_client(self, asynchronous=False):
        if asynchronous:
            return super()._create_client(asynchronous=True)
        if self._sync_client is None:
            self._sync_client = super()._create_client()
        return self._sync_client


class Transport(kombu_redis.Transport):
    Channel = Channel


def take_waves(free_slots: Callable[[], int]) -> None:
    """Make this process's consumer take up to ``free_slots()`` waiting tasks per round trip (see above)."""
    Channel.free_slots = staticmethod(free_slots)

