"""Load shapes and the numbers taken from them, shared by the engine and the platform measurements.

A level is ``streams`` concurrent clients, each sending requests one after the other (prompt
``PROMPT_TOKENS`` random token ids, ``OUTPUT_TOKENS`` generated with ``ignore_eos``) for about the
level's seconds (``plan.level_seconds``): a client sends another request only while the last one's
duration still fits in the level's time, so the level ends close to it, tail included.
Throughput is all generated tokens over the wall time from the first submission to the last token.

Clients stop at different times, so a level ends with fewer streams than it names: at 128 streams
and ~3.6 s a request, a 30 s level is 7 or 8 waves of requests, and a side whose requests take 5%
longer can lose most of its last wave (the bare engine fitting 8 full waves, the platform 7 and a
fifth of the 8th, 0.89 of bare where the requests' durations were 0.95 of it). The throughput at
full concurrency is free of that step: the tokens generated until the first client stops, over that
time (each request's tokens after its first counted at a constant rate up to its end).

Where the two sides take turns at a level (``Turns`` with a turn order), only a level's first turn
is timed that way: each client of the later turns, on either side, sends exactly as many requests as
it did in the first (``Turns.request_counts``), so both sides do the same work and their throughputs
compare their wall times. Timed turns alone let a level's sides differ by a whole wave: on
2026-12-03 a 256-stream turn of bare fitted two waves of requests in 15 s, the platform's one, and
the ramp at a turn's start weighs twice as much in one wave as in two.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from benchmarks.gpu.plan import PROMPT_TOKENS
from benchmarks.gpu.worker_metrics import ITL_COUNT, ITL_SUM

# Random prompt ids stay clear of the special tokens (ids 0-3) and of the top of the vocabulary.
PROMPT_ID_LOW, PROMPT_ID_HIGH = 10, 262_000


@dataclass(frozen=True)
class RequestRecord:
    submitted: float  # time.perf_counter() values
    first_token: float | None
    finished: float
    tokens: int
    request_id: str | None = None  # the platform's X-Request-Id: its ledger row holds the worker's times
    headers: float | None = None  # when the platform's response headers came (it sends them once admitted)
    client: int | None = None  # which of the level's clients sent it (drive sets it)


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
    # A slow minority (a window where every stream slowed down) shows here, not in the medians.
    tpot_ms_p90: float | None = None
    duration_s_p50: float | None = None  # request sent to its end
    duration_s_max: float | None = None
    # Most requests generating at one moment (between first token and end): the batch the engine
    # really ran, which max_num_seqs or a full KV cache (preemption) can hold below ``streams``.
    max_generating: int | None = None
    # Tokens/s until the first client stopped sending, and that time (module docstring).
    full_tokens_per_s: float | None = None
    full_s: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def prompts(seed: int, count: int, length: int = PROMPT_TOKENS, high: int = PROMPT_ID_HIGH) -> list[list[int]]:
    """``count`` distinct random prompts (distinct, so the prefix cache never shortens a prefill) of
    ids below ``high``."""
    rng = random.Random(seed)
    return [[rng.randrange(PROMPT_ID_LOW, high) for _ in range(length)] for _ in range(count)]


def prompt(seed: int, stream: int, index: int, length: int = PROMPT_TOKENS, high: int = PROMPT_ID_HIGH) -> list[int]:
    """The ``index``-th prompt of client ``stream`` (deterministic, distinct between requests)."""
    rng = random.Random(f"{seed}/{stream}/{index}")
    return [rng.randrange(PROMPT_ID_LOW, high) for _ in range(length)]


async def drive(streams: int, seconds: float, one_request: Callable[[int, int], Awaitable[RequestRecord]],
                counts: list[int] | None = None) -> tuple[list[RequestRecord], float, list[str]]:  # fmt: skip
    """Run ``streams`` clients for about ``seconds``: client ``i`` awaits ``one_request(i, n)`` for
    n = 0, 1, ... and starts another only while ``elapsed + its last request's duration`` stays within
    ``seconds`` (every client sends at least one: ``seconds`` 0 is one each). With ``counts``,
    client ``i`` sends exactly ``counts[i]`` requests instead, whatever the time. A request that
    raises is counted as an error and ends that client. Returns (records, start time, error texts)."""
    records: list[RequestRecord] = []
    errors: list[str] = []
    started = time.perf_counter()

    def more(i: int, sent: int, last_started: float) -> bool:
        if counts is not None:
            return sent < counts[i]
        now = time.perf_counter()
        return now - started + (now - last_started) <= seconds

    async def client(i: int) -> None:
        n = 0
        while True:
            t0 = time.perf_counter()
            try:
                records.append(replace(await one_request(i, n), client=i))
            except Exception as exc:  # counted and reported; the level's numbers say how many failed
                errors.append(f"{type(exc).__name__}: {exc}")
                return
            n += 1
            if not more(i, n, t0):
                return

    await asyncio.gather(*(client(i) for i in range(streams)))
    return records, started, errors


def max_generating(records: list[RequestRecord]) -> int:
    """Most requests between their first token and their end at one moment."""
    events = sorted(
        [(r.first_token, 1) for r in records if r.first_token is not None]
        + [(r.finished, -1) for r in records if r.first_token is not None]
    )
    peak = now = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return peak


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
    durations = [r.finished - r.submitted for r in records]
    full = full_concurrency(records, started)
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
        max_generating=max_generating(records),
        tpot_ms_p90=_round(_percentile(tpot, 90), 3),
        duration_s_p50=_round(_percentile(durations, 50), 3),
        duration_s_max=_round(max(durations), 3) if durations else None,
        full_tokens_per_s=_round(full[0] / full[1]) if full else None,
        full_s=_round(full[1], 3) if full else None,
    )


def full_concurrency(records: list[RequestRecord], started: float) -> tuple[float, float] | None:
    """(tokens generated, seconds) from ``started`` until the first client's last request ended,
    while every client was still sending; None without the records' clients."""
    last_end: dict[int, float] = {}
    for r in records:
        if r.client is None:
            return None
        last_end[r.client] = max(last_end.get(r.client, r.finished), r.finished)
    if not last_end:
        return None
    until = min(last_end.values())
    if until <= started:
        return None
    tokens = 0.0
    for r in records:
        if r.first_token is None or r.tokens < 1 or r.first_token > until:
            continue
        later = r.tokens - 1
        span = r.finished - r.first_token
        share = 1.0 if span <= 0 else min(1.0, (until - r.first_token) / span)
        tokens += 1 + later * share
    return tokens, until - started


