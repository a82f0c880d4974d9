"""The gateway pushes its inference tasks itself (workers/broker.py `task_message`): what it pushes
must be what Celery's own `send_task` pushes, so that a Celery worker runs it the same way."""

import json

from workers.broker import task_message
from workers.celery_app import app

QUEUE = "pool.broker-test"


def _pushed_by_send_task(redis_client) -> dict:
    app.send_task("workers.generate", args=["cmpl-1"], queue=QUEUE, task_id="cmpl-1", expires=30.0)
    (raw,) = redis_client.lrange(QUEUE, 0, -1)
    redis_client.delete(QUEUE)
    return json.loads(raw)


def _without_per_call_fields(message: dict) -> dict:
    """The message less what differs between two sends of the same task: its expiry time (from the
    clock) and kombu's delivery tag (a new uuid per message)."""
    message = json.loads(json.dumps(message))
    assert message["headers"].pop("expires")
    assert message["properties"].pop("delivery_tag")
    return message


def test_the_gateways_task_message_is_the_one_send_task_pushes(redis_client):
    ours = json.loads(
        task_message(app, "workers.generate", task_id="cmpl-1", args=["cmpl-1"], queue=QUEUE, expires=30.0)
    )
    celerys = _pushed_by_send_task(redis_client)
    assert _without_per_call_fields(ours) == _without_per_call_fields(celerys)
    assert ours["properties"]["delivery_tag"] != celerys["properties"]["delivery_tag"]


def test_each_message_has_its_own_delivery_tag():
    first, second = (
        json.loads(task_message(app, "workers.generate", task_id=rid, args=[rid], queue=QUEUE, expires=30.0))
        for rid in ("cmpl-1", "cmpl-2")
    )
    assert first["properties"]["delivery_tag"] != second["properties"]["delivery_tag"]
    assert first["headers"]["id"] == "cmpl-1" and second["headers"]["id"] == "cmpl-2"
