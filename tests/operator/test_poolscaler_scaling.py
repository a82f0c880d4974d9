"""The pool scaler's pure decisions (deploy/operator/scaling.py): spec and demand parsing, the
desired replica count, and the scale-up / cooldown / drain / scale-down plan."""

from __future__ import annotations

import dataclasses

import pytest
from scaling import (
    Demand,
    DemandFormatError,
    InvalidSpecError,
    PodView,
    PoolSpec,
    PoolState,
    Worker,
    desired_replicas,
    format_time,
    parse_time,
    plan,
    spare_replicas,
)

NOW = 1_800_000_000.0
SPEC = PoolSpec(
    model="google/gemma-4-E4B-it",
    pool="tiny",
    gpu_kind="a10g",
    worker_deployment="gemma-worker-tiny",
    min_replicas=1,
    max_replicas=6,
    target_queue_wait_seconds=2.0,
    scale_down_cooldown_seconds=60.0,
    drain_timeout_seconds=120.0,
)


def demand(*, workers: dict[str, int] | None = None, starting: tuple[str, ...] = (), **fields) -> Demand:
    listed = [Worker(name=f"worker@{pod}", pod=pod, in_flight=n, state="ready") for pod, n in (workers or {}).items()]
    listed += [Worker(name=f"worker@{pod}", pod=pod, in_flight=0, state="starting") for pod in starting]
    fields.setdefault("in_flight", sum((workers or {}).values()))
    return Demand(workers=tuple(listed), **fields)


def pods(*names: str, not_ready: tuple[str, ...] = (), terminating: tuple[str, ...] = ()) -> list[PodView]:
    return [PodView(name=name, ready=name not in not_ready, terminating=name in terminating) for name in names]


def spec(**changes) -> PoolSpec:
    return dataclasses.replace(SPEC, **changes)


# ----------------------------------------------------------------------------------- spec parsing


def test_a_minimal_spec_gets_the_crd_defaults():
    parsed = PoolSpec.from_spec(
        {"model": "m", "pool": "tiny", "gpuKind": "a10g", "workerDeployment": "w", "maxReplicas": 3}
    )
    assert parsed.min_replicas == 1
    assert parsed.target_queue_wait_seconds == 5.0
    assert parsed.target_tokens_per_second_per_replica is None
    assert parsed.scale_down_cooldown_seconds == 300.0
    assert parsed.allow_scale_to_zero is False
    assert parsed.drain_timeout_seconds == 600.0


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"minReplicas": 4, "maxReplicas": 3}, "minReplicas must not exceed maxReplicas"),
        ({"minReplicas": 0}, "minReplicas may be 0 only when allowScaleToZero is true"),
        ({"maxReplicas": 0}, "maxReplicas must be >= 1"),
        ({"model": ""}, "model is required"),
        ({"maxReplicas": True}, "maxReplicas must be an integer"),
        ({"maxReplicas": None}, "maxReplicas is required"),
        ({"targetQueueWaitSeconds": 0}, "targetQueueWaitSeconds must be > 0"),
        ({"targetTokensPerSecondPerReplica": -5}, "targetTokensPerSecondPerReplica must be > 0"),
        ({"allowScaleToZero": "yes"}, "allowScaleToZero must be true or false"),
        ({"drainTimeoutSeconds": "10"}, "drainTimeoutSeconds must be a number"),
    ],
)
def test_an_invalid_spec_is_rejected_with_the_reason(changes, message):
    raw = {"model": "m", "pool": "tiny", "gpuKind": "a10g", "workerDeployment": "w", "maxReplicas": 3, **changes}
    with pytest.raises(InvalidSpecError, match=message):
        PoolSpec.from_spec(raw)


def test_min_zero_is_valid_with_scale_to_zero():
    raw = {"model": "m", "pool": "p", "gpuKind": "a10g", "workerDeployment": "w", "maxReplicas": 2}
    assert PoolSpec.from_spec({**raw, "minReplicas": 0, "allowScaleToZero": True}).min_replicas == 0


# --------------------------------------------------------------------------------- demand parsing


