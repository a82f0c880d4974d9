"""The gateway pushes its inference tasks itself (contract/task.py `task_message`): what it pushes
must be what Celery's own `send_task` pushes, so that a Celery worker runs it the same way."""

import json
import os

import redis
from kombu import Connection, Consumer, Queue

from contract.task import task_message
from workers.broker import Channel, Transport
from workers.celery_app import app

QUEUE = "pool.broker-test"


def _pushed_by_send_task(redis_client) -> dict:
    app.send_task("workers.generate", args=["cmpl-1"], queue=QUEUE, task_id="cmpl-1")
    (raw,) = redis_client.lrange(QUEUE, 0, -1)
    redis_client.delete(QUEUE)
    return json.loads(raw)


def _without_per_call_fields(message: dict) -> dict:
    """The message less what differs between two sends of the same task: kombu's delivery tag (a new
    uuid per message)."""
    message = json.loads(json.dumps(message))
    assert message["properties"].pop("delivery_tag")
    return message


def test_the_gateways_task_message_is_the_one_send_task_pushes(redis_client):
    ours = json.loads(task_message(app, "workers.generate", task_id="cmpl-1", args=["cmpl-1"], queue=QUEUE))
    celerys = _pushed_by_send_task(redis_client)
    assert _without_per_call_fields(ours) == _without_per_call_fields(celerys)
    assert ours["properties"]["delivery_tag"] != celerys["properties"]["delivery_tag"]
    # No expiry for Celery to parse per message: the request's input expires (gateway/dispatch.py).
    assert ours["headers"]["expires"] is None


def test_each_message_has_its_own_delivery_tag():
    first, second = (
        json.loads(task_message(app, "workers.generate", task_id=rid, args=[rid], queue=QUEUE))
        for rid in ("cmpl-1", "cmpl-2")
    )
    assert first["properties"]["delivery_tag"] != second["properties"]["delivery_tag"]
    assert first["headers"]["id"] == "cmpl-1" and second["headers"]["id"] == "cmpl-2"


def _consume(slots: int | None, monkeypatch, waiting: int, drains: int) -> tuple[list[list[str]], int]:
    """Push ``waiting`` tasks, then let a consumer on the platform's transport drain events ``drains``
    times, as a worker with ``slots`` task slots (None: kombu's own one message per BRPOP); the task
    ids each drain delivered, and the tasks left in the queue."""
    delivered: list[str] = []
    # What serving.py hands in: the slots less the tasks this worker holds, counted as each arrives.
    free_slots = None if slots is None else staticmethod(lambda: slots - len(delivered))
    monkeypatch.setattr(Channel, "free_slots", free_slots)
    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    client.delete(QUEUE)
    for index in range(waiting):
        rid = f"cmpl-{index}"
        client.lpush(QUEUE, task_message(app, "workers.generate", task_id=rid, args=[rid], queue=QUEUE))
    per_drain: list[list[str]] = []
    with Connection(os.environ["REDIS_URL"], transport=Transport, transport_options={"ack_emulation": False}) as conn:
        with Consumer(conn, queues=[Queue(QUEUE)], accept=["json"], no_ack=True,
                      on_message=lambda message: delivered.append(message.headers["id"])):  # fmt: skip
            for _ in range(drains):
                before = len(delivered)
                conn.drain_events(timeout=10)
                per_drain.append(delivered[before:])
    left = client.llen(QUEUE)
    client.delete(QUEUE)
    return per_drain, left


def test_kombus_own_consumer_takes_one_waiting_task_per_round_trip(monkeypatch):
    per_drain, left = _consume(None, monkeypatch, waiting=6, drains=2)
    assert per_drain == [["cmpl-0"], ["cmpl-1"]] and left == 4


def test_a_gpu_worker_takes_a_wave_of_waiting_tasks_in_one_round_trip_up_to_its_free_slots(monkeypatch):
    # The BRPOP's message, then its 3 free slots in one RPOP, in the queue's order: no more than it can run.
    per_drain, left = _consume(4, monkeypatch, waiting=10, drains=1)
    assert per_drain == [["cmpl-0", "cmpl-1", "cmpl-2", "cmpl-3"]] and left == 6
    # Fewer waiting than free slots: all of them.
    per_drain, left = _consume(8, monkeypatch, waiting=3, drains=1)
    assert per_drain == [["cmpl-0", "cmpl-1", "cmpl-2"]] and left == 0
    # One slot: the BRPOP's message alone (with none free Celery sends no BRPOP at all, see
    # celery/worker/consumer/tasks.py, disable_prefetch).
    per_drain, left = _consume(1, monkeypatch, waiting=3, drains=2)
    assert per_drain == [["cmpl-0"], ["cmpl-1"]] and left == 1
