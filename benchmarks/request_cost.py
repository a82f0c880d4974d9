"""The serving layer's CPU per request and per token: ``python -m benchmarks.request_cost``.

On a small machine the platform's throughput is bounded by the CPU its serving processes spend
(docs/benchmarks.md: at 32-64 streams the gateway, the worker, Redis and the load generator share
one core), so this measures that cost directly, apart from the engine: the platform on the tiny
model, streamed chat completions, and for each workload the CPU milliseconds per request of the web
processes (gunicorn and its uvicorn workers), the worker process (Celery, the engine's client side,
the relay) and the Redis server (from ``INFO cpu``; shared with anything else on that server).

Two workloads: 1 completion token (what a request costs whatever its length: authentication,
admission, dispatch, the Celery hop, the claim, settlement) and 64 tokens (plus the per-token
relay). Each runs ``--rounds`` times; the figures are the median round. Absolute figures move with
the machine by ±25% within minutes here, so compare versions side by side in one run: with
``--baseline-source DIR`` (a ``git worktree`` of another commit) and/or ``--baseline-env NAME=VALUE``
a second stack runs the baseline, and the two take turns round by round (the other one paused).

    git worktree add /tmp/base HEAD~1
    python -m benchmarks.request_cost --baseline-source /tmp/base --out .run/bench/cost.json
"""

from __future__ import annotations

import argparse
import contextlib
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
BASELINE_DATABASE = "gemma_bench_baseline"
BASELINE_REDIS_DB = 11


