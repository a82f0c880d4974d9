"""The one stack launcher (deploy/local/launcher.py) and the entry points it starts."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploy.local.launcher import (
    CELERY_APP,
    Child,
    Stack,
    beat_command,
    stack_env,
    stop_all,
    web_command,
    worker_command,
)
from deploy.local.services import REPO_ROOT, pid_alive


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    """``code`` in a new interpreter of the venv, started outside the repository."""
    return subprocess.run(
        [sys.executable, "-c", code], cwd="/", env=dict(os.environ, **env), capture_output=True, text=True, timeout=120
    )


def _wait_for(condition, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_every_process_of_the_stack_runs_the_same_commands():
    assert web_command()[1:] == ["-m", "gunicorn", "-c", "deploy/gunicorn.conf.py"]
    worker = worker_command("gpu", "pool.tiny,control", 8)
    assert worker[1:5] == ["-m", "celery", "-A", CELERY_APP] and CELERY_APP == "workers.worker"
    assert worker[worker.index("--pool") + 1] == "threads" and worker[worker.index("-n") + 1] == "gpu@%h"
    assert beat_command(Path("/tmp/schedule"))[4:6] == ["workers.celery_app", "beat"]


def test_the_source_roots_are_on_the_venvs_path_without_pythonpath():
    result = _python("import contract.env, workers.broker, deploy.local.launcher, platform; print(platform.system())",
                     PYTHONPATH="")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "Linux"  # the standard library's platform module, not the source root


def test_the_web_tier_sends_tasks_without_loading_the_worker_runtime():
    code = (
        "import django, json, sys; django.setup(); import gateway.dispatch, workers.celery_app; "
        "runtime = ('workers.serving', 'workers.engine', 'workers.relay'); "
        "print(json.dumps(sorted(m for m in runtime if m in sys.modules)))"
    )
    result = _python(code, DJANGO_SETTINGS_MODULE="config.settings")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []


def test_the_worker_entry_module_is_the_app_with_the_worker_runtime_connected():
    code = (
        "import sys; import workers.worker as entry, workers.celery_app as shared; "
        "from celery.signals import celeryd_after_setup; from workers import serving; "
        "print(entry.app is shared.app, any(r() is serving._start_engine for _, r in celeryd_after_setup.receivers))"
    )
    result = _python(code, DJANGO_SETTINGS_MODULE="config.settings")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True"]


def test_a_child_that_exits_is_reported_with_its_log_while_waiting(tmp_path):
    child = Child("doomed", [sys.executable, "-c", "print('no engine here'); raise SystemExit(3)"], tmp_path / "d.log")
    child.start(dict(os.environ))
    with pytest.raises(RuntimeError, match=r"doomed exited with code 3(.|\n)*no engine here"):
        child.wait_http("http://127.0.0.1:9/healthz", timeout=60)


def test_stopping_a_child_also_stops_what_it_spawned(tmp_path):
    """A child stopped alone (SIGTERM to the leader, as make up does) that leaves a process behind
    (as vLLM's engine core could): the launcher kills its whole group."""
    spawned = tmp_path / "spawned.pid"
    code = (
        "import signal, subprocess, sys, time, pathlib; "
        "p = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)']); "
        f"pathlib.Path({str(spawned)!r}).write_text(str(p.pid)); "
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); time.sleep(600)"
    )
    child = Child("leader", [sys.executable, "-c", code], tmp_path / "leader.log", cwd=REPO_ROOT).start(
        dict(os.environ)
    )
    _wait_for(lambda: spawned.exists() and spawned.read_text(), "the child never spawned its process")
    orphan = int(spawned.read_text())

    killed = stop_all([child], timeout=60, sig=signal.SIGTERM, group=False)

    assert killed == [] and child.poll() == 0  # the leader stopped on SIGTERM by itself
    _wait_for(lambda: not pid_alive(orphan) or _zombie(orphan), "the spawned process outlived the stop")


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return False


def test_a_stack_runs_several_workers_of_one_pool_each_in_its_own_process(tmp_path):
    """The launcher's Stack starts any number of named workers of one pool (a fleet), each with its
    own environment; a name in use is refused. The workers' Celery command line is swapped for a
    process that reports what it was given (``wrap``), so no engine starts."""
    report = (
        "import os, time; print(os.environ['WORKER_POOL'], os.environ['POD_NAME'], os.environ['ROLE'], flush=True); "
        "time.sleep(600)"
    )

    def reporter(argv: list[str]) -> list[str]:
        assert argv[argv.index("-Q") + 1] == "pool.tiny,control"
        return [sys.executable, "-c", report]

    stack = Stack(stack_env("postgres://unused", "redis://unused"), log_dir=tmp_path)
    try:
        for name in ("w0", "w1", "w2"):
            stack.start_worker(name, "tiny", model="m", model_path="/m", pod=name, wrap=reporter, ROLE=f"{name}-role")
        with pytest.raises(ValueError, match="w1"):
            stack.start_worker("w1", "tiny", model="m", model_path="/m", wrap=reporter)
        for name in ("w0", "w1", "w2"):
            line, log = f"tiny {name} {name}-role", tmp_path / f"{name}.log"
            _wait_for(lambda line=line, log=log: line in log.read_text(), f"{name} never reported")
        assert len({child.pid for child in stack.children.values()}) == 3
    finally:
        killed = stack.stop_all(timeout=30)
    assert killed == [] and stack.children == {}
