"""The benchmark's processes: the platform launcher's children (deploy/local/launcher.py), pinned to cores."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from deploy.local import launcher
from deploy.local.launcher import free_port

__all__ = ["ROOT", "STATE_DIR", "Child", "choose_frontend_cpus", "engine_cpu_env", "free_port", "frontend_cpus"]

ROOT = launcher.REPO_ROOT
STATE_DIR = ROOT / ".run" / "bench"


# The cores chosen with a bench's --frontend-cpus (``choose_frontend_cpus``); None: the default.
_chosen_frontend_cpus: str | None = None


def choose_frontend_cpus(text: str | None) -> None:
    """Pin the serving processes to ``text``'s cores (e.g. "1" or "1,3"; "" pins nothing; None: the
    default of ``frontend_cpus``), for every target started from now on."""
    global _chosen_frontend_cpus
    _chosen_frontend_cpus = text


def frontend_cpus() -> set[int] | None:
    """The cores every serving process is pinned to (``choose_frontend_cpus``; by default core 1 on
    a 2-core machine, none elsewhere), None for none.

    vLLM's CPU backend binds its model worker to core 0 here and reserves core 1 for the rest
    (its scheduler process busy-polls there with sched_yield). Pinning the serving processes (the
    bare server's API process, LiteLLM, gunicorn, the Celery worker) to the reserved core keeps
    them from preempting the model's compute thread, which does not yield. Applied to every target
    alike; the engine's model worker re-pins itself to its own core.
    """
    raw = _chosen_frontend_cpus
    if raw is None and os.cpu_count() == 2:
        raw = "1"  # the 2-core development machine: vLLM computes on core 0 and reserves core 1
    raw = (raw or "").strip()
    return {int(cpu) for cpu in raw.split(",")} if raw else None


def engine_cpu_env() -> dict[str, str]:
    """Where the engines compute when the serving processes are pinned: the other cores.

    Pinning every process of a target to core 1 when it is spawned does not work: an
    engine process inherits it, and vLLM's CPU backend picks its compute cores among the cores
    it may use: it found only core 1 ("Selected CPU core number (1) should be greater than reserved
    CPU core number (1)") and computed there, beside every serving process, leaving core 0 idle.
    So a process that hosts an engine starts unpinned with its OpenMP threads bound to the other
    cores, and its serving threads are pinned once it is up (``Child.pin_serving_threads``); the
    same for every target. Empty when nothing is pinned (vLLM's own choice stands).
    """
    pinned = frontend_cpus()
    if not pinned:
        return {}
    compute = sorted(set(range(os.cpu_count() or 1)) - pinned)
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, compute))} if compute else {}


class Child(launcher.Child):
    """One process of a benchmark target (the platform's launcher's, pinned to the serving cores of
    ``frontend_cpus``). Its output goes to ``STATE_DIR/logs/<name>.log``."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], cwd: Path = ROOT,
                 hosts_engine: bool = False) -> None:  # fmt: skip
        serving = frontend_cpus()
        # A process that starts a vLLM engine is pinned only once the engine runs (see engine_cpu_env):
        # it starts on every core (not the bench's own pinned set, which it would inherit) so that its
        # engine can bind to the compute cores.
        cpus = set(range(os.cpu_count() or 1)) if hosts_engine and serving else serving
        super().__init__(name, argv, STATE_DIR / "logs" / f"{name}.log", env=env, cwd=cwd, cpus=cpus)
        self.serving_cpus = serving

    def pin_serving_threads(self) -> None:
        """Pin every thread of this process and its children to the serving cores, and those of
        its vLLM engine processes (and their children) to the other cores."""
        if not self.serving_cpus or self.process is None:
            return
        import psutil

        compute = set(range(os.cpu_count() or 1)) - self.serving_cpus or self.serving_cpus

        def pin(proc: psutil.Process, cpus: set[int]) -> None:
            if is_engine_process(proc):
                cpus = compute
            pin_threads(proc, cpus)
            for child in proc.children():
                pin(child, cpus)

        pin(psutil.Process(self.pid), self.serving_cpus)


def is_engine_process(proc) -> bool:
    """A vLLM engine process (a ``psutil.Process`` titled ``VLLM::...``: the engine core, and on the
    CPU its model worker)."""
    return proc.name().startswith("VLLM::")


def pin_threads(proc, cpus: set[int]) -> None:
    """Pin every thread of ``proc`` (a ``psutil.Process``) to ``cpus``; a thread that ended is skipped."""
    for thread in proc.threads():
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(thread.id, cpus)