def redis_cpu_seconds(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def redis_traffic(client: redis.Redis) -> dict[str, int]:
    """The server's reads (one per client round trip, a pipeline being one) and commands so far, and
    the calls of each command: on a small machine every round trip costs a context switch or two."""
    stats = client.info("stats")
    traffic = {"reads": int(stats["total_reads_processed"]), "commands": int(stats["total_commands_processed"])}
    for name, fields in client.info("commandstats").items():
        traffic[name.removeprefix("cmdstat_")] = int(fields["calls"])
    return traffic


def per_request(before: dict[str, int], after: dict[str, int], requests: int) -> dict[str, float]:
    """What ``after`` adds to ``before``, per request (commands the workload never sent are left out)."""
    counts = {name: (calls - before.get(name, 0)) / requests for name, calls in after.items()}
    return {name: round(count, 2) for name, count in counts.items() if count}


def measure(stack, client: redis.Redis, tokens: int, streams: int, requests: int, first: int) -> dict:
    pids = stack.pids()
    meter = CpuMeter({"web": (pids["platform-web"], "tree"), "worker": (pids["platform-worker"], "self")})
    workload = Workload(MODEL_NAME, prompt_words=100, output_tokens=tokens)
    redis_before, traffic_before = redis_cpu_seconds(client), redis_traffic(client)
    meter.start()
    results, wall = run_requests(stack.base_url, stack.api_key, workload, streams, requests, first_index=first)
    cpu = meter.stop()
    cpu["redis"] = redis_cpu_seconds(client) - redis_before
    # Read before the next round's requests: background work (heartbeats, beat) is counted too.
    redis_per_request = per_request(traffic_before, redis_traffic(client), requests)
    failed = sum(1 for r in results if r.error or r.completion_tokens != tokens)
    return {
        "tokens": tokens,
        "streams": streams,
        "requests": requests,
        "failed": failed,
        "wall_s": round(wall, 2),
        "requests_per_s": round(requests / wall, 1),
        "cpu_ms_per_request": {name: round(1000 * seconds / requests, 2) for name, seconds in cpu.items()},
        "redis_per_request": redis_per_request,
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
    names = {name for r in rounds for name in r["redis_per_request"]}
    summary["redis_per_request"] = {
        name: statistics.median(r["redis_per_request"].get(name, 0.0) for r in rounds) for name in sorted(names)
    }
    return summary


def _pairs(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"expected NAME=VALUE, got {item!r}")
        env[name] = value
    return env


def _report(label: str, summary: dict) -> None:
    cost = summary["cpu_ms_per_request"]
    print(
        f"{label:>9} {summary['tokens']:>3} tokens, {summary['streams']:>2} streams: "
        f"{summary['requests_per_s']:>6.1f} req/s, CPU ms per request: web {cost['web']:.2f}, "
        f"worker {cost['worker']:.2f}, redis {cost['redis']:.2f} (failed {summary['failed']})",
        flush=True,
    )
    traffic = dict(summary["redis_per_request"])
    reads, commands = traffic.pop("reads", 0.0), traffic.pop("commands", 0.0)
    each = ", ".join(f"{name} {count:g}" for name, count in sorted(traffic.items(), key=lambda item: -item[1]))
    print(f"{'':>9} Redis per request: {reads:g} round trips, {commands:g} commands ({each})", flush=True)


def _profiled(stack, folder: Path) -> list[PySpy]:
    pids = stack.pids()
    spies = [
        PySpy("web", pids["platform-web"], folder, subprocesses=True),
        PySpy("worker", pids["platform-worker"], folder),
    ]
    for spy in spies:
        spy.start()
    time.sleep(1.0)  # py-spy attaches before the round starts
    return spies


def _print_profiles(spies: list[PySpy]) -> None:
    for spy in spies:
        print(f"-- {spy.out}")
        for hot in hot_functions(spy.stop(), top=25):
            print(f"   {hot.self_pct:5.1f}% self {hot.total_pct:5.1f}% incl  {hot.key}")


class Targets:
    """The stacks measured; with a baseline, only the one taking its turn runs (the other is paused,
    SIGSTOP) and the rounds alternate, so a machine that slows down or speeds up during the run
    does so for both alike."""

    def __init__(self, stacks: dict) -> None:
        self.stacks = stacks
        self.paused = len(stacks) > 1
        self.clients = {label: redis.Redis.from_url(stack.env["REDIS_URL"]) for label, stack in stacks.items()}
        if self.paused:
            for stack in stacks.values():
                stack.pause()

    @contextlib.contextmanager
    def turn(self, label: str):
        stack = self.stacks[label]
        if self.paused:
            stack.resume()
        try:
            yield stack
        finally:
            if self.paused:
                stack.pause()

    def order(self, attempt: int) -> list[str]:
        return list(self.stacks) if attempt % 2 == 0 else list(reversed(self.stacks))


def start_targets(args: argparse.Namespace, model_dir: str, exits: contextlib.ExitStack) -> Targets:
    from benchmarks.platform_stack import PlatformStack

    stacks = {"current": exits.enter_context(PlatformStack(model_dir, MODEL_NAME, extra_env=_pairs(args.env)))}
    if args.baseline_source is not None or args.baseline_env:
        stacks["current"].pause()  # while the baseline starts
        stacks["baseline"] = exits.enter_context(
            PlatformStack(
                model_dir, MODEL_NAME, extra_env=_pairs(args.baseline_env), database=BASELINE_DATABASE,
                source=Path(args.baseline_source or ROOT), redis_db=BASELINE_REDIS_DB, label="baseline",
            )
        )  # fmt: skip
        stacks["current"].resume()
    return Targets(stacks)


def run_workload(targets: Targets, args: argparse.Namespace, workload: tuple[int, int, int], first: int) -> dict:
    """Every round of one workload on every target; the median round per target."""
    tokens, streams, requests = workload
    rounds: dict[str, list] = {label: [] for label in targets.stacks}
    for attempt in range(args.rounds):
        for label in targets.order(attempt):
            with targets.turn(label) as stack:
                profiled = args.profile and attempt == args.rounds - 1
                spies = _profiled(stack, Path(args.profile) / f"{label}-{tokens}-tokens") if profiled else []
                rounds[label].append(measure(stack, targets.clients[label], tokens, streams, requests, first))
                first += requests
                _print_profiles(spies)
    return {label: median_round(measured) for label, measured in rounds.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", help="write the results as JSON here too")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="for the platform under test")
    parser.add_argument(
        "--baseline-source", help="a checkout of another version (git worktree): measured too, round by round"
    )
    parser.add_argument("--baseline-env", action="append", default=[], metavar="NAME=VALUE", help="for the baseline")
    parser.add_argument("--profile", help="py-spy the web and worker processes during the last round into this folder")
    args = parser.parse_args(argv)

    from workers.tinymodel import build_tiny_model

    model_dir = str(build_tiny_model(ROOT / ".run" / "models" / MODEL_NAME))
    results: dict[str, list] = {}
    with contextlib.ExitStack() as exits:
        targets = start_targets(args, model_dir, exits)
        for label in targets.stacks:
            with targets.turn(label) as stack:  # warm-up
                run_requests(stack.base_url, stack.api_key, Workload(MODEL_NAME, 100, 8), 8, 32, first_index=10**6)
        for number, workload in enumerate(WORKLOADS):
            for label, summary in run_workload(targets, args, workload, first=number * 10**5).items():
                results.setdefault(label, []).append(summary)
                _report(label, summary)
    if args.out:
        with open(args.out, "w") as out:
            measured = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
            json.dump({"measured_at": measured, "args": vars(args), "results": results}, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
