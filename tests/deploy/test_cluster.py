"""The chart and the operator against a real Kubernetes control plane (kube-apiserver, etcd and
kube-controller-manager; no kubelet, so pods stay Pending unless a test binds them to a Node and
sets their status itself). One control plane serves the whole session (conftest.kubeconfig); each
test works in its own namespace.

What only a real server shows: PodSecurity admission, the CRD's CEL rules, RBAC of the operator's
ServiceAccount token in the chart's namespaced mode, `lookup` during upgrades, and which pod the
ReplicaSet controller deletes on a scale-down. Hooks run with `--no-hooks`: without a kubelet a
hook Job never completes. Their pod templates are admitted here by a server-side dry run, and the
uninstall hook's command runs as a process with its own ServiceAccount token.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from deploy.local.launcher import free_port
from tests.deploy.conftest import A10G_VALUES, CHART, RELEASE, ROOT

FULLNAME = f"{RELEASE}-gemma-platform"
CRD_FILE = CHART / "crds" / "modelpools.yaml"
RESTRICTED = {f"pod-security.kubernetes.io/{mode}": "restricted" for mode in ("enforce", "warn", "audit")}
PSA_WARNING = "violate PodSecurity"


class Kube:
    """kubectl and helm bound to the session's admin kubeconfig."""

    def __init__(self, k8s_bin: Path, kubeconfig: str) -> None:
        self.bin = k8s_bin
        self.kubeconfig = kubeconfig
        self.env = {**os.environ, "KUBECONFIG": kubeconfig}

    def run(self, tool: str, *args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(
            [str(self.bin / tool), *args], input=stdin, capture_output=True, text=True, env=self.env, timeout=180
        )
        if check:
            assert result.returncode == 0, f"{tool} {' '.join(args)} failed:\n{result.stderr}"
        return result

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        return self.run("kubectl", *args, stdin=stdin, check=check)

    def get(self, *args: str) -> dict:
        return json.loads(self.kubectl("get", "-o", "json", *args).stdout)

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.run("helm", *args, check=check)

    def namespace(self, name: str, labels: dict[str, str] | None = None) -> str:
        manifest = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels or {}}}
        self.kubectl("apply", "-f", "-", stdin=json.dumps(manifest))
        return name

    def install_crd(self) -> None:
        self.kubectl("apply", "--server-side", "-f", str(CRD_FILE))
        self.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/modelpools.hosting.gemma.dev")


@pytest.fixture(scope="session")
def kube(k8s_bin, kubeconfig) -> Kube:
    kube = Kube(k8s_bin, kubeconfig)
    kube.install_crd()
    return kube


