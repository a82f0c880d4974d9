"""The Celery task message of an inference request, which the gateway pushes itself and a worker's
Celery consumes.

``task_message``: the gateway sends one Celery task per inference request; it builds the message
with Celery and pushes it in the same MULTI/EXEC as the request's input (gateway/dispatch.py
``enqueue``) instead of through ``send_task``, whose producer machinery cost ~0.5 ms of CPU and a
round trip of its own per request. The headers Celery derives from its configuration per message
(argument reprs, sender) are handed in ready, and the message has no expiry (the request's input
expires instead, gateway/dispatch.py): 20 µs per message, against 70 for Celery's own.
"""

import base64
import functools
import json
import os
import uuid

from celery.utils.nodenames import anon_nodename


@functools.cache
def _origin(pid: int) -> str:
    """The sender's name Celery puts in a task's headers (it names the process: one per pid)."""
    return anon_nodename()


def task_message(app, name: str, *, task_id: str, args: list, queue: str) -> str:
    """The message ``app.send_task(name, args=args, task_id=task_id, queue=queue)`` would push onto
    ``queue``'s list, to push in a pipeline of the caller's (``LPUSH queue message``).

    The task part (headers, body) is Celery's own (``amqp.as_task_v2``); the envelope is the one kombu's
    virtual transport wraps it in for Redis (``Channel.prepare_message`` and ``basic_publish`` for the
    default exchange; priority 0 is the queue's own list). ``send_task`` costs ~6x as much CPU
    (its producer pool, retry wrapper, routing and a round trip of its own, ~0.5 ms), once per
    inference request on the gateway's hot path. tests/workers/test_broker.py holds this equal to
    what ``send_task`` pushes. No expiry: the request's input expires instead (gateway/dispatch.py).
    """
    # ignore_result None, as send_task sends it: the task's own setting applies. The headers that
    # Celery would derive through a configuration lookup each (the argument reprs, the sender's
    # name) come from cheaper sources, the same values: a task's args are ids (workers/tasks.py),
    # short enough that Celery's saferepr is their repr.
    message = app.amqp.as_task_v2(
        task_id, name, args=args, reply_to=app.thread_oid, ignore_result=None, argsrepr=repr(args),
        kwargsrepr="{}", origin=_origin(os.getpid()),
    )  # fmt: skip
    body = base64.b64encode(json.dumps(message.body).encode()).decode()
    properties = dict(
        message.properties,
        delivery_mode=2,
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
