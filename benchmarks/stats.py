"""Summary statistics of one load level: throughput, TTFT and inter-token latency percentiles.

Definitions (the same for every target, so the ratios compare like with like):

- output tokens/s: completion tokens of the successful requests (as the server's usage reports
  them) divided by the level's wall time, first request sent to last response ended;
- TTFT: request sent to the first SSE chunk that carries completion text;
- ITL: per request, (last text chunk - first text chunk) / (completion tokens - 1), i.e. the mean
  time between tokens as a reader of the stream sees it (vLLM's benchmark calls it TPOT). A server
  that sends several tokens per chunk is neither rewarded nor penalised by the chunking itself;
- chunk gap p99: the 99th percentile of the gaps between successive text chunks of all requests,
  the stall a reader feels (coalescing servers have larger gaps, with several tokens each).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between ranks (numpy's default); None if empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    if low == high:
        return float(ordered[low])
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class RequestResult:
    """What one streamed request did, in seconds on the client's monotonic clock."""

    sent_at: float
    ended_at: float
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk with completion text
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the engine served from its prefix cache (usage's details)
    error: str | None = None
    request_id: str | None = None  # the response's X-Request-Id (the platform's ledger row has it)
    headers_at: float | None = None  # when the response headers came (the platform sends them once admitted)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.sent_at if self.chunk_times else None

    @property
    def itl(self) -> float | None:
        if len(self.chunk_times) < 2 or self.completion_tokens < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.completion_tokens - 1)

    def chunk_gaps(self) -> list[float]:
        times = self.chunk_times
        return [later - earlier for earlier, later in zip(times, times[1:], strict=False)]


@dataclass
class LevelSummary:
    """One target at one concurrency level. Latencies in milliseconds; None where nothing was measured."""

    target: str
    concurrency: int
    requests: int
    errors: int
    short: int  # successful requests that returned fewer tokens than asked (ignore_eos not honoured)
    duration_s: float
    output_tok_s: float
    req_s: float
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    chunk_gap_p99_ms: float | None
    mean_prompt_tokens: float
    mean_completion_tokens: float
    first_error: str | None = None
    # Time to first token of the requests each round's clients sent at once when it began (see
    # `first_wave`); None when no wave was given.
    first_wave_ttft_p50_ms: float | None = None
    cpu_s: dict = field(default_factory=dict)  # CPU seconds per process group during the level
    # Output tokens/s of each round on its own (the level pools them): how far the rounds spread.
    round_tok_s: list = field(default_factory=list)
    # With --engine-steps: each round's engine steps (``steps``, ``steps_over_streams``: the mixed
    # ones, ``tokens_per_step``: completion tokens per step), None for a round not counted.
    round_steps: list = field(default_factory=list)
    # Where the platform's time to first token goes, p50 in ms (benchmarks/gpu/measure.py
    # ``ttft_breakdown``), over all the level's requests and over its first waves; None for a
    # target without a ledger.
    ttft_breakdown: dict | None = None
    first_wave_ttft_breakdown: dict | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 2)


def first_wave(results: Sequence[RequestResult], concurrency: int) -> list[RequestResult]:
    """A round's first wave: the `concurrency` requests its clients sent at once when it began. A
    server admits them all together, so their first tokens show what a burst costs it; later requests
    arrive one by one as earlier ones end."""
    return sorted(results, key=lambda r: r.sent_at)[:concurrency]


def summarize(
    target: str, concurrency: int, results: Sequence[RequestResult], duration_s: float, expected_tokens: int,
    first_waves: Sequence[RequestResult] = (),
) -> LevelSummary:  # fmt: skip
    """Aggregate one level's request results (see the module docstring for the definitions);
    `first_waves`: the first wave of each of its rounds (`first_wave`)."""
    ok = [r for r in results if r.ok]
    errors = [r for r in results if not r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [r.itl for r in ok if r.itl is not None]
    gaps = [gap for r in ok for gap in r.chunk_gaps()]
    duration = max(duration_s, 1e-9)
    return LevelSummary(
        target=target,
        concurrency=concurrency,
        requests=len(results),
        errors=len(errors),
        short=sum(1 for r in ok if r.completion_tokens < expected_tokens),
        duration_s=round(duration_s, 3),
        output_tok_s=round(tokens / duration, 1),
        req_s=round(len(ok) / duration, 3),
        ttft_p50_ms=_ms(percentile(ttfts, 50)),
        ttft_p95_ms=_ms(percentile(ttfts, 95)),
        ttft_p99_ms=_ms(percentile(ttfts, 99)),
        itl_p50_ms=_ms(percentile(itls, 50)),
        itl_p99_ms=_ms(percentile(itls, 99)),
        chunk_gap_p99_ms=_ms(percentile(gaps, 99)),
        mean_prompt_tokens=round(sum(r.prompt_tokens for r in ok) / len(ok), 1) if ok else 0.0,
        mean_completion_tokens=round(tokens / len(ok), 1) if ok else 0.0,
        first_error=errors[0].error if errors else None,
        first_wave_ttft_p50_ms=_ms(percentile([r.ttft for r in first_waves if r.ok and r.ttft is not None], 50)),
    )


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator rounded to 3 places; None when either is missing or the denominator is 0."""
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, 3)