def wait_until(condition: Callable[[], object], what: str, timeout: float = 90.0, interval: float = 0.5):
    """Poll `condition` until it returns something truthy; fail naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        time.sleep(interval)


# ------------------------------------------------------------------------------- the CRD's CEL rules


def _modelpool(namespace: str, **spec) -> dict:
    base = {"model": "m", "pool": "p", "gpuKind": "a10g", "workerDeployment": "w", "maxReplicas": 2}
    return {
        "apiVersion": "hosting.gemma.dev/v1alpha1",
        "kind": "ModelPool",
        "metadata": {"name": "cel-check", "namespace": namespace},
        "spec": {**base, **spec},
    }


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"minReplicas": 3, "maxReplicas": 2}, "minReplicas must not exceed maxReplicas"),
        ({"minReplicas": 0}, "minReplicas may be 0 only when allowScaleToZero is true"),
        ({"minReplicas": 0, "allowScaleToZero": False}, "minReplicas may be 0 only when allowScaleToZero is true"),
        ({"warmSpareNodes": 1}, "warmSpareNodes needs spareDeployment"),
    ],
)
def test_the_api_server_rejects_modelpools_that_break_the_crds_cel_rules(kube, spec, message):
    namespace = kube.namespace("cel-rules")
    result = kube.kubectl(
        "create", "--dry-run=server", "-f", "-", stdin=json.dumps(_modelpool(namespace, **spec)), check=False
    )
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


@pytest.mark.parametrize(
    "spec",
    [
        {"minReplicas": 0, "allowScaleToZero": True},
        {"minReplicas": 2, "maxReplicas": 2},
        {},
        {"warmSpareNodes": 2, "spareDeployment": "w-spare"},
    ],
)
def test_the_api_server_admits_modelpools_within_the_rules(kube, spec):
    namespace = kube.namespace("cel-rules")
    kube.kubectl("create", "--dry-run=server", "-f", "-", stdin=json.dumps(_modelpool(namespace, **spec)))


def test_every_modelpool_the_chart_renders_is_admitted_by_the_api_server(kube, scenario):
    name, rendered = scenario
    namespace = kube.namespace("cel-rules")
    for pool in rendered.kind("ModelPool"):
        pool = {**pool, "metadata": {**pool["metadata"], "namespace": namespace}}
        result = kube.kubectl("create", "--dry-run=server", "-f", "-", stdin=json.dumps(pool), check=False)
        assert result.returncode == 0, f"{name}: {pool['metadata']['name']}: {result.stderr}"


# ------------------------------------------------------------ install, upgrade, uninstall (restricted)


def _worker_replicas(kube: Kube, namespace: str) -> dict[str, int]:
    deployments = kube.get("deployments", "-n", namespace, "-l", "app.kubernetes.io/component=worker")["items"]
    return {d["metadata"]["labels"]["hosting.gemma.dev/pool"]: d["spec"]["replicas"] for d in deployments}


def _every_deployment_has_its_pods(kube: Kube, namespace: str) -> bool:
    """Every ReplicaSet created all its pods (each one admitted under the namespace's PodSecurity
    level) and none reports a failed pod creation."""
    for replica_set in kube.get("replicasets", "-n", namespace)["items"]:
        for condition in replica_set.get("status", {}).get("conditions", []):
            assert condition["type"] != "ReplicaFailure", f"{replica_set['metadata']['name']}: {condition['message']}"
        if replica_set.get("status", {}).get("replicas", 0) != replica_set["spec"]["replicas"]:
            return False
    return True


def _generated_secret(kube: Kube, namespace: str) -> dict[str, str]:
    return kube.get("secret", "-n", namespace, f"{FULLNAME}-auth")["data"]


VALUE_SETS = {
    "default": [],
    # A10G production values, with the NetworkPolicies and a restricted web ingress as well.
    "a10g": [
        "-f",
        str(A10G_VALUES),
        "--set",
        "networkPolicy.enabled=true",
        "--set-json",
        'networkPolicy.webIngressFrom=[{"namespaceSelector":{"matchLabels":{"kubernetes.io/metadata.name":"ingress"}}}]',
    ],
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("values", sorted(VALUE_SETS))
def test_the_chart_installs_upgrades_and_uninstalls_under_restricted_pod_security(kube, values):
    namespace = kube.namespace(f"psa-{values}", RESTRICTED)
    args = ["--namespace", namespace, "--no-hooks", *VALUE_SETS[values]]

    install = kube.helm("install", RELEASE, str(CHART), *args)
    assert PSA_WARNING not in install.stderr, install.stderr
    # The ReplicaSet controller creates every pod; PodSecurity `restricted` admits each of them.
    wait_until(lambda: _every_deployment_has_its_pods(kube, namespace), "the Deployments' pods")
    pods = kube.get("pods", "-n", namespace)["items"]
    assert pods, "no pod was created"
    expected = yaml.safe_load(A10G_VALUES.read_text()) if values == "a10g" else None
    replicas = _worker_replicas(kube, namespace)
    if expected:  # a scale-to-zero pool starts no GPU worker
        assert replicas == {"gemma-4-e4b": 2, "gemma-4-e4b-batch": 0}
    else:
        assert replicas == {"gemma-4-e4b": 1}
    if values == "a10g":
        policies = {p["metadata"]["name"] for p in kube.get("networkpolicies", "-n", namespace)["items"]}
        assert f"{FULLNAME}-web" in policies, policies

    # The hooks (migrations, uninstall cleanup, helm test) are admitted by the same server.
    hooks = [
        doc
        for doc in yaml.safe_load_all(kube.helm("get", "hooks", RELEASE, "--namespace", namespace).stdout)
        if doc and doc["kind"] in {"Job", "Pod"}
    ]
    assert {doc["kind"] for doc in hooks} >= {"Job", "Pod"}
    for hook in hooks:
        dry_run = kube.kubectl("create", "--dry-run=server", "-n", namespace, "-f", "-", stdin=json.dumps(hook))
        assert PSA_WARNING not in dry_run.stderr, f"{hook['kind']}/{hook['metadata']['name']}: {dry_run.stderr}"

    # The operator scaled the first pool; an upgrade keeps that count and the generated secrets.
    secret = _generated_secret(kube, namespace)
    worker = f"{FULLNAME}-worker-gemma-4-e4b"
    kube.kubectl("scale", "-n", namespace, f"deployment/{worker}", "--replicas=3")
    upgrade = kube.helm("upgrade", RELEASE, str(CHART), *args)
    assert PSA_WARNING not in upgrade.stderr, upgrade.stderr
    assert _worker_replicas(kube, namespace)["gemma-4-e4b"] == 3
    assert _generated_secret(kube, namespace) == secret
    assert all(len(base64.b64decode(value)) >= 32 for value in secret.values())
    wait_until(lambda: _every_deployment_has_its_pods(kube, namespace), "the pods after the upgrade")

    kube.helm("uninstall", RELEASE, "--namespace", namespace, "--no-hooks")
    assert not kube.get("deployments", "-n", namespace)["items"]
    assert not kube.get("modelpools", "-n", namespace)["items"]
    # The generated Secret is kept (helm.sh/resource-policy: keep): a reinstall reuses it.
    assert _generated_secret(kube, namespace) == secret
    reinstall = kube.helm("install", RELEASE, str(CHART), *args)
    assert PSA_WARNING not in reinstall.stderr
    assert _generated_secret(kube, namespace) == secret
    kube.helm("uninstall", RELEASE, "--namespace", namespace, "--no-hooks")


# ----------------------------------------------- the chart's operator, its token and RBAC, the real RS


def _token_kubeconfig(kube: Kube, path: Path, namespace: str, service_account: str) -> Path:
    """A kubeconfig that authenticates as the ServiceAccount, with a TokenRequest token (what the
    kubelet would mount into the operator's pod)."""
    token = kube.kubectl("create", "token", service_account, "-n", namespace, "--duration=1h").stdout.strip()
    admin = yaml.safe_load(Path(kube.kubeconfig).read_text())
    cluster = admin["clusters"][0]["cluster"]
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "local", "cluster": cluster}],
                "users": [{"name": service_account, "user": {"token": token}}],
                "contexts": [{"name": "local", "context": {"cluster": "local", "user": service_account}}],
                "current-context": "local",
            }
        )
    )
    return path


