"""The pool scaler's reconcile loop, end to end: a real kopf operator, the `kubernetes` client,
kmock's emulated Kubernetes API and an HTTP double of the control plane (see conftest.py)."""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import sys
import time

import pytest
import scaling

from tests.operator.kube_objects import (
    DEPLOYMENT,
    DEPLOYMENTS,
    MODELPOOLS,
    NAMESPACE,
    PODS,
    POOL,
    TOKEN,
    annotations,
    condition,
    deployment,
    eventually,
    pod,
    pool_status,
    reconciles,
    replicas,
    seed,
    settled_at,
)

pytestmark = [
    pytest.mark.asyncio,
    pytest.mark.timeout(120),
    # kmock 0.8 loads its bundled resource list with a deprecated importlib.resources call.
    pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning"),
]

POOLSCALER = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "operator" / "poolscaler.py"
COST = scaling.DELETION_COST_ANNOTATION
MARK = scaling.DRAIN_MARK_ANNOTATION


async def test_it_scales_up_at_once_on_a_queue_backlog(kube, control_plane, start_operator):
    seed(kube, replicas=1, pods={"w-a": True}, maxReplicas=8, scaleDownCooldownSeconds=600)
    # One ready worker holds 4 streams; 8 more requests queued, the oldest for 10 s (target 2 s):
    # at that worker's concurrency the backlog needs ceil(12 / 4) = 3 replicas.
    control_plane.set_pool(POOL, workers={"w-a": 4}, queue_depth=8, oldest_queued_wait_seconds=10)

    await start_operator()

    await settled_at(kube, 3)
    status = pool_status(kube)
    assert status["desiredReplicas"] == 3
    assert status["lastScaleTime"]
    assert status["lastDemand"]["queueDepth"] == 8
    assert condition(kube, "Ready")["status"] == "True"
    assert control_plane.drains() == []


async def test_it_holds_the_replicas_during_the_scale_down_cooldown(kube, control_plane, start_operator):
    seed(kube, replicas=3, pods={"w-a": True, "w-b": True, "w-c": True}, scaleDownCooldownSeconds=600)
    control_plane.set_pool(POOL, workers={"w-a": 0, "w-b": 0, "w-c": 0})

    await start_operator()
    await reconciles(kube, count=5)

    assert replicas(kube) == 3
    assert pool_status(kube)["desiredReplicas"] == 1
    assert "cooldown" in condition(kube, "Ready")["message"]
    assert control_plane.drains() == []
    assert all(COST not in annotations(kube, name) for name in ("w-a", "w-b", "w-c"))


async def test_it_scales_down_only_after_the_drained_worker_finished_its_streams(kube, control_plane, start_operator):
    seed(kube, replicas=2, pods={"w-a": True, "w-b": True})
    # Nothing queued: one replica is enough. w-b holds the fewest streams, so it is the one to go.
    control_plane.set_pool(POOL, workers={"w-a": 3, "w-b": 1})

    await start_operator()

    await eventually(lambda: control_plane.drains() == ["w-b"], what="drain of w-b")
    await eventually(lambda: annotations(kube, "w-b").get(COST) == "-1000", what="w-b deletion cost")
    assert COST not in annotations(kube, "w-a")
    assert MARK in annotations(kube, "w-b")
    await eventually(lambda: pool_status(kube).get("draining") == ["w-b"], what="draining in status")

    # While w-b still streams, the replica stays.
    await reconciles(kube, count=5)
    assert replicas(kube) == 2
    assert condition(kube, "Draining")["status"] == "True"
    assert "w-b: 1" in condition(kube, "Ready")["message"]

    control_plane.set_in_flight(POOL, "w-b", 0)

    await settled_at(kube, 1)
    await eventually(lambda: pool_status(kube).get("draining") == [], what="drain cleared from status")
    assert control_plane.drains() == ["w-b"]
    assert control_plane.drains("DELETE") == []
    # Until the replicas dropped, every written scale was 2: the streaming worker was never removed.
    scales = [version["spec"]["replicas"] for version in kube.objects[DEPLOYMENTS, NAMESPACE, DEPLOYMENT].history]
    assert scales == [2, 1]


