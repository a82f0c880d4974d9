"""Where the serving layer spends its CPU: process CPU time per level, and py-spy samples.

``CpuMeter`` reads the CPU seconds (user + system) of a set of process trees before and after a
level: on a 2-core machine every CPU second the gateway or worker spends is taken from the engine.
With ``waits=True`` it also reads how long their threads were ready to run but waited for a CPU
(the scheduler's run delay, ``/proc/PID/task/TID/schedstat``): a process that is slower beside
others while its own CPU time is unchanged shows it there.
``PySpy`` records sampled stacks of running processes (``py-spy record --format raw``, collapsed
stacks) and ``hot_functions`` turns them into "file:function, % of samples" tables.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def _processes(pid: int, part: str) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return ([root] if part in ("self", "tree") else []) + (
            root.children(recursive=True) if part in ("children", "tree") else []
        )
    except psutil.NoSuchProcess:
        return []


def cpu_seconds(pid: int, part: str = "tree") -> float:
    """User + system CPU seconds of ``pid`` ("self"), of its live descendants ("children"), or both ("tree")."""
    total = 0.0
    for proc in _processes(pid, part):
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            continue
    return total


def wait_seconds(pid: int, part: str = "tree") -> float:
    """Seconds the threads of the processes (as in ``cpu_seconds``) were runnable but waited for a
    CPU, from the kernel's schedstat (0 where the kernel keeps none). Threads that ended are missed."""
    total = 0
    for proc in _processes(pid, part):
        for path in Path(f"/proc/{proc.pid}/task").glob("*/schedstat"):
            try:
                total += int(path.read_text().split()[1])
            except (OSError, IndexError, ValueError):
                continue
    return total / 1e9


def steal_seconds() -> float:
    """CPU seconds the hypervisor gave to others while this machine's CPUs wanted to run, summed over
    all CPUs (/proc/stat's steal column; 0 outside a VM): the part of a slowdown no process here sees."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


class CpuMeter:
    """CPU seconds spent by named processes between ``start()`` and ``stop()``.

    ``groups`` maps a name to ``(pid, part)`` with part as in ``cpu_seconds``. With ``waits``, each
    group also gets "NAME wait": its threads' seconds waiting for a CPU (``wait_seconds``), and the
    reading gets "steal" (``steal_seconds``).
    """

    def __init__(self, groups: Mapping[str, tuple[int, str]], *, waits: bool = False) -> None:
        self.groups = dict(groups)
        self.waits = waits
        self._before: dict[str, float] = {}

    def _read(self) -> dict[str, float]:
        reading = {name: cpu_seconds(pid, part) for name, (pid, part) in self.groups.items()}
        if self.waits:
            reading.update({f"{name} wait": wait_seconds(pid, part) for name, (pid, part) in self.groups.items()})
            reading["steal"] = steal_seconds()
        return reading

    def start(self) -> None:
        self._before = self._read()

    def stop(self) -> dict[str, float]:
        after = self._read()
        return {name: round(value - self._before.get(name, 0.0), 2) for name, value in after.items()}


def frame_key(frame: str) -> str:
    """``func (path/to/file.py:12)`` → ``path/to/file.py:func`` with site-packages/repo prefixes cut."""
    match = _FRAME.match(frame)
    if not match:
        return frame
    path = match["file"]
    for marker in ("site-packages/", "/lib/python3.11/", "/work/main/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{path}:{match['func']}"


@dataclass
class Hot:
    key: str
    self_pct: float
    total_pct: float


def parse_collapsed(lines: Iterable[str]) -> Counter:
    """Collapsed stacks (``frame;frame;frame count``) → Counter of stack tuples (root first)."""
    stacks: Counter = Counter()
    for line in lines:
        line = line.rstrip("\n")
        if not line:
            continue
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        # py-spy prefixes each stack with the process and thread; those are not code.
        frames = tuple(f for f in stack.split(";") if not f.startswith(("process ", "thread ")))
        stacks[frames] += int(count)
    return stacks


def hot_functions(stacks: Counter, top: int = 15) -> list[Hot]:
    """The functions with the most samples, by self time, with their inclusive share too."""
    total = sum(stacks.values())
    if not total:
        return []
    self_counts: Counter = Counter()
    incl_counts: Counter = Counter()
    for frames, count in stacks.items():
        keys = [frame_key(f) for f in frames]
        if keys:
            self_counts[keys[-1]] += count
        for key in set(keys):
            incl_counts[key] += count
    return [
        Hot(key, round(100 * n / total, 1), round(100 * incl_counts[key] / total, 1))
        for key, n in self_counts.most_common(top)
    ]


def top_inclusive(stacks: Counter, contains: str, top: int = 15) -> list[Hot]:
    """Functions whose key contains ``contains`` (e.g. ``gateway/``), by inclusive share."""
    total = sum(stacks.values()) or 1
    incl: Counter = Counter()
    self_counts: Counter = Counter()
    for frames, count in stacks.items():
        keys = [frame_key(f) for f in frames]
        for key in set(keys):
            if contains in key:
                incl[key] += count
        if keys and contains in keys[-1]:
            self_counts[keys[-1]] += count
    return [
        Hot(key, round(100 * self_counts[key] / total, 1), round(100 * n / total, 1))
        for key, n in incl.most_common(top)
    ]


class PySpy:
    """``py-spy record`` of one process (and optionally its children) for the length of a level."""

    def __init__(self, name: str, pid: int, out_dir: Path, subprocesses: bool = False, rate: int = 250) -> None:
        executable = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        self.out = out_dir / f"{name}.collapsed.txt"
        out_dir.mkdir(parents=True, exist_ok=True)
        # --gil: only the thread holding the GIL is sampled, so the shares are of the Python CPU
        # time (a thread blocked on a socket or a lock costs none and is not counted).
        self.argv = [executable, "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw",
                     "--output", str(self.out), "--nonblocking", "--gil"]  # fmt: skip
        if subprocesses:
            self.argv.append("--subprocesses")
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def stop(self) -> Counter:
        """Stop recording (SIGINT makes py-spy write its output) and return the stacks."""
        import signal

        if self.proc is None:
            return Counter()
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if not self.out.exists():
            return Counter()
        return parse_collapsed(self.out.read_text(errors="replace").splitlines())