def _pods(kube: Kube, namespace: str, deployment: dict, count: int | None = None) -> dict[str, dict]:
    """The Deployment's pods by name; with `count`, empty unless there are exactly that many."""
    selector = ",".join(f"{k}={v}" for k, v in deployment["spec"]["selector"]["matchLabels"].items())
    pods = {p["metadata"]["name"]: p for p in kube.get("pods", "-n", namespace, "-l", selector)["items"]}
    return pods if count is None or len(pods) == count else {}


def _run_on_node(kube: Kube, namespace: str, pod: str, node: str) -> None:
    """What the scheduler and a kubelet would do: bind the pod to the node, report it Running and Ready."""
    binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": pod}}
    binding["target"] = {"kind": "Node", "name": node}
    path = f"/api/v1/namespaces/{namespace}/pods/{pod}/binding"
    kube.kubectl("create", "--raw", path, "-f", "-", stdin=json.dumps(binding))
    status = {"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}
    kube.kubectl("patch", "pod", pod, "-n", namespace, "--subresource=status", "--type=merge", "-p", json.dumps(status))


def _events(kube: Kube, namespace: str, pool: str) -> list[dict]:
    listing = kube.get("events", "-n", namespace, "--field-selector", f"involvedObject.name={pool}")
    return [e for e in listing["items"] if e["involvedObject"]["kind"] == "ModelPool"]


def _event(kube: Kube, namespace: str, pool: str, reason: str) -> dict | None:
    return next((e for e in _events(kube, namespace, pool) if e["reason"] == reason), None)


@pytest.mark.asyncio
@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")
async def test_the_charts_operator_scales_a_pool_and_the_replicaset_deletes_the_drained_pods(kube, tmp_path):
    """The operator Deployment's own command line, run as a process with its ServiceAccount's token
    (the chart's namespaced Role), against the real API server and controllers: it scales the pool
    up from demand, then down through a drain, and the ReplicaSet controller deletes exactly the
    pods it drained (the oldest ones, which the controller would keep without the deletion cost).
    Each action is posted as an Event on the ModelPool."""
    from tests.operator.fake_control_plane import FakeControlPlane

    namespace = kube.namespace("operator", RESTRICTED)
    port = free_port()
    values = tmp_path / "values.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "operator": {"livenessPort": port},
                "pools": [
                    {
                        "name": "gemma-4-e4b",
                        "servedModel": "google/gemma-4-E4B-it",
                        "autoscaling": {"minReplicas": 1, "maxReplicas": 4, "scaleDownCooldownSeconds": 0},
                    }
                ],
            }
        )
    )
    await asyncio.to_thread(kube.helm, "install", RELEASE, str(CHART), "-n", namespace, "--no-hooks", "-f", str(values))
    operator = kube.get("deployment", "-n", namespace, f"{FULLNAME}-operator")
    pod_spec = operator["spec"]["template"]["spec"]
    (container,) = pod_spec["containers"]
    assert "--namespace" in container["command"] and "--all-namespaces" not in container["command"]
    (pool,) = kube.get("modelpools", "-n", namespace)["items"]
    pool_name = pool["metadata"]["name"]
    worker_name = pool["spec"]["workerDeployment"]
    worker = kube.get("deployment", "-n", namespace, worker_name)
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "a10g-1"}}
    kube.kubectl("apply", "-f", "-", stdin=json.dumps(node))

    (first,) = wait_until(lambda: _pods(kube, namespace, worker), "the worker's first pod")
    _run_on_node(kube, namespace, first, "a10g-1")

    token = "operator-token-for-the-cluster-test"
    control_plane = FakeControlPlane(token)
    await control_plane.start()
    # One worker with 4 streams, 8 requests queued for 10 s (target 2 s): 3 replicas needed.
    pool_id = pool["spec"]["pool"]
    control_plane.set_pool(pool_id, workers={first: 4}, queue_depth=8, oldest_queued_wait_seconds=10)
    env = {
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "KUBECONFIG": str(_token_kubeconfig(kube, tmp_path / "kubeconfig", namespace, pod_spec["serviceAccountName"])),
        # As operator.Dockerfile sets it (WORKDIR /app = the repository root).
        "PYTHONPATH": f"{ROOT / 'deploy' / 'operator'}:{ROOT}",
        # In the cluster these come from the chart: the web Service's URL and the auth Secret.
        "CONTROL_PLANE_URL": control_plane.url,
        "OPERATOR_TOKEN": token,
        "POOLSCALER_INTERVAL_SECONDS": "0.5",
    }
    process = await asyncio.create_subprocess_exec(
        *container["command"], cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )

    def replicas() -> int:
        return kube.get("deployment", "-n", namespace, worker_name)["spec"]["replicas"]

    async def until(condition: Callable[[], object], what: str, timeout: float = 90.0):
        assert process.returncode is None, "the operator exited"
        return await asyncio.to_thread(wait_until, condition, what, timeout)

    try:
        await until(lambda: replicas() == 3, "the scale-up to 3")
        await until(lambda: _event(kube, namespace, pool_name, "ScaledUp"), "a ScaledUp event")
        probe = container["livenessProbe"]["httpGet"]
        answer = await asyncio.to_thread(urllib.request.urlopen, f"http://127.0.0.1:{port}{probe['path']}", timeout=5)
        assert answer.status == 200
        pods = await until(lambda: _pods(kube, namespace, worker, count=3), "3 pods")
        newest = sorted(set(pods) - {first})
        for pod in newest:
            _run_on_node(kube, namespace, pod, "a10g-1")
        # Demand falls to one replica's worth. The oldest pods carry the fewest streams, so they
        # are the victims; the ReplicaSet alone would delete the newest pods first.
        keep = newest[-1]
        control_plane.set_pool(pool_id, workers={first: 0, newest[0]: 1, keep: 5}, queue_depth=0)
        victims = {first, newest[0]}
        await until(lambda: set(control_plane.drains()) == victims, "the drain of the two idle pods")
        await until(lambda: _event(kube, namespace, pool_name, "DrainStarted"), "a DrainStarted event")
        annotated = _pods(kube, namespace, worker)
        for pod in victims:
            assert annotated[pod]["metadata"]["annotations"]["controller.kubernetes.io/pod-deletion-cost"] == "-1000"
        assert replicas() == 3  # one victim still streams
        control_plane.set_in_flight(pool_id, newest[0], 0)
        await until(lambda: replicas() == 1, "the scale-down to 1")

        def deleted() -> set[str] | None:
            current = _pods(kube, namespace, worker)
            gone = {name for name in pods if name not in current or current[name]["metadata"].get("deletionTimestamp")}
            return gone if len(gone) == 2 else None

        assert await until(deleted, "the ReplicaSet controller deleting two pods") == victims
        event = await until(lambda: _event(kube, namespace, pool_name, "ScaledDown"), "a ScaledDown event")
        assert "scale down 3 -> 1" in event["message"] and event["type"] == "Normal"
        assert event["source"]["component"] == "kopf"
    except AssertionError as exc:
        if process.returncode is None:
            process.kill()
        output, _ = await asyncio.wait_for(process.communicate(), timeout=30)
        raise AssertionError(f"{exc}\n--- operator output ---\n{output.decode()[-4000:]}") from None
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        output, _ = await asyncio.wait_for(process.communicate(), timeout=60)
        await control_plane.stop()
    log = output.decode()
    assert process.returncode == 0, log[-4000:]
    # A 403 from the API server shows as a Status "Forbidden" or an HTTP code 403; a bare
    # "403" would also match a log line's milliseconds ("13:33:34,403"), and the operator's own
    # access log (its probes) says nothing about the API server.
    api_log = "\n".join(line for line in log.splitlines() if "aiohttp.access" not in line)
    assert not re.search(r"Forbidden|[(\s'\"]403\b", api_log), log[-4000:]
    status = kube.get("modelpool", "-n", namespace, pool_name)["status"]
    assert status["replicas"] == 1 and status["draining"] == []