async def test_it_drains_and_marks_the_pod_the_replicaset_will_delete_before_scaling_down(
    kube, control_plane, start_operator
):
    seed(kube, replicas=3, pods={"w-a": True, "w-b": False}, minReplicas=2)
    # w-p waits for a GPU node: unscheduled and Pending, the ReplicaSet controller's first pick, even
    # before w-b, which runs but fails its readiness probe.
    kube.objects[PODS, NAMESPACE, "w-p"] = pod("w-p", ready=False, node=None, phase="Pending")
    control_plane.set_pool(POOL, workers={"w-a": 2, "w-b": 0})

    await start_operator()

    await settled_at(kube, 2)
    assert control_plane.drains() == ["w-p"]
    assert annotations(kube, "w-p")[COST] == "-1000"
    assert COST not in annotations(kube, "w-a") and COST not in annotations(kube, "w-b")
    # The deletion cost reached the pod before the scale-down that the ReplicaSet acts on.
    calls = [(request.method, str(request.url.path)) for request in kube if request.method == "PATCH"]
    mark = calls.index(("PATCH", f"/api/v1/namespaces/{NAMESPACE}/pods/w-p"))
    scale = calls.index(("PATCH", f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{DEPLOYMENT}/scale"))
    assert mark < scale


async def test_it_cancels_a_drain_when_demand_comes_back(kube, control_plane, start_operator):
    seed(kube, replicas=2, pods={"w-a": True, "w-b": True})
    control_plane.set_pool(POOL, workers={"w-a": 2, "w-b": 1})

    await start_operator()
    await eventually(lambda: control_plane.drains() == ["w-b"], what="drain of w-b")

    pool = control_plane.pools[POOL]
    pool.queue_depth, pool.oldest_queued_wait_seconds = 1, 0.5  # a queue again: both replicas needed

    await eventually(lambda: control_plane.drains("DELETE") == ["w-b"], what="drain cancelled")
    await eventually(lambda: COST not in annotations(kube, "w-b"), what="deletion cost removed")
    assert MARK not in annotations(kube, "w-b")
    await reconciles(kube, count=3)
    assert replicas(kube) == 2
    assert pool_status(kube)["draining"] == []


async def test_it_never_scales_above_max_replicas(kube, control_plane, start_operator):
    seed(kube, replicas=1, pods={"w-a": True}, maxReplicas=3)
    control_plane.set_pool(POOL, workers={"w-a": 1}, queue_depth=500, oldest_queued_wait_seconds=60)

    await start_operator()

    await settled_at(kube, 3)
    await reconciles(kube, count=3)
    assert replicas(kube) == 3
    assert pool_status(kube)["desiredReplicas"] == 3


async def test_it_never_scales_below_min_replicas(kube, control_plane, start_operator):
    seed(kube, replicas=3, pods={"w-a": True, "w-b": True, "w-c": True}, minReplicas=2)
    control_plane.set_pool(POOL, workers={"w-a": 0, "w-b": 0, "w-c": 0})

    await start_operator()

    await settled_at(kube, 2)
    await reconciles(kube, count=5)
    assert replicas(kube) == 2
    assert len(control_plane.drains()) == 1


async def test_it_scales_up_from_zero_when_requests_wait_at_the_gateway(kube, control_plane, start_operator):
    seed(kube, replicas=0, pods={}, minReplicas=0, allowScaleToZero=True, scaleDownCooldownSeconds=600)
    control_plane.set_pool(POOL, waiting=1)  # no worker at all: the gateway holds the request

    await start_operator()

    await settled_at(kube, 1)
    assert pool_status(kube)["lastDemand"]["waiting"] == 1


async def test_it_scales_to_zero_when_allowed_and_idle(kube, control_plane, start_operator):
    seed(kube, replicas=1, pods={"w-a": True}, minReplicas=0, allowScaleToZero=True)
    control_plane.set_pool(POOL, workers={"w-a": 0})

    await start_operator()

    await settled_at(kube, 0)
    assert control_plane.drains() == ["w-a"]


async def test_it_does_not_scale_to_zero_when_not_allowed(kube, control_plane, start_operator):
    seed(kube, replicas=1, pods={"w-a": True}, minReplicas=1, allowScaleToZero=False)
    control_plane.set_pool(POOL, workers={"w-a": 0})

    await start_operator()
    await reconciles(kube, count=5)

    assert replicas(kube) == 1
    assert pool_status(kube)["desiredReplicas"] == 1
    assert control_plane.drains() == []


async def test_it_rejects_min_zero_without_scale_to_zero_and_changes_nothing(kube, control_plane, start_operator):
    seed(kube, replicas=1, pods={"w-a": True}, minReplicas=0, allowScaleToZero=False)
    control_plane.set_pool(POOL, workers={"w-a": 0})

    await start_operator()

    await eventually(lambda: condition(kube, "Ready").get("reason") == "InvalidSpec", what="InvalidSpec condition")
    assert "allowScaleToZero" in condition(kube, "Ready")["message"]
    await asyncio.sleep(1)
    assert replicas(kube) == 1
    assert control_plane.calls == []


async def test_it_changes_nothing_while_the_control_plane_is_down(kube, control_plane, start_operator):
    seed(kube, replicas=2, pods={"w-a": True, "w-b": True})
    control_plane.set_pool(POOL, workers={"w-a": 0, "w-b": 0})
    await control_plane.stop()  # connection refused from now on

    await start_operator()

    await eventually(
        lambda: condition(kube, "Ready").get("reason") == "ControlPlaneUnavailable", what="ControlPlaneUnavailable"
    )
    await asyncio.sleep(1)  # several retries
    assert replicas(kube) == 2
    assert len(kube.objects[DEPLOYMENTS, NAMESPACE, DEPLOYMENT].history) == 1
    assert all(COST not in annotations(kube, name) for name in ("w-a", "w-b"))


async def test_it_sends_the_operator_token(kube, control_plane, start_operator):
    seed(kube, replicas=1, pods={"w-a": True})
    control_plane.set_pool(POOL, workers={"w-a": 1})

    await start_operator()
    await reconciles(kube, count=2)

    assert ("GET", f"/api/v1/pools/{POOL}/demand") in control_plane.calls
    assert control_plane.unauthorized == 0


async def test_a_restarted_operator_resumes_the_drain_recorded_in_the_status(kube, control_plane, start_operator):
    seed(kube, replicas=2, pods={"w-a": True, "w-b": True})
    # A previous operator process drained w-b and recorded it; w-b has finished its streams since.
    kube.objects[MODELPOOLS, NAMESPACE, POOL].patch(
        {"status": {"draining": ["w-b"], "drainStartedTime": scaling.format_time(time.time() - 5)}}
    )
    control_plane.set_pool(POOL, workers={"w-a": 2, "w-b": 0})

    await start_operator()

    await settled_at(kube, 1)
    assert control_plane.drains() == []  # no second drain: the recorded one was carried on
    assert pool_status(kube)["draining"] == []


async def test_a_missing_worker_deployment_is_reported_and_retried(kube, control_plane, start_operator):
    seed(kube, replicas=1, pods={})
    del kube.objects[DEPLOYMENTS, NAMESPACE, DEPLOYMENT]
    control_plane.set_pool(POOL, queue_depth=3, oldest_queued_wait_seconds=30)

    await start_operator()

    await eventually(lambda: condition(kube, "Ready").get("reason") == "DeploymentNotFound", what="condition")
    assert DEPLOYMENT in condition(kube, "Ready")["message"]
    kube.objects[DEPLOYMENTS, NAMESPACE, DEPLOYMENT] = deployment(0)  # the chart creates it later
    await settled_at(kube, 1)


async def test_the_kopf_command_of_the_image_runs_the_operator(kube, control_plane, kubeconfig, monkeypatch):
    """The container's command line (deploy/docker/operator.Dockerfile, the chart), as a process."""
    seed(kube, replicas=1, pods={"w-a": True}, maxReplicas=8)
    control_plane.set_pool(POOL, workers={"w-a": 4}, queue_depth=8, oldest_queued_wait_seconds=10)
    env = {
        **os.environ,
        "CONTROL_PLANE_URL": control_plane.url,
        "OPERATOR_TOKEN": TOKEN,
        "POOLSCALER_INTERVAL_SECONDS": "0.2",
    }
    command = ["--standalone", "--all-namespaces", "--liveness=http://127.0.0.1:0/healthz", str(POOLSCALER)]
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kopf",
        "run",
        *command,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        await settled_at(kube, 3, timeout=60)  # the process imports kopf and kubernetes first
    finally:
        process.send_signal(signal.SIGTERM)
        output, _ = await asyncio.wait_for(process.communicate(), timeout=20)
    assert process.returncode == 0, output.decode()[-2000:]
    assert b"scale up 1 -> 3" in output


async def test_it_keeps_the_warm_spares_within_the_room_the_pool_has_to_grow(kube, control_plane, start_operator):
    spare = f"{DEPLOYMENT}-spare"
    seed(kube, replicas=1, pods={"w-a": True}, maxReplicas=3, warmSpareNodes=2, spareDeployment=spare)
    kube.objects[DEPLOYMENTS, NAMESPACE, spare] = deployment(0) | {
        "metadata": {"name": spare, "namespace": NAMESPACE, "uid": "5b2a-spare", "resourceVersion": "1"}
    }
    control_plane.set_pool(POOL, workers={"w-a": 1})

    await start_operator()

    # One worker of at most three: room for two more, so both spares are kept.
    await eventually(lambda: kube.objects[DEPLOYMENTS, NAMESPACE, spare]["spec"]["replicas"] == 2, what="2 spares")
    await eventually(lambda: pool_status(kube).get("spareReplicas") == 2, what="spareReplicas recorded")
    # Scaled to its maximum, the pool can use no spare: the placeholders go.
    control_plane.set_pool(POOL, workers={"w-a": 1}, queue_depth=500, oldest_queued_wait_seconds=60)
    await settled_at(kube, 3)
    await eventually(lambda: kube.objects[DEPLOYMENTS, NAMESPACE, spare]["spec"]["replicas"] == 0, what="0 spares")
    assert replicas(kube) == 3