def test_the_demand_document_is_parsed():
    parsed = Demand.from_json(
        {
            "pool": "tiny",
            "queue_depth": 3,
            "waiting": 1,
            "in_flight": 5,
            "tokens_per_second": 123.4,
            "oldest_queued_wait_seconds": 1.2,
            "workers": [
                {"name": "worker@pod-a", "pod": "pod-a", "in_flight": 2, "state": "ready", "last_seen": 1.0},
                {"name": "worker@pod-b", "pod": "pod-b", "in_flight": 3, "state": "draining", "last_seen": 1.0},
            ],
        }
    )
    assert (parsed.queue_depth, parsed.waiting, parsed.in_flight, parsed.backlog) == (3, 1, 5, 4)
    assert parsed.ready_workers == 1
    assert parsed.in_flight_on("pod-b") == 3
    assert parsed.in_flight_on("pod-unknown") == 0
    assert parsed.summary(NOW)["tokensPerSecond"] == 123.4


@pytest.mark.parametrize(
    "payload",
    [[], "busy", {"queue_depth": "many"}, {"workers": [{"pod": "no-name"}]}, {"waiting": True}],
)
def test_a_malformed_demand_document_is_an_error(payload):
    with pytest.raises(DemandFormatError):
        Demand.from_json(payload)


# ------------------------------------------------------------------------------- desired replicas


def test_an_idle_pool_wants_its_minimum():
    assert desired_replicas(spec(min_replicas=2), demand(workers={"a": 0, "b": 0, "c": 0}), current=3) == 2


def test_an_idle_pool_wants_zero_when_scale_to_zero_is_allowed():
    assert desired_replicas(spec(min_replicas=0, allow_scale_to_zero=True), demand(), current=1) == 0


def test_streams_in_flight_keep_one_replica_even_with_scale_to_zero():
    scale_to_zero = spec(min_replicas=0, allow_scale_to_zero=True)
    assert desired_replicas(scale_to_zero, demand(workers={"a": 1}), current=1) == 1


def test_a_backlog_within_the_target_wait_holds_the_replicas():
    idle_enough = demand(workers={"a": 4, "b": 4, "c": 4}, queue_depth=2, oldest_queued_wait_seconds=1.0)
    assert desired_replicas(SPEC, idle_enough, current=3) == 3


def test_a_backlog_past_the_target_wait_is_spread_at_the_observed_concurrency():
    # Two ready workers hold 5 streams each; 10 more queued: 20 streams at 5 per replica.
    busy = demand(workers={"a": 5, "b": 5}, queue_depth=10, oldest_queued_wait_seconds=4.0)
    assert desired_replicas(SPEC, busy, current=2) == 4


def test_a_backlog_past_the_target_with_idle_ready_workers_adds_one_replica():
    stuck = demand(workers={"a": 0}, queue_depth=3, oldest_queued_wait_seconds=9.0)
    assert desired_replicas(SPEC, stuck, current=1) == 2


def test_requests_waiting_at_the_gateway_wake_a_pool_from_zero():
    scale_to_zero = spec(min_replicas=0, allow_scale_to_zero=True)
    assert desired_replicas(scale_to_zero, demand(waiting=1), current=0) == 1
    assert desired_replicas(scale_to_zero, demand(queue_depth=1), current=0) == 1


def test_replicas_still_starting_are_not_asked_for_twice():
    starting = demand(starting=("a", "b"), queue_depth=30, oldest_queued_wait_seconds=30.0)
    assert desired_replicas(SPEC, starting, current=2) == 2


def test_tokens_per_second_per_replica_sets_a_floor():
    per_replica = spec(target_tokens_per_second_per_replica=300.0)
    assert desired_replicas(per_replica, demand(workers={"a": 3}, tokens_per_second=1000.0), current=1) == 4
    assert desired_replicas(per_replica, demand(workers={"a": 3}, tokens_per_second=900.0), current=1) == 3


def test_the_desired_replicas_never_exceed_the_maximum():
    flood = demand(workers={"a": 1}, queue_depth=10_000, oldest_queued_wait_seconds=300.0)
    assert desired_replicas(SPEC, flood, current=1) == SPEC.max_replicas


