"""``make bench-batching``: 32 requests one after another against the same 32 at once, through the platform.

What concurrency is worth: a worker hosts one vLLM engine and runs many tasks at once, so vLLM's
continuous batching sees concurrent requests together, and 32 concurrent requests finish far faster
than 32 sequential ones. One run starts the whole platform (gunicorn → Redis → Celery worker → vLLM,
tiny model, ``cpu`` profile; see benchmarks/platform_stack.py), then, per round, sends 32 streamed
chat completions of exactly ``--output-tokens`` tokens one at a time, then 32 at once, and prints
both wall times, the throughputs and the speed-up. The end-to-end test
``test_32_concurrent_streams_are_generated_together_by_one_engine`` checks the cause (all 32 in the
engine at one moment) without timing anything; this script measures what it is worth.
"""

from __future__ import annotations

import argparse
import os
import sys

from benchmarks.loadgen import Workload, run_requests
from benchmarks.platform_stack import PlatformStack
from benchmarks.procs import ROOT, frontend_cpus
from benchmarks.stats import summarize

MODEL_NAME = "tiny-gemma4"


def measure(stack: PlatformStack, workload: Workload, requests: int, concurrency: int, first_index: int):
    results, duration = run_requests(stack.base_url, stack.api_key, workload, concurrency, requests, first_index)
    return summarize("platform", concurrency, results, duration, workload.output_tokens)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if frontend_cpus():
        os.sched_setaffinity(0, frontend_cpus())  # the load generator joins the serving processes' cores
    os.environ.setdefault("ENGINE_ENFORCE_EAGER", "false")  # as make bench: the compiled engine
    from workers.tinymodel import build_tiny_model

    model_dir = str(build_tiny_model(ROOT / ".run" / "models" / MODEL_NAME))
    workload = Workload(MODEL_NAME, prompt_words=32, output_tokens=args.output_tokens)
    print(f"{args.requests} x {args.output_tokens} tokens through the platform, {os.cpu_count()} CPU cores", flush=True)
    print("round | sequential s (tok/s) | concurrent s (tok/s) | speed-up | errors", flush=True)
    with PlatformStack(model_dir, MODEL_NAME) as stack:
        measure(stack, Workload(MODEL_NAME, 8, 4), args.requests, args.requests, 10_000)  # warm every web process
        speedups = []
        for round_ in range(1, args.rounds + 1):
            first = round_ * 1000  # distinct prompts per round: no prefix cache hit from an earlier round
            one_by_one = measure(stack, workload, args.requests, 1, first)
            together = measure(stack, workload, args.requests, args.requests, first + args.requests)
            speedup = one_by_one.duration_s / together.duration_s
            speedups.append(speedup)
            print(
                f"{round_} | {one_by_one.duration_s:.2f} ({one_by_one.output_tok_s:.0f}) | "
                f"{together.duration_s:.2f} ({together.output_tok_s:.0f}) | {speedup:.1f}x | "
                f"{one_by_one.errors + together.errors}",
                flush=True,
            )
    print(f"concurrent/sequential speed-up, median of {args.rounds}: {sorted(speedups)[len(speedups) // 2]:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
