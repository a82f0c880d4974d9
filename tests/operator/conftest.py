"""Fixtures for the pool scaler's tests.

The reconcile tests run the real operator (`kopf.operator()` with the handlers of
deploy/operator/poolscaler.py and the official `kubernetes` client) against kmock's emulated
Kubernetes API over real HTTP, and against `FakeControlPlane`, an HTTP test double of the
control plane's demand and drain endpoints. kmock stores objects and merges patches; it runs no
controllers, so no ReplicaSet creates or deletes pods here: tests read the Deployment's
replicas and the pods' annotations, which is what the operator writes.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import pytest_asyncio

# deploy/operator is a script folder (kopf runs poolscaler.py by path), not a package.
OPERATOR_DIR = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "operator"
if str(OPERATOR_DIR) not in sys.path:
    sys.path.insert(0, str(OPERATOR_DIR))

# The timer period is fixed when poolscaler is imported: reconcile every 0.2 s in tests.
os.environ["POOLSCALER_INTERVAL_SECONDS"] = "0.2"

import kmock  # noqa: E402
import kopf  # noqa: E402
import kubernetes.config.kube_config  # noqa: E402

from tests.operator.fake_control_plane import FakeControlPlane  # noqa: E402
from tests.operator.kube_objects import MODELPOOLS, NAMESPACE, TOKEN  # noqa: E402


@pytest_asyncio.fixture
async def kube() -> AsyncIterator[kmock.KubernetesEmulator]:
    async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator):
        emulator.resources.load_bundled()
        emulator.resources[MODELPOOLS] = kmock.ResourceInfo(
            kind="ModelPool",
            singular="modelpool",
            namespaced=True,
            verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
            subresources={"status"},
        )
        yield emulator


@pytest_asyncio.fixture
async def control_plane() -> AsyncIterator[FakeControlPlane]:
    fake = FakeControlPlane(TOKEN)
    await fake.start()
    yield fake
    await fake.stop()


@pytest.fixture
def kubeconfig(kube: kmock.KubernetesEmulator, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kubeconfig pointing at the emulator, as $KUBECONFIG."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kmock", "cluster": {"server": str(kube.url).rstrip("/")}}],
        "users": [{"name": "operator", "user": {"token": "kube-token"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "operator", "namespace": NAMESPACE}}],
        "current-context": "kmock",
    }
    path = tmp_path / "kubeconfig.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    monkeypatch.setenv("KUBECONFIG", str(path))
    # The kubernetes client reads $KUBECONFIG once, when it is imported, into this default; kopf's
    # login (kubernetes.config.load_kube_config() without a path) uses it.
    monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(path))
    # Outside a pod: make sure the in-cluster login is not attempted.
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)


@pytest_asyncio.fixture
async def start_operator(
    kube: kmock.KubernetesEmulator,
    control_plane: FakeControlPlane,
    kubeconfig: None,
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[Callable[[], Awaitable[None]]]:
    """Returns `start()`: runs the real operator until the test ends.

    `kopf.operator()` runs on its own event loop in a thread, as `kopf run` would run it in its
    own process; the emulator and the control-plane double keep serving on the test's loop.
    """
    import poolscaler  # noqa: F401  (registers the handlers with kopf)

    monkeypatch.setenv("CONTROL_PLANE_URL", control_plane.url)
    monkeypatch.setenv("OPERATOR_TOKEN", TOKEN)
    monkeypatch.setenv("POOLSCALER_RETRY_SECONDS", "0.2")
    monkeypatch.setenv("POOLSCALER_DEMAND_TIMEOUT_SECONDS", "1")
    stop, ready = threading.Event(), threading.Event()
    runs: list[asyncio.Task[None]] = []

    async def start() -> None:
        operator = kopf.operator(
            standalone=True, clusterwide=True, settings=quick_settings(), stop_flag=stop, ready_flag=ready
        )
        run = asyncio.create_task(asyncio.to_thread(asyncio.run, operator))
        runs.append(run)
        started = asyncio.create_task(asyncio.to_thread(ready.wait, 30))
        await asyncio.wait({run, started}, return_when=asyncio.FIRST_COMPLETED)
        if run.done():  # it stopped before it was ready: show why
            started.cancel()
            run.result()
            raise RuntimeError("the operator exited before it was ready")
        if not await started:
            raise RuntimeError("the operator did not get ready within 30 s")

    yield start
    stop.set()
    for run in runs:
        await asyncio.wait_for(run, timeout=15)


def quick_settings() -> kopf.OperatorSettings:
    """kopf's defaults, but quick to stop: the emulator never bumps resourceVersion on a patch,
    so kopf would wait out its consistency timeout for a version that never comes."""
    settings = kopf.OperatorSettings()
    settings.persistence.consistency_timeout = 0.5
    settings.queueing.exit_timeout = 0.5
    return settings