# ------------------------------------------------------------------------------------------ plan


def test_it_scales_up_at_once():
    busy = demand(workers={"a": 5, "b": 5}, queue_depth=10, oldest_queued_wait_seconds=4.0)
    step = plan(spec=SPEC, demand=busy, current=2, pods=pods("a", "b"), state=PoolState(), now=NOW)
    assert step.replicas == 4
    assert step.state.last_scale_time == NOW
    assert step.state.demand_peak_time == NOW
    assert step.start_drain == step.cancel_drain == ()


def test_a_first_reading_starts_the_cooldown_instead_of_scaling_down():
    step = plan(
        spec=SPEC, demand=demand(workers={"a": 0, "b": 0}), current=2, pods=pods("a", "b"), state=PoolState(), now=NOW
    )
    assert step.replicas is None
    assert step.start_drain == ()
    assert step.state.demand_peak_time == NOW
    assert step.reason.startswith("cooldown")


def test_it_holds_during_the_cooldown_after_the_last_scale():
    state = PoolState(last_scale_time=NOW - 30, demand_peak_time=NOW - 300)
    step = plan(
        spec=SPEC, demand=demand(workers={"a": 0, "b": 0}), current=2, pods=pods("a", "b"), state=state, now=NOW
    )
    assert (step.replicas, step.start_drain) == (None, ())
    assert "30s" in step.reason


def test_demand_that_needs_the_current_replicas_restarts_the_cooldown():
    state = PoolState(last_scale_time=NOW - 300, demand_peak_time=NOW - 300)
    busy = demand(workers={"a": 3, "b": 3}, queue_depth=1, oldest_queued_wait_seconds=0.5)
    step = plan(spec=SPEC, demand=busy, current=2, pods=pods("a", "b"), state=state, now=NOW)
    assert step.replicas is None
    assert step.state.demand_peak_time == NOW


def test_after_the_cooldown_it_drains_the_worker_with_the_fewest_streams():
    state = PoolState(last_scale_time=NOW - 300, demand_peak_time=NOW - 300)
    reading = demand(workers={"a": 3, "b": 1, "c": 2})
    step = plan(spec=SPEC, demand=reading, current=3, pods=pods("a", "b", "c"), state=state, now=NOW)
    assert step.replicas is None  # nothing is removed before the drain finished
    assert step.start_drain == ("b", "c")
    assert step.state.draining == ("b", "c")
    assert step.state.drain_started_time == NOW


def test_pods_that_are_not_ready_are_drained_first_as_the_replicaset_removes_them_first():
    state = PoolState(last_scale_time=NOW - 300, demand_peak_time=NOW - 300)
    reading = demand(workers={"a": 0, "b": 2})
    step = plan(spec=SPEC, demand=reading, current=2, pods=pods("a", "b", not_ready=("b",)), state=state, now=NOW)
    assert step.start_drain == ("b",)


def test_pods_not_on_a_node_and_pending_pods_are_drained_first_as_the_replicaset_removes_them_first():
    """The controller's order: unscheduled, then Pending, then not ready, then the deletion cost.
    A drain of any other pod would leave it drained and idle while the controller deletes these."""
    state = PoolState(last_scale_time=NOW - 300, demand_peak_time=NOW - 300)
    reading = demand(workers={"a": 0, "b": 0})
    views = [
        PodView(name="a", ready=False),  # running, failing its probe
        PodView(name="b", ready=True),
        PodView(name="c", ready=False, phase="Pending"),  # on a node, pulling its image
        PodView(name="d", ready=False, phase="Pending", scheduled=False),  # waiting for a GPU node
    ]
    one = plan(spec=SPEC, demand=reading, current=4, pods=views, state=state, now=NOW)
    assert one.start_drain == ("d", "c", "a")  # down to the minimum of 1: all but the ready one
    two = plan(spec=spec(min_replicas=3), demand=reading, current=4, pods=views, state=state, now=NOW)
    assert two.start_drain == ("d",)
    three = plan(spec=spec(min_replicas=2), demand=reading, current=4, pods=views, state=state, now=NOW)
    assert three.start_drain == ("d", "c")


