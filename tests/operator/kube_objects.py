"""Objects of the emulated cluster for the pool scaler's reconcile tests, and waiting helpers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import kmock

NAMESPACE = "gemma"
POOL = "tiny"
DEPLOYMENT = "gemma-worker-tiny"
TOKEN = "operator-token-for-tests"
MODELPOOLS = "hosting.gemma.dev/v1alpha1/modelpools"
DEPLOYMENTS = "apps/v1/deployments"
PODS = "v1/pods"
POD_LABELS = {"app.kubernetes.io/name": "gemma-worker", "hosting.gemma.dev/pool": POOL}


def model_pool(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "hosting.gemma.dev/v1alpha1",
        "kind": "ModelPool",
        "metadata": {
            "name": POOL,
            "namespace": NAMESPACE,
            "uid": "7d1c0f9e-pool",
            "generation": 1,
            "resourceVersion": "1",
        },
        "spec": {
            "model": "google/gemma-4-E4B-it",
            "pool": POOL,
            "gpuKind": "a10g",
            "workerDeployment": DEPLOYMENT,
            "minReplicas": 1,
            "maxReplicas": 4,
            "targetQueueWaitSeconds": 2,
            "scaleDownCooldownSeconds": 0,
            "allowScaleToZero": False,
            "drainTimeoutSeconds": 60,
            **spec,
        },
    }


def deployment(replicas: int) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": DEPLOYMENT, "namespace": NAMESPACE, "uid": "5b2a-deployment", "resourceVersion": "1"},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": POD_LABELS},
            "template": {
                "metadata": {"labels": POD_LABELS},
                "spec": {"containers": [{"name": "worker", "image": "gemma-platform/worker:0.1.0"}]},
            },
        },
        "status": {"replicas": replicas},
    }


def pod(name: str, *, ready: bool = True, node: str | None = "gpu-node-1", phase: str = "Running") -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "worker", "image": "gemma-platform/worker:0.1.0"}]}
    if node:
        spec["nodeName"] = node
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "labels": POD_LABELS,
            "uid": f"uid-{name}",
            "resourceVersion": "1",
        },
        "spec": spec,
        "status": {"phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def seed(kube: kmock.KubernetesEmulator, *, replicas: int, pods: dict[str, bool], **spec: Any) -> None:
    """Put a ModelPool, its worker Deployment and pods (name -> ready) into the emulated cluster."""
    kube.objects[DEPLOYMENTS, NAMESPACE, DEPLOYMENT] = deployment(replicas)
    for name, ready in pods.items():
        kube.objects[PODS, NAMESPACE, name] = pod(name, ready=ready)
    kube.objects[MODELPOOLS, NAMESPACE, POOL] = model_pool(**spec)


def replicas(kube: kmock.KubernetesEmulator) -> int:
    return kube.objects[DEPLOYMENTS, NAMESPACE, DEPLOYMENT]["spec"]["replicas"]


def pool_status(kube: kmock.KubernetesEmulator) -> dict[str, Any]:
    return dict(kube.objects[MODELPOOLS, NAMESPACE, POOL].raw.get("status", {}))


def annotations(kube: kmock.KubernetesEmulator, name: str) -> dict[str, str]:
    return dict(kube.objects[PODS, NAMESPACE, name].raw["metadata"].get("annotations") or {})


def condition(kube: kmock.KubernetesEmulator, kind: str) -> dict[str, Any]:
    return next((c for c in pool_status(kube).get("conditions", []) if c["type"] == kind), {})


async def eventually(check: Callable[[], bool], *, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)


async def reconciles(kube: kmock.KubernetesEmulator, count: int = 3, timeout: float = 20.0) -> None:
    """Wait until the operator has written the pool status `count` more times."""
    start = len(kube.objects[MODELPOOLS, NAMESPACE, POOL].history)
    await eventually(
        lambda: len(kube.objects[MODELPOOLS, NAMESPACE, POOL].history) >= start + count,
        timeout=timeout,
        what=f"{count} reconciles",
    )


async def settled_at(kube: kmock.KubernetesEmulator, count: int, timeout: float = 20.0) -> None:
    """Wait until the Deployment has `count` replicas and the pool status has recorded it."""
    await eventually(
        lambda: replicas(kube) == count and pool_status(kube).get("replicas") == count,
        timeout=timeout,
        what=f"{count} replicas, recorded in the status",
    )
