"""The GPU bench's CPUs kept for the engine cores (benchmarks/gpu/pinning.py)."""

import os
import subprocess
import sys

import psutil
import pytest

from benchmarks.gpu import pinning

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]
# A process titled as vLLM titles its engine core (15 characters: the kernel's limit for a name).
TITLE_AND_SLEEP = "open('/proc/self/comm', 'w').write('VLLM::EngineCor'); import time; time.sleep(60)"
ENGINE_CORE = [sys.executable, "-c", TITLE_AND_SLEEP]


def test_cpu_lists_read_as_the_kernel_writes_them():
    assert pinning.parse_cpus("0-3,8") == {0, 1, 2, 3, 8}
    assert pinning.parse_cpus(" 5 ") == {5}
    assert pinning.parse_cpus("") == set()


def test_nothing_is_pinned_unless_asked(monkeypatch):
    monkeypatch.delenv("BENCH_ENGINE_CPUS", raising=False)
    assert pinning.engine_cpus_from_env({0, 1, 2, 3}) is None
    monkeypatch.setenv("BENCH_ENGINE_CPUS", "0-1")
    assert pinning.engine_cpus_from_env({0, 1, 2, 3}) == {0, 1}


@pytest.mark.parametrize("cpus", ["0-3", "2-5"])
def test_a_set_leaving_no_cpu_for_the_rest_or_naming_missing_cpus_is_refused(monkeypatch, cpus):
    monkeypatch.setenv("BENCH_ENGINE_CPUS", cpus)
    with pytest.raises(ValueError, match="proper subset"):
        pinning.engine_cpus_from_env({0, 1, 2, 3})


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin to one")
def test_every_thread_of_a_pinned_process_runs_on_the_given_cpus():
    threaded = "import threading, time; [threading.Thread(target=time.sleep, args=(60,)).start() for _ in range(3)]"
    proc = subprocess.Popen([sys.executable, "-c", threaded + "; time.sleep(60)"])
    try:
        process = psutil.Process(proc.pid)
        cpu = min(os.sched_getaffinity(0))
        while len(process.threads()) < 4:  # the main thread and its three
            pass
        assert pinning._pinned(process, {cpu})
        assert {frozenset(os.sched_getaffinity(thread.id)) for thread in process.threads()} == {frozenset({cpu})}
    finally:
        proc.kill()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_engine_cores_get_their_cpus_others_the_rest_and_the_processes_that_started_the_bench_keep_theirs(
    monkeypatch,
):
    engine_cpu, *rest = sorted(os.sched_getaffinity(0))
    parent = psutil.Process().parent()
    parent_cpus = os.sched_getaffinity(parent.pid)
    core = subprocess.Popen(ENGINE_CORE)
    other = subprocess.Popen(SLEEPER)
    try:
        while psutil.Process(core.pid).name() != "VLLM::EngineCor":  # its title set
            pass
        processes = [parent, psutil.Process(core.pid), psutil.Process(other.pid)]
        monkeypatch.setattr(pinning.psutil, "process_iter", lambda: iter(processes))
        done = pinning.pin_engine_cores({engine_cpu}, {engine_cpu, *rest})
        assert done == {"engine_cpus": [engine_cpu], "engine_core_pids": [core.pid], "other_processes": 1}
        assert os.sched_getaffinity(core.pid) == {engine_cpu}
        assert os.sched_getaffinity(other.pid) == set(rest)
        assert os.sched_getaffinity(parent.pid) == parent_cpus
    finally:
        core.kill()
        other.kill()
