"""Load shapes and the numbers taken from them, shared by the engine and the platform measurements.

A level is ``streams`` concurrent clients, each sending ``rounds`` requests one after the other
(prompt ``PROMPT_TOKENS`` random token ids, ``OUTPUT_TOKENS`` generated with ``ignore_eos``).
Throughput is all generated tokens over the wall time from the first submission to the last token.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.gpu.plan import PROMPT_TOKENS

# Random prompt ids stay clear of the special tokens (ids 0-3) and of the top of the vocabulary.
PROMPT_ID_LOW, PROMPT_ID_HIGH = 10, 262_000


@dataclass(frozen=True)
class RequestRecord:
    submitted: float  # time.perf_counter() values
    first_token: float | None
    finished: float
    tokens: int


@dataclass(frozen=True)
class LevelResult:
    streams: int
    requests: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    ttft_ms_p50: float | None
    ttft_ms_p90: float | None
    tpot_ms_p50: float | None  # time per output token after the first, per request
    errors: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def prompts(seed: int, count: int, length: int = PROMPT_TOKENS, high: int = PROMPT_ID_HIGH) -> list[list[int]]:
    """``count`` distinct random prompts (distinct, so the prefix cache never shortens a prefill) of
    ids below ``high``."""
    rng = random.Random(seed)
    return [[rng.randrange(PROMPT_ID_LOW, high) for _ in range(length)] for _ in range(count)]


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def summarize(streams: int, records: list[RequestRecord], started: float, errors: int = 0) -> LevelResult:
    """The level's numbers from its requests; ``started`` is when the first request was submitted."""
    tokens = sum(r.tokens for r in records)
    end = max((r.finished for r in records), default=started)
    wall = max(end - started, 1e-9)
    ttft = [(r.first_token - r.submitted) * 1000 for r in records if r.first_token is not None]
    tpot = [
        (r.finished - r.first_token) * 1000 / (r.tokens - 1)
        for r in records
        if r.first_token is not None and r.tokens > 1
    ]
    return LevelResult(
        streams=streams,
        requests=len(records),
        tokens=tokens,
        wall_s=round(wall, 4),
        tokens_per_s=round(tokens / wall, 1),
        ttft_ms_p50=_round(_percentile(ttft, 50)),
        ttft_ms_p90=_round(_percentile(ttft, 90)),
        tpot_ms_p50=_round(_percentile(tpot, 50), 3),
        errors=errors,
    )


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def wait_for_start(barrier_dir: str | os.PathLike, name: str, ok: bool, timeout: float = 900, go: str = "go") -> bool:
    """Say this engine is up (or failed), then wait until the run says go: nothing is measured while
    another engine still compiles, which would take the CPU the measured engine's scheduler needs.
    Returns False if no go (the file named ``go``) came in ``timeout`` seconds."""
    folder = Path(barrier_dir)
    (folder / f"{name}.{'ready' if ok else 'failed'}").touch()
    deadline = time.monotonic() + timeout
    while not (folder / go).exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


@contextmanager
def gpu_turn(lock_path: str | os.PathLike) -> Iterator[float]:
    """Hold the GPU for measuring (an exclusive file lock): engines start side by side, measure one at
    a time. Yields how long the wait for the turn was, in seconds."""
    waited = time.monotonic()
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield time.monotonic() - waited
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def write_json(path: str | os.PathLike, data: dict) -> None:
    """Write atomically: a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)
