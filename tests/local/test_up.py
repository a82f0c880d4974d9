"""``make up`` as a new user runs it: one command brings the stack up, a curl line answers, Ctrl-C stops it."""

import json
import os
import queue
import re
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from deploy.local.launcher import free_port, port_open
from deploy.local.services import REPO_ROOT, stop_services

GUNICORN_CONF = REPO_ROOT / "deploy" / "gunicorn.conf.py"


def test_the_gunicorn_config_reads_its_settings_from_the_environment(monkeypatch):
    monkeypatch.delenv("GUNICORN_BIND", raising=False)
    monkeypatch.delenv("GUNICORN_ACCESS_LOG", raising=False)
    monkeypatch.setenv("PORT", "9123")
    monkeypatch.setenv("WEB_CONCURRENCY", "3")

    conf = runpy.run_path(str(GUNICORN_CONF))

    assert conf["bind"] == "0.0.0.0:9123"
    assert (conf["worker_class"], conf["workers"]) == ("uvicorn_worker.UvicornWorker", 3)
    assert conf["wsgi_app"] == "config.asgi:application"  # command lines name only the config file
    assert conf["timeout"] == 0  # a long SSE stream is never cut by the worker timeout
    assert conf["accesslog"] is None


def test_the_gunicorn_config_defaults_suit_streaming(monkeypatch):
    for name in ("PORT", "WEB_CONCURRENCY", "GUNICORN_BIND", "HOST"):
        monkeypatch.delenv(name, raising=False)

    conf = runpy.run_path(str(GUNICORN_CONF))

    assert conf["bind"] == "0.0.0.0:8000"  # the default number of processes follows the cores: below
    assert "threads" not in conf  # an open stream holds no thread: nothing to size


def test_the_gunicorn_config_names_a_malformed_variable(monkeypatch):
    monkeypatch.setenv("WEB_CONCURRENCY", "many")

    with pytest.raises(SystemExit, match="WEB_CONCURRENCY must be an integer"):
        runpy.run_path(str(GUNICORN_CONF))


def _workers_on(cores: set[int]) -> int:
    """The config's `workers`, unset WEB_CONCURRENCY, in a process that may run only on `cores`."""
    code = (
        f"import os, runpy; os.sched_setaffinity(0, {sorted(cores)!r}); "
        f"print(runpy.run_path({str(GUNICORN_CONF)!r})['workers'])"
    )
    environ = {name: value for name, value in os.environ.items() if name != "WEB_CONCURRENCY"}
    return int(
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, check=True).stdout
    )


def test_the_gunicorn_config_starts_one_web_process_per_core_it_may_use(monkeypatch):
    allowed = sorted(os.sched_getaffinity(0))
    assert _workers_on({allowed[0]}) == 1
    if len(allowed) >= 2:
        # Two, unless this machine's container limit (cgroup) allows fewer.
        conf = runpy.run_path(str(GUNICORN_CONF))
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(allowed[:2]))
        assert _workers_on(set(allowed[:2])) == conf["usable_cores"]()


@pytest.mark.parametrize(
    ("cpu_max", "cores"),
    [("max 100000\n", 64), ("150000 100000\n", 2), ("50000 100000\n", 1), ("garbled\n", 64), ("0 0\n", 64)],
)
def test_a_container_cpu_limit_bounds_the_cores_the_gunicorn_config_counts(tmp_path, monkeypatch, cpu_max, cores):
    limit = tmp_path / "cpu.max"
    limit.write_text(cpu_max)
    conf = runpy.run_path(str(GUNICORN_CONF))
    usable_cores = conf["usable_cores"]
    usable_cores.__globals__["CGROUP_CPU_MAX"] = str(limit)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    assert usable_cores() == cores


def test_the_gunicorn_config_starts_at_most_8_processes_by_default():
    default_workers = runpy.run_path(str(GUNICORN_CONF))["default_workers"]
    assert [default_workers(cores) for cores in (1, 3, 8, 64)] == [1, 3, 8, 8]


class _Up:
    """``python -m deploy.local.up`` in a private state folder, its output read line by line."""

    def __init__(self, state_dir: Path, port: int) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY")}
        env.update(UP_STATE_DIR=str(state_dir), PORT=str(port), PYTHONUNBUFFERED="1")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "deploy.local.up"],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.output: list[str] = []
        # A thread drains the pipe: select() on a buffered text pipe misses lines already buffered.
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.process.stdout:
            self._lines.put(line)

    def read_until(self, marker: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.process.poll() is None or not self._lines.empty():
            try:
                line = self._lines.get(timeout=1.0)
            except queue.Empty:
                continue
            self.output.append(line)
            if marker in line:
                return line
        raise AssertionError(f"no {marker!r} in make up's output:\n{''.join(self.output)}")

    def stop(self, signum: int = signal.SIGINT, timeout: float = 90) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signum)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        time.sleep(0.5)  # let the pump thread take the last lines
        while not self._lines.empty():
            self.output.append(self._lines.get())
        return self.process.returncode


@pytest.fixture
def state_dir():
    # World-traversable (PostgreSQL runs as an unprivileged user when we are root); removed after.
    folder = Path(tempfile.mkdtemp(prefix="make-up-test-"))
    folder.chmod(0o755)
    yield folder
    stop_services(folder)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_make_up_serves_a_chat_completion_and_stops_everything_on_ctrl_c(state_dir):
    port = free_port()
    up = _Up(state_dir, port)
    try:
        up.read_until("Ctrl-C stops everything", timeout=480)
        text = "".join(up.output)
        key = re.search(r"API key:\s+(\S+)", text).group(1)
        assert f"Base URL:  http://127.0.0.1:{port}/v1" in text
        assert (state_dir / "demo-key").read_text().strip() == key
        curl_body = re.search(r"-d '(\{.*\})'", text).group(1)

        # What the printed curl line sends, sent here.
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            data=curl_body.encode(),
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            reply = json.load(response)
        assert reply["model"] == "tiny-gemma4"
        assert reply["choices"][0]["message"]["role"] == "assistant"
        assert reply["usage"]["completion_tokens"] > 0

        # An operator's command in a second terminal (no settings exported) works on this stack.
        env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY")}
        created = subprocess.run(
            [sys.executable, "manage.py", "createkey", "demo", "--name", "second-terminal"],
            cwd=REPO_ROOT, env=dict(env, UP_STATE_DIR=str(state_dir)), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert created.returncode == 0, created.stderr
        second_key = created.stdout.strip().splitlines()[-1]
        models = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {second_key}"}
        )
        with urllib.request.urlopen(models, timeout=60) as response:
            assert response.status == 200
    finally:
        code = up.stop(signal.SIGINT)

    assert code == 0, "".join(up.output)
    assert "stopping postgres, redis" in "".join(up.output)
    assert not port_open(port)
    assert stop_services(state_dir) == []  # the embedded servers it started are stopped too
    assert not (state_dir / "up.json").exists()