# --------------------------------------------------------------------------- the uninstall cleanup hook


@pytest.mark.timeout(300)
def test_the_uninstall_hook_deletes_the_pools_and_unsticks_those_nobody_releases(kube, tmp_path):
    """The pre-delete hook Job's command, run as a process with its own ServiceAccount's token and
    Role (created from the release's hook manifests), against the chart's two ModelPools: one held by
    kopf's finalizer with no operator to remove it, one free. Both end deleted; the stuck one after
    the configured wait."""
    namespace = kube.namespace("uninstall-hook", RESTRICTED)
    kube.helm(
        "install", RELEASE, str(CHART), "-n", namespace, "--no-hooks", "-f", str(A10G_VALUES),
        "--set", "operator.cleanupWaitSeconds=1",
    )  # fmt: skip
    pools = sorted(p["metadata"]["name"] for p in kube.get("modelpools", "-n", namespace)["items"])
    assert len(pools) == 2
    stuck = pools[0]
    finalizers = {"metadata": {"finalizers": ["kopf.zalando.org/KopfFinalizerMarker"]}}
    kube.kubectl("patch", "modelpool", stuck, "-n", namespace, "--type=merge", "-p", json.dumps(finalizers))

    hooks = [
        doc
        for doc in yaml.safe_load_all(kube.helm("get", "hooks", RELEASE, "-n", namespace).stdout)
        if doc and doc["metadata"]["labels"].get("app.kubernetes.io/component") == "operator-cleanup"
    ]
    for doc in hooks:
        if doc["kind"] != "Job":
            kube.kubectl("apply", "-n", namespace, "-f", "-", stdin=json.dumps(doc))
    (job,) = [doc for doc in hooks if doc["kind"] == "Job"]
    pod_spec = job["spec"]["template"]["spec"]
    (container,) = pod_spec["containers"]
    env = {
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "KUBECONFIG": str(_token_kubeconfig(kube, tmp_path / "kubeconfig", namespace, pod_spec["serviceAccountName"])),
        "PYTHONPATH": f"{ROOT / 'deploy' / 'operator'}:{ROOT}",
    }
    started = time.monotonic()
    result = subprocess.run(container["command"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - started
    log = result.stdout + result.stderr
    assert result.returncode == 0, log
    assert f"removing their finalizers: {stuck}" in log, log
    assert elapsed >= 1  # it gave the operator its chance first
    assert not kube.get("modelpools", "-n", namespace)["items"], log
    kube.helm("uninstall", RELEASE, "-n", namespace, "--no-hooks")
