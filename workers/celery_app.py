"""The Celery application shared by the gateway (producer), the GPU workers and beat.

This module is all a web process imports to send tasks. Worker processes load ``workers.worker``
(``celery -A workers.worker worker``), which adds the worker runtime (engine, heartbeat, drain).

Queues: `pool.<pool>` per model pool (inference, consumed by GPU workers) and `control`
(bookkeeping such as the periodic ledger flush). Interactive inference runs at most once:
tasks are acknowledged on receipt (acks_late off), so a lost worker's request is never replayed by
Celery; the gateway notices the worker is gone and continues the request on another worker from
the tokens its client already has (gateway/dispatch.py).
"""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

app = Celery(
    "gemma_platform", include=["workers.tasks", "ledger.tasks", "quotas.tasks", "billing.tasks", "gateway.tasks"]
)
app.config_from_object("django.conf:settings", namespace="CELERY")
app.conf.update(
    task_acks_late=False,
    # One task at a time per execution slot: a slot's concurrency is already the engine's batching;
    # prefetching more would hide a backlog from other workers of the pool and from fair share.
    worker_prefetch_multiplier=1,
    # Tasks are acknowledged on receipt, which frees their prefetch slot at once: without this a
    # worker whose every slot runs a request would still take more from the queue and hold them
    # behind its own requests while another worker of the pool is idle.
    worker_disable_prefetch=True,
    task_default_queue="control",
    task_serializer="json",
    accept_content=["json"],
    # No ack emulation: kombu's Redis transport would otherwise record every message it hands out
    # in an "unacked" hash and delete it again on the ack, two round trips per task and most of
    # the consumer's own work per message (docs/benchmarks.md), only to redeliver a message whose
    # worker died before acknowledging it. Tasks are acknowledged on receipt, and the gateway
    # already ends a request no worker starts (gateway/dispatch.py), so nothing here wants a
    # redelivery.
    broker_transport_options={"ack_emulation": False},
    # kombu's Redis transport, reusing one client per channel for publishing (workers/broker.py).
    broker_transport="workers.broker:Transport",
    worker_hijack_root_logger=False,
    beat_schedule={
        "ledger-flush": {"task": "ledger.flush", "schedule": 5.0, "options": {"queue": "control", "expires": 30}},
        "quotas-reap": {"task": "quotas.reap", "schedule": 60.0, "options": {"queue": "control", "expires": 60}},
        "routing-reap": {"task": "routing.reap", "schedule": 60.0, "options": {"queue": "control", "expires": 60}},
        "billing-rollup": {"task": "billing.rollup", "schedule": 60.0, "options": {"queue": "control", "expires": 60}},
        "billing-close-invoices": {
            "task": "billing.close_invoices",
            "schedule": 3600.0,
            "options": {"queue": "control", "expires": 600},
        },
    },
)
