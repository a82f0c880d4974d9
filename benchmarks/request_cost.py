"""The serving layer's CPU per request and per token: ``python -m benchmarks.request_cost``.

On a small machine the platform's throughput is bounded by the CPU its serving processes spend
(docs/benchmarks.md: at 32-64 streams the gateway, the worker, Redis and the load generator share
one core), so this measures that cost directly, apart from the engine: the platform on the tiny
model, streamed chat completions, and for each workload the CPU milliseconds per request of the web
processes (gunicorn and its uvicorn workers), the worker process (Celery, the engine's client side,
the relay) and the Redis server (from ``INFO cpu``; shared with anything else on that server).

Two workloads: 1 completion token (what a request costs whatever its length: authentication,
admission, dispatch, the Celery hop, the claim, settlement) and 64 tokens (plus the per-token
relay). Each runs ``--rounds`` times; the figures are the median round. Compare two versions of
the code by running this at each: absolute figures move with the machine, so run them back to back.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import redis

from benchmarks.loadgen import Workload, run_requests
from benchmarks.procs import ROOT
from benchmarks.profiling import CpuMeter, PySpy, hot_functions

MODEL_NAME = "tiny-gemma4"
WORKLOADS = ((1, 16, 320), (64, 32, 256))  # (completion tokens, streams, requests)


def redis_cpu_seconds(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def measure(stack, client: redis.Redis, tokens: int, streams: int, requests: int, first: int) -> dict:
    pids = stack.pids()
    meter = CpuMeter({"web": (pids["platform-web"], "tree"), "worker": (pids["platform-worker"], "self")})
    workload = Workload(MODEL_NAME, prompt_words=100, output_tokens=tokens)
    redis_before = redis_cpu_seconds(client)
    meter.start()
    results, wall = run_requests(stack.base_url, stack.api_key, workload, streams, requests, first_index=first)
    cpu = meter.stop()
    cpu["redis"] = redis_cpu_seconds(client) - redis_before
    failed = sum(1 for r in results if r.error or r.completion_tokens != tokens)
    return {
        "tokens": tokens,
        "streams": streams,
        "requests": requests,
        "failed": failed,
        "wall_s": round(wall, 2),
        "requests_per_s": round(requests / wall, 1),
        "cpu_ms_per_request": {name: round(1000 * seconds / requests, 2) for name, seconds in cpu.items()},
    }


def median_round(rounds: list[dict]) -> dict:
    summary = dict(rounds[0])
    for field in ("wall_s", "requests_per_s"):
        summary[field] = statistics.median(r[field] for r in rounds)
    summary["failed"] = sum(r["failed"] for r in rounds)
    summary["cpu_ms_per_request"] = {
        name: round(statistics.median(r["cpu_ms_per_request"][name] for r in rounds), 2)
        for name in rounds[0]["cpu_ms_per_request"]
    }
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", help="write the results as JSON here too")
    parser.add_argument("--profile", help="py-spy the web and worker processes during the last round into this folder")
    args = parser.parse_args(argv)

    from benchmarks.platform_stack import PlatformStack
    from workers.tinymodel import build_tiny_model

    model_dir = str(build_tiny_model(ROOT / ".run" / "models" / MODEL_NAME))
    results = []
    with PlatformStack(model_dir, MODEL_NAME) as stack:
        client = redis.Redis.from_url(stack.env["REDIS_URL"])
        run_requests(stack.base_url, stack.api_key, Workload(MODEL_NAME, 100, 8), 8, 32, first_index=10**6)
        first = 0
        for tokens, streams, requests in WORKLOADS:
            rounds = []
            for attempt in range(args.rounds):
                spies = []
                if args.profile and attempt == args.rounds - 1:
                    pids = stack.pids()
                    folder = Path(args.profile) / f"{tokens}-tokens"
                    spies = [PySpy("web", pids["platform-web"], folder, subprocesses=True),
                             PySpy("worker", pids["platform-worker"], folder)]  # fmt: skip
                    for spy in spies:
                        spy.start()
                    time.sleep(1.0)  # py-spy attaches before the round starts
                rounds.append(measure(stack, client, tokens, streams, requests, first))
                first += requests
                for spy in spies:
                    print(f"-- {spy.out}")
                    for hot in hot_functions(spy.stop(), top=25):
                        print(f"   {hot.self_pct:5.1f}% self {hot.total_pct:5.1f}% incl  {hot.key}")
            summary = median_round(rounds)
            results.append(summary)
            cost = summary["cpu_ms_per_request"]
            print(
                f"{tokens:>3} tokens, {streams:>2} streams: {summary['requests_per_s']:>6.1f} req/s, "
                f"CPU ms per request: web {cost['web']:.2f}, worker {cost['worker']:.2f}, redis {cost['redis']:.2f}"
                f" (failed {summary['failed']})",
                flush=True,
            )
    if args.out:
        with open(args.out, "w") as out:
            json.dump({"measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "results": results}, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