def test_replicas_without_a_pod_are_dropped_without_a_drain():
    state = PoolState(last_scale_time=NOW - 300, demand_peak_time=NOW - 300)
    reading = demand(workers={"a": 0, "b": 0})
    step = plan(
        spec=spec(min_replicas=2),
        demand=reading,
        current=3,
        pods=pods("a", "b", "c", terminating=("c",)),
        state=state,
        now=NOW,
    )
    assert step.start_drain == ()
    assert step.replicas == 2
    assert step.state.last_scale_time == NOW


def test_it_waits_while_a_draining_worker_still_streams():
    state = PoolState(
        last_scale_time=NOW - 300, demand_peak_time=NOW - 300, draining=("b",), drain_started_time=NOW - 10
    )
    step = plan(
        spec=SPEC, demand=demand(workers={"a": 3, "b": 1}), current=2, pods=pods("a", "b"), state=state, now=NOW
    )
    assert step.replicas is None
    assert step.state.draining == ("b",)
    assert "b: 1" in step.reason


def test_it_scales_down_once_the_drained_worker_is_idle():
    state = PoolState(
        last_scale_time=NOW - 300, demand_peak_time=NOW - 300, draining=("b",), drain_started_time=NOW - 10
    )
    step = plan(
        spec=SPEC, demand=demand(workers={"a": 3, "b": 0}), current=2, pods=pods("a", "b"), state=state, now=NOW
    )
    assert step.replicas == 1
    assert step.state.draining == ()
    assert step.state.drain_started_time is None
    assert step.state.last_scale_time == NOW


def test_it_scales_down_after_the_drain_timeout_even_with_streams_left():
    state = PoolState(
        last_scale_time=NOW - 300, demand_peak_time=NOW - 300, draining=("b",), drain_started_time=NOW - 121
    )
    step = plan(
        spec=SPEC, demand=demand(workers={"a": 3, "b": 1}), current=2, pods=pods("a", "b"), state=state, now=NOW
    )
    assert step.replicas == 1
    assert "timeout" in step.reason


def test_a_drained_pod_that_vanished_counts_as_drained():
    state = PoolState(
        last_scale_time=NOW - 300, demand_peak_time=NOW - 300, draining=("b",), drain_started_time=NOW - 5
    )
    step = plan(spec=SPEC, demand=demand(workers={"a": 0, "b": 4}), current=2, pods=pods("a"), state=state, now=NOW)
    assert step.replicas == 1


def test_demand_coming_back_cancels_the_drain_and_scales_up_if_needed():
    state = PoolState(
        last_scale_time=NOW - 300, demand_peak_time=NOW - 300, draining=("b",), drain_started_time=NOW - 5
    )
    busy = demand(workers={"a": 5, "b": 5}, queue_depth=10, oldest_queued_wait_seconds=4.0)
    step = plan(spec=SPEC, demand=busy, current=2, pods=pods("a", "b"), state=state, now=NOW)
    assert step.cancel_drain == ("b",)
    assert step.state.draining == ()
    assert step.replicas == 4


def test_a_replica_count_above_a_lowered_maximum_is_drained_without_cooldown():
    state = PoolState(last_scale_time=NOW - 1, demand_peak_time=NOW - 1)
    busy = demand(workers={"a": 2, "b": 2, "c": 1}, queue_depth=1, oldest_queued_wait_seconds=0.1)
    step = plan(spec=spec(max_replicas=2), demand=busy, current=3, pods=pods("a", "b", "c"), state=state, now=NOW)
    assert step.start_drain == ("c",)


def test_a_drain_left_behind_is_cancelled_after_the_grace():
    # "old" was drained long ago, but the ReplicaSet removed another pod: it must serve again.
    marked = [
        PodView(name="old", ready=True, drain_requested_at=NOW - 600),
        PodView(name="recent", ready=True, drain_requested_at=NOW - 100),
        PodView(name="a", ready=True),
    ]
    state = PoolState(last_scale_time=NOW - 1000, demand_peak_time=NOW)
    busy = demand(workers={"old": 1, "recent": 1, "a": 1}, queue_depth=1, oldest_queued_wait_seconds=0.1)
    step = plan(spec=SPEC, demand=busy, current=3, pods=marked, state=state, now=NOW, stale_drain_grace_seconds=60)
    assert step.cancel_drain == ("old",)


