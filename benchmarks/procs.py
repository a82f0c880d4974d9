"""Child processes of the benchmark: started in their own session, logged to a file, stopped as a group."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STATE_DIR = ROOT / ".run" / "bench"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http_status(url: str, headers: dict | None = None, timeout: float = 3) -> int | None:
    """The HTTP status of a GET (None when nothing answers)."""
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 (local URLs only)
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return None


def frontend_cpus() -> set[int] | None:
    """BENCH_FRONTEND_CPUS (e.g. "1"; default "1" on a 2-core machine, "" turns it off): the cores
    every serving process is pinned to, None for none.

    vLLM's CPU backend binds its model worker to core 0 here and reserves core 1 for the rest
    (its scheduler process busy-polls there with sched_yield). Pinning the serving processes (the
    bare server's API process, LiteLLM, gunicorn, the Celery worker) to the reserved core keeps
    them from preempting the model's compute thread, which does not yield. Applied to every target
    alike; the engine's model worker re-pins itself to its own core.
    """
    raw = os.environ.get("BENCH_FRONTEND_CPUS")
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
    Now a process that hosts an engine starts unpinned with its OpenMP threads bound to the other
    cores, and its serving threads are pinned once it is up (``Child.pin_serving_threads``); the
    same for every target. Empty when nothing is pinned (vLLM's own choice stands).
    """
    pinned = frontend_cpus()
    if not pinned:
        return {}
    compute = sorted(set(range(os.cpu_count() or 1)) - pinned)
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, compute))} if compute else {}


class Child:
    """One service process. Its output goes to ``STATE_DIR/logs/<name>.log``."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], cwd: Path = ROOT,
                 hosts_engine: bool = False) -> None:  # fmt: skip
        self.name, self.argv, self.env, self.cwd = name, argv, env, cwd
        self.cpus = frontend_cpus()
        # A process that starts a vLLM engine is pinned only once the engine runs (see engine_cpu_env).
        self.hosts_engine = hosts_engine
        self.log_path = STATE_DIR / "logs" / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> Child:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            # An engine host starts on every core (not the bench's own pinned set, which it would
            # inherit) so that its engine can bind to the compute cores.
            cpus = set(range(os.cpu_count() or 1)) if self.hosts_engine and self.cpus else self.cpus
            self.proc = subprocess.Popen(
                self.argv,
                cwd=self.cwd,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,  # noqa: PLW1509
            )
        return self

    def pin_serving_threads(self) -> None:
        """Pin every thread of this process and its children to the serving cores, and those of
        its vLLM engine processes (and their children) to the other cores."""
        if not self.cpus or self.proc is None:
            return
        import psutil

        compute = set(range(os.cpu_count() or 1)) - self.cpus or self.cpus

        def pin(proc: psutil.Process, cpus: set[int]) -> None:
            if proc.name().startswith("VLLM::"):
                cpus = compute
            for thread in proc.threads():
                with contextlib.suppress(ProcessLookupError):
                    os.sched_setaffinity(thread.id, cpus)
            for child in proc.children():
                pin(child, cpus)

        pin(psutil.Process(self.pid), self.cpus)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait_http(self, url: str, timeout: float, headers: dict | None = None) -> None:
        """Wait until GET ``url`` answers 200; fails early if the process exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            if http_status(url, headers) == 200:
                return
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} did not answer {url} within {timeout:.0f} s:\n{self.log_tail()}")

    def pause(self) -> None:
        """SIGSTOP the whole process group (the engine's processes included): it uses no CPU until resumed."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM the process group, SIGKILL it after ``timeout`` seconds."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            os.killpg(proc.pid, signal.SIGCONT)  # a paused group acts on SIGTERM only once resumed
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass


def children_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc), e.g. gunicorn's workers."""
    try:
        tasks = Path(f"/proc/{pid}/task").iterdir()
        found: list[int] = []
        for task in tasks:
            found += [int(p) for p in (task / "children").read_text().split()]
        return found
    except OSError:
        return []