def ttft_breakdown(records: list[RequestRecord], worker_times: dict[str, tuple[int, int | None]]) -> dict:
    """Where the platform's time to first token goes (p50 over the level's requests, ms), from the
    worker's times in each request's ledger row (``worker_times``: request id -> (queue_ms, ttft_ms)):
    ``queue`` from admission to the worker starting it (the Celery hop and the claim), ``engine`` from
    there to the engine's first token, ``rest`` the client's time to first token minus both. When
    the records carry the time the response headers came (sent once the request is admitted),
    ``rest`` is split into ``gateway`` (request sent to headers: authentication, validation,
    admission, enqueue) and ``relay`` (what is left: the first token's way back to the client)."""
    queue, engine, rest, gateway, relay = [], [], [], [], []
    for record in records:
        times = worker_times.get(record.request_id or "")
        if record.first_token is None or times is None or times[1] is None:
            continue
        queue_ms, ttft_ms = times[:2]
        queue.append(queue_ms)
        engine.append(ttft_ms)
        rest.append((record.first_token - record.submitted) * 1000 - queue_ms - ttft_ms)
        if record.headers is not None:
            gateway.append((record.headers - record.submitted) * 1000)
            relay.append(rest[-1] - gateway[-1])
    return {
        "requests": len(queue),
        "queue_ms_p50": _round(_percentile(queue, 50)),
        "engine_ttft_ms_p50": _round(_percentile(engine, 50)),
        "rest_ms_p50": _round(_percentile(rest, 50)),
        "gateway_ms_p50": _round(_percentile(gateway, 50)),
        "relay_ms_p50": _round(_percentile(relay, 50)),
    }