# ------------------------------------------------------------------------------- status round trip


def test_the_state_survives_a_round_trip_through_the_status():
    state = PoolState(last_scale_time=NOW - 1.5, demand_peak_time=NOW, draining=("b",), drain_started_time=NOW - 0.25)
    assert PoolState.from_status(state.to_status()) == state


def test_times_are_rfc3339_utc():
    assert format_time(0.0) == "1970-01-01T00:00:00.000Z"
    assert parse_time("1970-01-01T00:00:01Z") == 1.0
    assert parse_time("not a time") is None
    assert parse_time(None) is None


def test_a_stray_drain_mark_is_cleared_before_the_scale_down():
    # "x" carries a drain mark but is not a victim: with the same lowest cost it could be removed
    # instead of "b", streams and all.
    state = PoolState(
        last_scale_time=NOW - 300, demand_peak_time=NOW - 300, draining=("b",), drain_started_time=NOW - 5
    )
    marked = [
        PodView(name="a", ready=True),
        PodView(name="b", ready=True),
        PodView(name="x", ready=True, drain_requested_at=NOW - 5),
    ]
    reading = demand(workers={"a": 1, "b": 0, "x": 2})
    step = plan(spec=SPEC, demand=reading, current=3, pods=marked, state=state, now=NOW)
    assert step.replicas is None
    assert step.cancel_drain == ("x",)
    assert step.state.draining == ("b",)
    cleared = [PodView(name="a", ready=True), PodView(name="b", ready=True), PodView(name="x", ready=True)]
    assert plan(spec=SPEC, demand=reading, current=3, pods=cleared, state=state, now=NOW).replicas == 2


SPARE_SPEC = dataclasses.replace(SPEC, warm_spare_nodes=2, spare_deployment="gemma-worker-tiny-spare")


def test_warm_spares_need_their_deployment_and_a_count_of_at_least_zero():
    base = {"model": "m", "pool": "p", "gpuKind": "a10g", "workerDeployment": "w", "maxReplicas": 4}
    with pytest.raises(InvalidSpecError, match="warmSpareNodes needs spareDeployment"):
        PoolSpec.from_spec(base | {"warmSpareNodes": 1})
    with pytest.raises(InvalidSpecError, match="warmSpareNodes must be >= 0"):
        PoolSpec.from_spec(base | {"warmSpareNodes": -1, "spareDeployment": "s"})
    parsed = PoolSpec.from_spec(base | {"warmSpareNodes": 3, "spareDeployment": "s"})
    assert (parsed.warm_spare_nodes, parsed.spare_deployment) == (3, "s")


def test_a_pool_keeps_its_warm_spares_only_while_it_has_room_to_grow():
    assert spare_replicas(SPARE_SPEC, 1) == 2
    assert spare_replicas(SPARE_SPEC, 5) == 1  # one replica short of the maximum (6)
    assert spare_replicas(SPARE_SPEC, 6) == 0
    assert spare_replicas(SPEC, 1) == 0  # no spare Deployment
    # A spare Deployment with warmSpareNodes 0 is scaled to zero: how spares are turned off.
    assert spare_replicas(dataclasses.replace(SPARE_SPEC, warm_spare_nodes=0), 1) == 0


def test_the_plan_sizes_the_spares_for_the_replicas_it_leaves():
    pods = [PodView(name="w-a", ready=True)]
    up = plan(
        spec=SPARE_SPEC,
        demand=demand(workers={"w-a": 4}, queue_depth=200, oldest_queued_wait_seconds=10),
        current=1,
        pods=pods,
        state=PoolState(),
        now=NOW,
    )
    assert (up.replicas, up.spares) == (6, 0)
    steady = plan(spec=SPARE_SPEC, demand=demand(workers={"w-a": 4}), current=1, pods=pods, state=PoolState(), now=NOW)
    assert (steady.replicas, steady.spares) == (None, 2)
