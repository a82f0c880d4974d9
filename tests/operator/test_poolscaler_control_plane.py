"""The operator's control-plane client against the real control plane: Django's operator
endpoints (platform/gateway/ops_views.py) served by pytest-django's live server, on real
PostgreSQL and Redis. This pins the demand and drain contract that FakeControlPlane imitates."""

from __future__ import annotations

import asyncio
import time

import pytest
from django.conf import settings
from poolscaler import ControlPlane, ControlPlaneError

from catalog.models import ServedModel
from contract import protocol

pytestmark = pytest.mark.django_db(transaction=True)  # the live server thread must see the rows


@pytest.fixture
def tiny_pool(redis_client):
    """Pool "tiny" in the catalog; in Redis one ready worker in pod-a with 2 streams, 3 queued
    tasks and 1 request held at the gateway."""
    ServedModel.objects.create(model_id="tiny-gemma", path="/models/tiny", pool="tiny", context_length=256)
    redis_client.zadd(protocol.pool_workers_key("tiny"), {"worker@pod-a": time.time()})
    redis_client.hset(
        protocol.worker_key("worker@pod-a"), mapping={"pod": "pod-a", "state": "ready", "in_flight": 2, "tps": 40.5}
    )
    redis_client.rpush(protocol.queue_name("tiny"), "task-1", "task-2", "task-3")
    redis_client.set(protocol.pool_waiting_key("tiny"), 1)
    return redis_client


def client(live_server, token: str | None = None) -> ControlPlane:
    return ControlPlane(base_url=live_server.url, token=token or settings.OPERATOR_TOKEN, timeout_seconds=5)


def test_the_demand_endpoint_answers_what_the_operator_reads(live_server, tiny_pool):
    demand = asyncio.run(client(live_server).demand("tiny"))
    assert (demand.queue_depth, demand.waiting, demand.in_flight) == (3, 1, 2)
    assert demand.tokens_per_second == 40.5
    assert demand.ready_workers == 1
    assert demand.in_flight_on("pod-a") == 2


def test_a_drain_and_its_cancellation_reach_the_workers_drain_set(live_server, tiny_pool):
    control_plane = client(live_server)
    asyncio.run(control_plane.drain("tiny", "pod-a"))
    assert tiny_pool.sismember(protocol.pool_drain_key("tiny"), "pod-a")
    asyncio.run(control_plane.cancel_drain("tiny", "pod-a"))
    assert not tiny_pool.sismember(protocol.pool_drain_key("tiny"), "pod-a")


def test_a_wrong_token_or_an_unknown_pool_is_an_error(live_server, tiny_pool):
    with pytest.raises(ControlPlaneError, match="401"):
        asyncio.run(client(live_server, token="not-the-operator-token").demand("tiny"))
    with pytest.raises(ControlPlaneError, match="No model is registered on pool 'nope'"):
        asyncio.run(client(live_server).demand("nope"))
