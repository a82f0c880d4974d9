"""kombu's Redis transport, with one client object per channel instead of one per publish.

kombu builds a new ``redis.Redis`` around its connection pool for every message it publishes
(``Channel.conn_or_acquire`` → ``_create_client``); redis-py 8's client constructor is heavy enough
to be ~18% of Celery's ``send_task`` on the gateway's hot path (one publish per inference request;
profiled in docs/benchmarks.md). The client is a thin, thread-safe handle on the same pool, so one
per channel serves every publish; connections, retries and the consumer's asynchronous client are
kombu's own, unchanged. Selected by ``broker_transport`` in workers/celery_app.py.
"""

from kombu.transport import redis as kombu_redis


class Channel(kombu_redis.Channel):
    _sync_client = None

    def _create_client(self, asynchronous=False):
        if asynchronous:
            return super()._create_client(asynchronous=True)
        if self._sync_client is None:
            self._sync_client = super()._create_client()
        return self._sync_client


class Transport(kombu_redis.Transport):
    Channel = Channel
