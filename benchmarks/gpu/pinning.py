"""Keep the engine cores' CPUs to themselves during a call (``BENCH_ENGINE_CPUS``, e.g. ``0-3``).

vLLM's engine core is one process per engine that schedules every step; on this small model the
host's work per step bounds the step, so its pace follows the CPU it gets. On the bench's machine
the platform's web processes, Redis, PostgreSQL and the clients share the host with both engines,
where a deployment runs the web tier and Redis on other nodes. With ``BENCH_ENGINE_CPUS`` set, once
every engine is up and before any is measured, each engine process (vLLM's ``VLLM::EngineCore``,
its every thread) is pinned to those CPUs and every other process the bench can pin to the rest,
except the processes that started the bench (they outlive the call); both sides of a comparison
get the same treatment (their engine cores measure one at a time). Processes started later inherit
their parent's CPUs.
"""

from __future__ import annotations

import os

import psutil

from benchmarks.procs import is_engine_process, pin_threads


def parse_cpus(text: str) -> set[int]:
    """``0-3,8`` → {0, 1, 2, 3, 8}."""
    cpus: set[int] = set()
    for part in filter(None, (piece.strip() for piece in text.split(","))):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def engine_cpus_from_env(available: set[int]) -> set[int] | None:
    """The CPUs ``BENCH_ENGINE_CPUS`` reserves for the engine cores, or None to pin nothing. Refuses a
    set that leaves no CPU for the rest or names CPUs the machine lacks."""
    text = os.environ.get("BENCH_ENGINE_CPUS", "").strip()
    if not text:
        return None
    cpus = parse_cpus(text)
    if not cpus <= available or not available - cpus:
        raise ValueError(f"BENCH_ENGINE_CPUS={text}: must be a proper subset of the CPUs {sorted(available)}")
    return cpus


def pin_engine_cores(engine_cpus: set[int], available: set[int]) -> dict:
    """Pin every thread of each engine core to ``engine_cpus`` and every other process's threads to
    the other CPUs. Returns what was done, for the call's result."""
    rest = available - engine_cpus
    cores, others = [], 0
    # The processes that started this one (the device's agent among them) outlive the call: pinned,
    # they would hand the CPUs of this call to every later call on the machine.
    ancestors = {parent.pid for parent in psutil.Process().parents()}
    for proc in psutil.process_iter():
        if proc.pid in ancestors:
            continue
        try:
            core = is_engine_process(proc)
        except psutil.Error:  # it ended
            continue
        if _pinned(proc, engine_cpus if core else rest):
            if core:
                cores.append(proc.pid)
            else:
                others += 1
    return {"engine_cpus": sorted(engine_cpus), "engine_core_pids": sorted(cores), "other_processes": others}


def _pinned(proc: psutil.Process, cpus: set[int]) -> bool:
    """Pin every thread of ``proc``; False for a process that cannot be pinned (a kernel thread bound
    to its CPU, one that ended)."""
    try:
        pin_threads(proc, cpus)
    except (psutil.Error, OSError):
        return False
    return True
