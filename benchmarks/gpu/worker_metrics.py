"""The platform's Celery worker with its process's Prometheus metrics served over HTTP (GPU bench).

    python -m benchmarks.gpu.worker_metrics PORT -A workers.worker worker --pool threads ...

Everything after PORT is Celery's own command line. vLLM's engine client records its metrics in the
process that hosts it, here the worker, in Prometheus's default registry; the platform serves none
of them. The platform stage reads them before and after each turn (``read_step_token_counts``), so
that the platform's engine steps are counted as the bare engine's are (engine_bench.py).
"""

from __future__ import annotations

import sys
import urllib.request


def behind_metrics(celery_argv: list[str], port: int) -> list[str]:
    """``celery_argv`` (``python -m celery ...``, deploy/local/launcher.py ``worker_command``) run
    behind this wrapper, its metrics served on ``port``."""
    if celery_argv[1:3] != ["-m", "celery"]:
        raise ValueError(f"not a 'python -m celery' command line: {celery_argv[:3]}")
    return [sys.executable, "-m", "benchmarks.gpu.worker_metrics", str(port), *celery_argv[3:]]


def step_token_counts_from_text(text: str) -> dict[str, float] | None:
    """``bucket_counts`` of a Prometheus text exposition (a /metrics page)."""
    from prometheus_client.parser import text_string_to_metric_families

    return bucket_counts(text_string_to_metric_families(text))


# Keys of ``bucket_counts`` beside the bounds: vLLM's inter-token latency so far (its histogram's sum
# in seconds and its count). vLLM times it with the engine core's own timestamps, so it tells the
# engine's pace apart from the delivery's (worker, Redis, gateway).
ITL_SUM, ITL_COUNT = "itl_sum_s", "itl_count"


def bucket_counts(families) -> dict[str, float] | None:
    """vLLM's histogram of tokens per engine step among Prometheus metric ``families``: the cumulative
    count of steps per upper bound (``le``: "256.0", ..., "+Inf"), plus the inter-token latency's sum
    and count (``ITL_SUM``, ``ITL_COUNT``) where there; None where the histogram is not there."""
    counts: dict[str, float] = {}
    itl: dict[str, float] = {}
    for family in families:
        if "iteration_tokens" in family.name:
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    bound = sample.labels["le"]
                    counts[bound] = counts.get(bound, 0.0) + sample.value
        elif "inter_token_latency" in family.name:
            for sample in family.samples:
                for suffix, key in (("_sum", ITL_SUM), ("_count", ITL_COUNT)):
                    if sample.name.endswith(suffix):
                        itl[key] = itl.get(key, 0.0) + sample.value
    return {**counts, **itl} if counts else None


def read_step_token_counts(port: int, timeout: float = 5.0) -> dict[str, float] | None:
    """The histogram of tokens per engine step on the local /metrics page at ``port`` (this wrapper's,
    or vLLM's own server's), None if it cannot be read (the turn is measured anyway, without its steps)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as response:
            return step_token_counts_from_text(response.read().decode())
    except (OSError, ValueError):
        return None


def main(argv: list[str]) -> None:
    from prometheus_client import start_http_server

    start_http_server(int(argv[0]), addr="127.0.0.1")
    from celery.__main__ import main as celery_main

    sys.argv = ["celery", *argv[1:]]
    celery_main()


if __name__ == "__main__":
    main(sys.argv[1:])