def slowest_request(records: list[RequestRecord], worker_times: dict[str, tuple]) -> dict | None:
    """The level's longest request, timed by the client and by its ledger row (``worker_times``:
    request id -> (queue_ms, ttft_ms, total_ms)): where an outlier's time went. ``worker_total_ms``
    runs from admission to the worker's end; the client's ``duration_ms`` minus it is the way in
    before admission and the end's way back."""
    done = [record for record in records if record.first_token is not None]
    if not done:
        return None
    record = max(done, key=lambda r: r.finished - r.submitted)
    slowest = {
        "request_id": record.request_id,
        "duration_ms": _round((record.finished - record.submitted) * 1000),
        "ttft_ms": _round((record.first_token - record.submitted) * 1000),
        "headers_ms": _round((record.headers - record.submitted) * 1000) if record.headers is not None else None,
    }
    times = worker_times.get(record.request_id or "")
    if times is not None:
        slowest.update(zip(("queue_ms", "engine_ttft_ms", "worker_total_ms"), times, strict=False))
    return slowest


def ledger_worker_times(database_url: str, request_ids: list[str], timeout_s: float = 30.0) -> dict:
    """The worker's times of each request in the platform's ledger: request id -> (queue_ms, ttft_ms,
    total_ms).

    The gateway writes a request's row in its next batch after the stream ends (the periodic flush
    catches any it missed), so this waits up to ``timeout_s`` for every row; rows still missing then
    are left out."""
    import psycopg

    deadline = time.monotonic() + timeout_s
    with psycopg.connect(database_url) as conn:
        while True:
            rows = conn.execute(
                "SELECT request_id, queue_ms, ttft_ms, total_ms FROM ledger_usagerecord WHERE request_id = ANY(%s)",
                (request_ids,),
            ).fetchall()
            if len(rows) >= len(request_ids) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    return {request_id: (queue_ms, ttft_ms, total_ms) for request_id, queue_ms, ttft_ms, total_ms in rows}


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


def read_scale(barrier_dir: str | os.PathLike) -> float:
    """The factor (at most 1) run.py wrote for every level's seconds, so that all measurements end
    before the call's deadline after a slow start; 1 when none was written."""
    try:
        return max(0.05, min(1.0, float(Path(barrier_dir, "scale").read_text())))
    except (OSError, ValueError):
        return 1.0


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


TURN_ORDER_FILE = "turns.json"


def turn_seed(seed: int, levels: list[int], index: int) -> int:
    """The prompts' seed for turn ``index`` of ``levels``: a level's later turns get prompts of their
    own, or the prefix cache would hand them the earlier turns' prefills."""
    return seed + 100_003 * levels[:index].count(levels[index])


def engine_steps(before: dict[str, float] | None, after: dict[str, float] | None, streams: int) -> dict | None:
    """The engine steps between two readings of vLLM's histogram of tokens per step (cumulative
    counts per upper bound, ``le``): how many, and how many had more tokens than the level's streams
    (a full batch of decodes plus prefill tokens: a mixed step), where the histogram has that bound;
    and the engine's mean time between a request's tokens (``itl_ms_mean``, by the engine core's
    clock) where the readings have vLLM's inter-token latency (worker_metrics.bucket_counts)."""
    if not before or not after or "+Inf" not in after:
        return None
    steps = after["+Inf"] - before.get("+Inf", 0.0)
    bound = f"{float(streams)}"
    out = {"steps": int(steps)}
    if bound in after:
        out["steps_over_streams"] = int(steps - (after[bound] - before.get(bound, 0.0)))
    gaps = after.get(ITL_COUNT, 0.0) - before.get(ITL_COUNT, 0.0)
    if gaps > 0:
        out["itl_ms_mean"] = round(1000 * (after[ITL_SUM] - before.get(ITL_SUM, 0.0)) / gaps, 3)
    return out


