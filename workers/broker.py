"""The platform's side of kombu's Redis transport: the task message the gateway pushes itself, and
a transport with one client object per channel.

``task_message``: the gateway sends one Celery task per inference request; it builds the message
with Celery and pushes it in the same MULTI/EXEC as the request's input (gateway/dispatch.py
``enqueue``) instead of through ``send_task``, whose producer machinery cost ~0.5 ms of CPU and a
round trip of its own per request.

``Transport``: kombu builds a new ``redis.Redis`` around its connection pool for every message it
publishes (``Channel.conn_or_acquire`` → ``_create_client``); redis-py 8's client constructor is
heavy enough to be ~18% of Celery's ``send_task`` (profiled in docs/benchmarks.md). The client is a
thin, thread-safe handle on the same pool, so one per channel serves every publish (beat's periodic
tasks); connections, retries and the consumer's asynchronous client are kombu's own, unchanged.
Selected by ``broker_transport`` in workers/celery_app.py.
"""

import base64
import json
import uuid

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


def task_message(app, name: str, *, task_id: str, args: list, queue: str, expires: float) -> str:
    """The message ``app.send_task(name, args=args, task_id=task_id, queue=queue, expires=expires)``
    would push onto ``queue``'s list, to push in a pipeline of the caller's (``LPUSH queue message``).

    The task part (headers, body) is Celery's own (``amqp.as_task_v2``); the envelope is the one kombu's
    virtual transport wraps it in for Redis (``Channel.prepare_message`` and ``basic_publish`` for the
    default exchange; priority 0 is the queue's own list). ``send_task`` costs ~6x as much CPU
    (its producer pool, retry wrapper, routing and a round trip of its own, ~0.5 ms), once per
    inference request on the gateway's hot path. tests/workers/test_broker.py holds this equal to
    what ``send_task`` pushes.
    """
    # ignore_result None, as send_task sends it: the task's own setting applies.
    message = app.amqp.as_task_v2(
        task_id, name, args=args, expires=expires, reply_to=app.thread_oid, ignore_result=None
    )
    body = base64.b64encode(json.dumps(message.body).encode()).decode()
    properties = dict(
        message.properties,
        delivery_mode=2,
        expiration=str(int(expires * 1000)),
        delivery_info={"exchange": "", "routing_key": queue},
        priority=0,
        body_encoding="base64",
        delivery_tag=str(uuid.uuid4()),
    )
    envelope = {
        "body": body,
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": message.headers,
        "properties": properties,
    }
    return json.dumps(envelope)
