"""deploy/gunicorn.conf.py's default number of web processes: one per core the server may use."""

import importlib.util
import os
import subprocess
import sys

import pytest

from deploy.local.services import REPO_ROOT

CONF = REPO_ROOT / "deploy" / "gunicorn.conf.py"


def _load_conf():
    spec = importlib.util.spec_from_file_location("gunicorn_conf", CONF)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _workers_on(cores: set[int], **env: str) -> int:
    """`workers` as gunicorn reads it in a process that may run only on `cores`."""
    code = (
        f"import os, runpy; os.sched_setaffinity(0, {sorted(cores)!r}); print(runpy.run_path({str(CONF)!r})['workers'])"
    )
    environ = {k: v for k, v in os.environ.items() if k != "WEB_CONCURRENCY"} | env
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, check=True)
    return int(result.stdout)


def test_one_web_process_per_core_the_server_may_use(monkeypatch):
    assert _workers_on({0}) == 1
    if len(os.sched_getaffinity(0)) >= 2:
        # Two, unless this machine's own container limit allows fewer.
        conf = _load_conf()
        monkeypatch.setattr(conf.os, "sched_getaffinity", lambda pid: {0, 1})
        assert _workers_on({0, 1}) == conf.usable_cores()


def test_web_concurrency_overrides_the_default():
    assert _workers_on({0}, WEB_CONCURRENCY="3") == 3


@pytest.mark.parametrize(
    ("cpu_max", "expected"),
    [("max 100000\n", 64), ("150000 100000\n", 2), ("50000 100000\n", 1), ("garbled\n", 64)],
)
def test_a_container_cpu_limit_bounds_the_cores(tmp_path, monkeypatch, cpu_max, expected):
    conf = _load_conf()
    limit = tmp_path / "cpu.max"
    limit.write_text(cpu_max)
    monkeypatch.setattr(conf, "CGROUP_CPU_MAX", str(limit))
    monkeypatch.setattr(conf.os, "sched_getaffinity", lambda pid: set(range(64)))
    assert conf.usable_cores() == expected


def test_the_default_is_capped():
    conf = _load_conf()
    assert [conf.default_workers(cores) for cores in (1, 3, 8, 64)] == [1, 3, 8, 8]