def turn_order(sides: list[str], levels: int) -> list[str]:
    """The turns of a comparison, ``side:level`` in the order they run: every level once per side,
    the sides alternating level by level and taking the first place in turn (A B, B A, A B, ...),
    so a machine that slows down or speeds up during the call weighs on both sides alike."""
    order: list[str] = []
    for level in range(levels):
        ranked = sides if level % 2 == 0 else sides[::-1]
        order += [f"{side}:{level}" for side in ranked]
    return order


class Turns:
    """When a run may measure: the GPU lock for all its levels, or its place in a turn order.

    Without a turn order naming the run (``turns.json`` in the barrier folder, written by run.py)
    the run holds the exclusive GPU lock (``gpu_turn``) from ``__enter__`` to ``__exit__``, as every
    stage but the platform comparison does. With one, each level is a turn (``level(i)``): it waits
    until every earlier turn is done or its run has ended (``NAME.ended``, marked on ``__exit__`` and
    by run.py for a process that exited, or ``NAME.failed``, a run that never started), so a side
    that crashed holds nobody up; then it measures. ``waited`` is the seconds spent waiting.
    """

    def __init__(self, barrier_dir: str | os.PathLike, name: str, lock_path: str | os.PathLike,
                 timeout: float = 1800) -> None:  # fmt: skip
        self.folder, self.name, self.lock_path, self.timeout = Path(barrier_dir), name, lock_path, timeout
        try:
            order = json.loads((self.folder / TURN_ORDER_FILE).read_text())
        except (OSError, ValueError):
            order = []
        self.order: list[str] = order if any(turn.startswith(f"{name}:") for turn in order) else []
        self.waited = 0.0
        self._held = ExitStack()

    def __enter__(self) -> Turns:
        if not self.order:
            self.waited += self._held.enter_context(gpu_turn(self.lock_path))
        return self

    def __exit__(self, *exc_info) -> None:
        (self.folder / f"{self.name}.ended").touch()
        self._held.close()

    def wait(self, index: int) -> None:
        """Block until level ``index`` may be measured (at once when there is no turn order)."""
        turn = f"{self.name}:{index}"
        if turn not in self.order:
            return
        started = time.monotonic()
        for earlier in self.order[: self.order.index(turn)]:
            owner = earlier.rsplit(":", 1)[0]
            marks = [self.folder / f"{earlier}.done", self.folder / f"{owner}.ended", self.folder / f"{owner}.failed"]
            while not any(mark.exists() for mark in marks):
                if time.monotonic() - started > self.timeout:
                    raise TimeoutError(f"turn {earlier} did not end in {self.timeout:.0f} s")
                time.sleep(0.2)
        self.waited += time.monotonic() - started

    def done(self, index: int) -> None:
        """Level ``index`` is measured: the next turn may start."""
        if f"{self.name}:{index}" in self.order:
            (self.folder / f"{self.name}:{index}.done").touch()

    def request_counts(self, streams: int) -> list[int] | None:
        """What each client sent in this stream count's first turn, for a later turn to send the same
        (module docstring); None for the first turn, or without a turn order (a timed level)."""
        try:
            return json.loads((self.folder / f"counts-{streams}.json").read_text()) if self.order else None
        except (OSError, ValueError):
            return None

    def keep_request_counts(self, streams: int, records: list[RequestRecord]) -> None:
        """After a turn: the first at this stream count sets the requests per client of the later ones."""
        path = self.folder / f"counts-{streams}.json"
        if self.order and not path.exists():
            sent = [0] * streams
            for record in records:
                if record.client is not None:
                    sent[record.client] += 1
            write_json(path, sent)

    @contextmanager
    def level(self, index: int) -> Iterator[None]:
        self.wait(index)
        try:
            yield
        finally:
            self.done(index)


def partial(result: dict, planned_turns: int) -> dict:
    """``result`` as it stands after a turn, marked as such: written after every turn, so that a side
    stopped at the call's deadline still leaves the turns it measured (the finished result, written
    last, has no mark). The report names such a side as cut short."""
    levels = list(result.get("levels", []))
    return {**result, "levels": levels, "partial": f"{len(levels)} of {planned_turns} turns"}


def write_json(path: str | os.PathLike, data: dict | list) -> None:
    """Write atomically: a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)
