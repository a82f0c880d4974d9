"""``make bench``: the platform against the bare vLLM server and a LiteLLM proxy, same workload.

One invocation starts, one after the other, and measures (the machine has 2 cores):

1. the bare engine, vLLM's own OpenAI server with the ``cpu`` engine profile, on the tiny model;
2. a LiteLLM proxy (master-key mode, see benchmarks/litellm_proxy.py) in front of that same server;
3. the platform: gunicorn → Redis → Celery worker hosting the same engine, with a tenant's key.

Each target gets a warm-up, then, per concurrency level (1, 8, 32, 64 streams), a fixed number of
streamed chat completions with a fixed prompt length and exactly ``output_tokens`` completion tokens
(``ignore_eos``), in rounds: the targets take turns and the ones not being measured are paused
(SIGSTOP), so only one engine runs at a time and background load falls on all alike; each turn
starts with a few unmeasured short requests (caches expired while paused). Results:
docs/benchmarks.md (between its generated-section markers) and docs/benchmarks-cpu.png; the raw
numbers as JSON in .run/bench/. The last line printed is ``platform/bare throughput at 32 streams: R``.

``--quick`` (``make bench ARGS=--quick``) is the short run (about 4 minutes here; under 20 in all
cases). ``--frontend-cpus`` pins the serving processes and the load generator (default: core 1 on a
2-core machine, the core vLLM's CPU backend leaves to them; see benchmarks/procs.py).
ENGINE_ENFORCE_EAGER defaults to false here (compiled engine, ~3x faster decode: the harder case
for a serving layer, whose per-token work then weighs more), as the cpu profile suggests for
benchmarks. The platform's own settings (WEB_CONCURRENCY, GATEWAY_THREADS, ...) pass through the
environment or ``--platform-env NAME=VALUE``. ``--engine-steps`` turns vLLM's
statistics on in both engines and counts each round's engine steps (how full the engine's batch
was: completion tokens per step, and the steps that mixed a prefill in). For the platform, each
level's time to first token is also split by its ledger's worker times (gateway to the response
headers, queue to the worker's start, the engine's own first token, the relay back), over all its
requests and over its rounds' first waves.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform as py_platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from benchmarks import report
from benchmarks.gpu import measure as gpu_measure
from benchmarks.gpu.worker_metrics import read_step_token_counts
from benchmarks.loadgen import Workload, run_requests
from benchmarks.procs import ROOT, STATE_DIR, choose_frontend_cpus, free_port, frontend_cpus
from benchmarks.profiling import CpuMeter, PySpy, hot_functions, top_inclusive
from benchmarks.stats import LevelSummary, first_wave, summarize

MODEL_NAME = "tiny-gemma4"
TARGETS = ("bare", "litellm", "platform")
# Turns per target and level in the full run. On a shared 2-core host one 32-stream turn's
# platform/bare ratio spread 0.73-1.16 over 16 turns while their pooled ratio was 0.935, and eight
# 3-turn runs of the same code printed 0.825-1.064 (2026-12-05, docs/benchmarks.md): 6 turns halve
# that variance. A turn keeps its length (3-4 requests per stream), so the share of each turn's
# first wave and last requests in the figures stays what it was.
FULL_ROUNDS = 6
DOC = ROOT / "docs" / "benchmarks.md"
IMAGE = ROOT / "docs" / "benchmarks-cpu.png"


@dataclass
class Plan:
    quick: bool
    levels: list[int]
    output_tokens: int
    prompt_words: int
    requests: dict[int, int]
    targets: list[str]
    profile_level: int | None = None
    platform_env: dict[str, str] = field(default_factory=dict)
    write_docs: bool = True
    rounds: int = 2
    engine_steps: bool = False

    def requests_per_round(self, level: int) -> int:
        return self.requests[level] // self.rounds

    @property
    def workload(self) -> Workload:
        return Workload(MODEL_NAME, prompt_words=self.prompt_words, output_tokens=self.output_tokens)


def requests_per_turn(level: int) -> int:
    """Requests of one turn at ``level`` streams: every stream cycles at least 3 times. The same in
    the quick and the full run and whatever the number of turns, so a level's figures always weigh
    a turn's first wave and last requests alike."""
    return {1: 4, 8: 32}.get(level, max(128, 3 * level))


def plan_from(args: argparse.Namespace) -> Plan:
    quick = args.quick
    levels = [int(x) for x in args.levels.split(",")]
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = set(targets) - set(TARGETS)
    if unknown:
        raise SystemExit(f"unknown targets {sorted(unknown)}; choose from {', '.join(TARGETS)}")
    env = {}
    for item in args.platform_env:
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--platform-env takes NAME=VALUE, got {item!r}")
        env[name] = value
    rounds = args.rounds or (2 if quick else FULL_ROUNDS)
    return Plan(
        quick=quick,
        levels=levels,
        output_tokens=args.output_tokens or (64 if quick else 128),
        prompt_words=args.prompt_words,
        requests={level: rounds * requests_per_turn(level) for level in levels},
        targets=targets,
        profile_level=args.profile,
        platform_env=env,
        write_docs=not args.no_docs,
        rounds=rounds,
        engine_steps=args.engine_steps,
    )


def log(message: str) -> None:
    print(f"bench {time.strftime('%H:%M:%S')} {message}", flush=True)


class Profiler:
    """py-spy on the given processes during one level; prints and keeps the hot-function tables."""

    def __init__(self, target: str, pids: dict[str, tuple[int, bool]]) -> None:
        out = STATE_DIR / "profiles" / time.strftime("%Y%m%d-%H%M%S")
        self.spies = {name: PySpy(f"{target}-{name}", pid, out, subprocesses=sub) for name, (pid, sub) in pids.items()}
        self.text = ""

    def __enter__(self) -> Profiler:
        for spy in self.spies.values():
            spy.start()
        time.sleep(1.0)  # py-spy attaches before the level starts
        return self

    def __exit__(self, *exc: object) -> None:
        parts = []
        for name, spy in self.spies.items():
            stacks = spy.stop()
            samples = sum(stacks.values())
            rows = [f"  {h.self_pct:5.1f}% self {h.total_pct:5.1f}% incl  {h.key}" for h in hot_functions(stacks, 20)]
            ours = [f"  {h.total_pct:5.1f}% incl {h.self_pct:5.1f}% self  {h.key}"
                    for prefix in ("platform/", "workers/") for h in top_inclusive(stacks, prefix, 12)]  # fmt: skip
            parts.append(
                f"{name}: {samples} samples ({spy.out})\n" + "\n".join(rows + ["  -- project code, inclusive:"] + ours)
            )
        self.text = "\n\n".join(parts)
        print(self.text, flush=True)


@dataclass
class Target:
    """One system under test, paused (SIGSTOP) whenever another one is measured."""

    name: str
    base_url: str
    api_key: str | None
    services: list  # objects with pause()/resume(), e.g. [BareEngine, LiteLLMProxy]
    cpu_groups: dict  # CpuMeter groups
    profile_pids: dict | None = None  # name -> (pid, with subprocesses) for py-spy
    # With --engine-steps: reads its engine's histogram of tokens per step (measure.engine_steps).
    read_steps: Callable[[], dict | None] | None = None
    # The platform's: its ledger's worker times of the given request ids (measure.ledger_worker_times).
    worker_times: Callable[[list[str]], dict] | None = None

    def pause(self) -> None:
        for service in reversed(self.services):
            service.pause()

    def resume(self) -> None:
        for service in self.services:
            service.resume()


def start_targets(plan: Plan, model_dir: str, stack: contextlib.ExitStack) -> dict[str, Target]:
    """Start every target's processes, one after the other, leaving each paused once it is ready."""
    from benchmarks.bare import BareEngine
    from benchmarks.litellm_proxy import LiteLLMProxy
    from benchmarks.platform_stack import PlatformStack

    targets: dict[str, Target] = {}
    if {"bare", "litellm"} & set(plan.targets):
        log("starting the bare vLLM server")
        bare = stack.enter_context(BareEngine(model_dir, MODEL_NAME))
        groups = {"api server": (bare.child.pid, "self"), "engine": (bare.child.pid, "children")}
        bare.pause()
        bare_steps = (lambda: read_step_token_counts(bare.port)) if plan.engine_steps else None
        targets["bare"] = Target("bare", bare.base_url, None, [bare], groups, read_steps=bare_steps)
        if "litellm" in plan.targets:
            log("starting the LiteLLM proxy")
            proxy = stack.enter_context(LiteLLMProxy(MODEL_NAME, bare.base_url))
            proxy.pause()
            targets["litellm"] = Target("litellm", proxy.base_url, proxy.api_key, [bare, proxy],
                                        {"litellm": (proxy.child.pid, "tree"), **groups},
                                        read_steps=bare_steps)  # fmt: skip
    if "platform" in plan.targets:
        log("starting the platform (gunicorn, Celery worker with the engine, beat)")
        metrics_port = free_port() if plan.engine_steps else None
        platform = stack.enter_context(PlatformStack(model_dir, MODEL_NAME, extra_env=plan.platform_env,
                                                     metrics_port=metrics_port))  # fmt: skip
        platform.pause()
        pids = platform.pids()
        web, worker = pids["platform-web"], pids["platform-worker"]
        targets["platform"] = Target(
            "platform", platform.base_url, platform.api_key, [platform],
            {"gateway": (web, "tree"), "worker": (worker, "self"), "engine": (worker, "children")},
            {"gateway": (web, True), "worker": (worker, False)},
            read_steps=(lambda: read_step_token_counts(metrics_port)) if metrics_port else None,
            worker_times=lambda ids: gpu_measure.ledger_worker_times(platform.env["DATABASE_URL"], ids),
        )  # fmt: skip
    if "bare" not in plan.targets:
        targets.pop("bare", None)
    return targets


def run_one(target: Target, plan: Plan, level: int, first_index: int,
            profile: bool) -> tuple[list, float, dict, str, dict | None, dict]:  # fmt: skip
    """One round of one level on one target (resumed for it): raw results, wall time, CPU seconds,
    profile, with --engine-steps its engine steps (``round_steps``), and the platform's worker
    times of its requests (read before it is paused, which would hold its ledger writes back)."""
    target.resume()
    try:
        settle_after_resume(target, plan, level, first_index)
        steps_before = target.read_steps() if target.read_steps else None
        meter = CpuMeter(target.cpu_groups)
        meter.start()
        requests, text = plan.requests_per_round(level), ""
        if profile and target.profile_pids:
            with Profiler(target.name, target.profile_pids) as profiler:
                results, duration = run_requests(target.base_url, target.api_key, plan.workload, level, requests,
                                                 first_index)  # fmt: skip
            text = profiler.text
        else:
            results, duration = run_requests(target.base_url, target.api_key, plan.workload, level, requests,
                                             first_index)  # fmt: skip
        cpu = meter.stop()
        steps = _round_steps(target, steps_before, level, results)
        ids = [r.request_id for r in results if r.ok and r.request_id]
        times = target.worker_times(ids) if target.worker_times and ids else {}
        return results, duration, cpu, text, steps, times
    finally:
        target.pause()


def _round_steps(target: Target, before: dict | None, level: int, results: list) -> dict | None:
    """The round's engine steps since ``before``, with the completion tokens per step. The engine
    records a step's statistics beside handing its outputs on, so the last ones may come a moment
    after the last response: read until they stop growing (a second at most)."""
    if target.read_steps is None or before is None:
        return None
    steps, deadline = None, time.monotonic() + 1.0
    while True:
        latest = gpu_measure.engine_steps(before, target.read_steps(), level)
        if latest is None or (steps is not None and latest["steps"] == steps["steps"]) or time.monotonic() > deadline:
            steps = latest or steps
            break
        steps = latest
        time.sleep(0.1)
    if steps and steps["steps"]:
        steps["tokens_per_step"] = round(sum(r.completion_tokens for r in results if r.ok) / steps["steps"], 1)
    return steps


def settle_after_resume(target: Target, plan: Plan, level: int, first_index: int) -> None:
    """A few short, unmeasured requests right after a target resumes, at the level's concurrency.

    A target paused for the others' turns comes back with its short-lived caches expired (the
    platform's key, limits and catalog caches, idle pooled connections): its first requests pay
    for refilling them, which is what an idle server pays, not a loaded one. Every target gets the
    same treatment, so the rounds measure each in its steady state.
    """
    settle = Workload(MODEL_NAME, prompt_words=plan.prompt_words, output_tokens=4)
    run_requests(target.base_url, target.api_key, settle, level, level, first_index=20_000_000 + first_index)


def warm_up(target: Target, plan: Plan) -> None:
    top = max(plan.levels)
    warm = Workload(MODEL_NAME, prompt_words=plan.prompt_words, output_tokens=16)
    target.resume()
    try:
        results, _ = run_requests(target.base_url, target.api_key, warm, top, 2 * top, first_index=10_000_000)
    finally:
        target.pause()
    failed = [r for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{target.name}: warm-up failed: {failed[0].error}")


def measure_all(targets: dict[str, Target], plan: Plan) -> tuple[list[LevelSummary], str]:
    """Every level, ``plan.rounds`` rounds, the targets taking turns in a rotating order within each round.

    Taking turns spreads whatever else the machine does over all targets alike; a level's summary
    pools the requests of all its rounds (tokens over the summed wall times).
    """
    for target in targets.values():
        log(f"warming up {target.name}")
        warm_up(target, plan)
    summaries, profile_text, index = [], "", 0
    names = list(targets)
    for level in plan.levels:
        pooled: dict[str, tuple[list, float, dict]] = {name: ([], 0.0, {}) for name in names}
        waves: dict[str, list] = {name: [] for name in names}
        per_round: dict[str, list[float]] = {name: [] for name in names}
        round_steps: dict[str, list] = {name: [] for name in names}
        worker_times: dict[str, dict] = {name: {} for name in names}
        for round_no in range(plan.rounds):
            order = names[round_no % len(names) :] + names[: round_no % len(names)]
            for name in order:
                profile = level == plan.profile_level and round_no == 0
                results, duration, cpu, text, steps, times = run_one(targets[name], plan, level, index, profile)
                round_steps[name].append(steps)
                worker_times[name].update(times)
                index += len(results)
                waves[name] += first_wave(results, level)
                per_round[name].append(
                    round(sum(r.completion_tokens for r in results if r.ok) / max(duration, 1e-9), 1)
                )
                profile_text = text or profile_text
                old_results, old_duration, old_cpu = pooled[name]
                cpu_sum = {k: round(old_cpu.get(k, 0) + v, 2) for k, v in cpu.items()}
                pooled[name] = (old_results + results, old_duration + duration, cpu_sum)
        for name in names:
            results, duration, cpu = pooled[name]
            summary = summarize(name, level, results, duration, plan.output_tokens, first_waves=waves[name])
            summary.cpu_s, summary.round_tok_s = cpu, per_round[name]
            if plan.engine_steps:
                summary.round_steps = round_steps[name]
            if worker_times[name]:
                summary.ttft_breakdown = _ttft_breakdown(results, worker_times[name])
                summary.first_wave_ttft_breakdown = _ttft_breakdown(waves[name], worker_times[name])
                log(f"{name:8s} {level:3d} streams: {_breakdown_text(summary)}")
            log(f"{name:8s} {level:3d} streams: {summary.output_tok_s:8.1f} tok/s  TTFT p50 {summary.ttft_p50_ms} ms"
                f" (first wave {summary.first_wave_ttft_p50_ms})  ITL p50 {summary.itl_p50_ms} ms"
                f"  errors {summary.errors + summary.short}  cpu {cpu}")  # fmt: skip
            summaries.append(summary)
    return summaries, profile_text


def _ttft_breakdown(results: list, worker_times: dict) -> dict:
    """``results``' time to first token split by the worker's times (benchmarks/gpu/measure.py)."""
    records = [
        gpu_measure.RequestRecord(
            submitted=r.sent_at, first_token=r.chunk_times[0] if r.chunk_times else None, finished=r.ended_at,
            tokens=r.completion_tokens, request_id=r.request_id, headers=r.headers_at,
        )
        for r in results
        if r.ok
    ]  # fmt: skip
    return gpu_measure.ttft_breakdown(records, worker_times)


def _breakdown_text(summary: LevelSummary) -> str:
    """E.g. "first token p50 ms, all / first wave: gateway 9.1 / 40.2, queue 11 / 35, ..."."""
    both = (summary.ttft_breakdown or {}, summary.first_wave_ttft_breakdown or {})
    parts = ", ".join(
        f"{part.removesuffix('_ttft')} {' / '.join(str(b.get(f'{part}_ms_p50')) for b in both)}"
        for part in ("gateway", "queue", "engine_ttft", "relay")
    )
    return f"first token p50 ms, all / first wave: {parts}"


def context_text(plan: Plan, summaries: list[LevelSummary], started: float) -> str:
    import vllm

    from workers.profiles import engine_args_for

    prompt = [s.mean_prompt_tokens for s in summaries if s.mean_prompt_tokens]
    engine_args = engine_args_for("cpu", ".run/models/tiny-gemma4")
    mode = "quick (`--quick`)" if plan.quick else "full"
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    return "\n".join([
        f"Measured {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {mode} run, {time.time() - started:.0f} s in all, on "
        f"{os.cpu_count()} cores ({cpu}), load average at the end {os.getloadavg()[0]:.2f}; vLLM {vllm.__version__} "
        f"(CPU), Python {py_platform.python_version()}.",
        "",
        f"Workload: streamed chat completions, prompt ≈ {sum(prompt) / max(len(prompt), 1):.0f} tokens (distinct per "
        f"request), exactly {plan.output_tokens} completion tokens (`ignore_eos`), greedy; requests per level: "
        + ", ".join(f"{n} at {c}" for c, n in plan.requests.items())
        + f" streams, in {plan.rounds} rounds per target: the targets take turns, and the ones not being measured"
        " are paused (SIGSTOP), so background load on the machine falls on all of them alike.",
        "Engine arguments (all three targets): `" + json.dumps(engine_args, sort_keys=True) + "`.",
        "LiteLLM runs in master-key mode (its virtual keys need Prisma, which cannot start here).",
        *([f"Platform environment overrides: `{plan.platform_env}`."] if plan.platform_env else []),
        *([f"Serving processes and load generator pinned to cores {sorted(frontend_cpus())} (`--frontend-cpus`)."]
          if frontend_cpus() else []),
    ])  # fmt: skip


def cpu_table(summaries: list[LevelSummary]) -> str:
    rows = ["| target | streams | CPU seconds per 1,000 output tokens, by process |", "|---|--:|---|"]
    for s in summaries:
        tokens = s.output_tok_s * s.duration_s
        per_k = ", ".join(f"{name} {1000 * sec / tokens:.3f}" for name, sec in s.cpu_s.items()) if tokens else "–"
        rows.append(f"| {report.TARGET_LABELS.get(s.target, s.target)} | {s.concurrency} | {per_k} |")
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the short run (64 output tokens, 2 rounds)")
    parser.add_argument("--targets", default=",".join(TARGETS), help="comma-separated subset of bare,litellm,platform")
    parser.add_argument("--levels", default="1,8,32,64", help="concurrency levels")
    parser.add_argument(
        "--output-tokens", type=int, default=0, help="completion tokens per request (64 quick, 128 full)"
    )
    parser.add_argument("--prompt-words", type=int, default=48, help="prompt length in words (~3 tokens each here)")
    parser.add_argument("--profile", type=int, default=None, metavar="STREAMS",
                        help="py-spy the platform's gateway and worker during this level")  # fmt: skip
    parser.add_argument("--platform-env", action="append", default=[], metavar="NAME=VALUE",
                        help="environment for the platform's processes (tuning experiments)")  # fmt: skip
    parser.add_argument(
        "--rounds", type=int, default=0, help=f"turns per target and level (2 quick, {FULL_ROUNDS} full)"
    )
    parser.add_argument("--frontend-cpus", default=None, metavar="CPUS",
                        help='cores for the serving processes and the load generator, e.g. "1" '
                             '(default: "1" on a 2-core machine, none elsewhere; "" pins nothing)')  # fmt: skip
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md and the plot")
    parser.add_argument("--engine-steps", action="store_true",
                        help="vLLM's statistics on in both engines; count each round's engine steps")  # fmt: skip
    return parser


def turn_engine_statistics_on() -> None:
    """vLLM's statistics on in every engine the bench starts, for its histogram of tokens per step:
    both the bare server and the platform's worker read ENGINE_ARGS_JSON (workers/profiles.py)."""
    overrides = json.loads(os.environ.get("ENGINE_ARGS_JSON") or "{}")
    os.environ["ENGINE_ARGS_JSON"] = json.dumps({**overrides, "disable_log_stats": False})


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    plan = plan_from(args)
    choose_frontend_cpus(args.frontend_cpus)
    started = time.time()
    if frontend_cpus():
        os.sched_setaffinity(0, frontend_cpus())  # the load generator joins the serving processes' cores
    # Compiled engine unless the caller chose: the cpu profile's advice for benchmarks.
    os.environ.setdefault("ENGINE_ENFORCE_EAGER", "false")
    if plan.engine_steps:
        turn_engine_statistics_on()
    from workers.tinymodel import build_tiny_model

    model_dir = str(build_tiny_model(ROOT / ".run" / "models" / MODEL_NAME))
    log(f"{'quick' if plan.quick else 'full'} run: targets {plan.targets}, levels {plan.levels}, "
        f"{plan.output_tokens} output tokens, requests {plan.requests}")  # fmt: skip
    with contextlib.ExitStack() as stack:
        targets = start_targets(plan, model_dir, stack)
        summaries, profile_text = measure_all(targets, plan)
    order = {t: i for i, t in enumerate(("bare", "platform", "litellm"))}
    summaries.sort(key=lambda s: (order.get(s.target, 9), s.concurrency))

    STATE_DIR.mkdir(parents=True, exist_ok=True)
    raw = STATE_DIR / f"results-{time.strftime('%Y%m%d-%H%M%S')}.json"
    dump = {"plan": plan.__dict__, "results": [s.as_dict() for s in summaries],
            "ratios": report.ratios(summaries), "profile": profile_text}  # fmt: skip
    raw.write_text(json.dumps(dump, indent=2, default=str))
    print(report.results_table(summaries))
    print(report.ratios_table(report.ratios(summaries)))
    print(report.round_ratios_line(summaries))
    if plan.engine_steps:
        print(report.steps_table(summaries))
    print("\n".join(report.goals(report.ratios(summaries))))
    log(f"raw results: {raw}")
    return finish(plan, summaries, started)


def finish(plan: Plan, summaries: list[LevelSummary], started: float) -> int:
    if plan.write_docs:
        title = f"tiny Gemma 4 on {os.cpu_count()} CPU cores, {plan.output_tokens} output tokens per request"
        report.plot(summaries, IMAGE, title)
        extra = "### CPU per process\n\n" + cpu_table(summaries)
        report.write_into(DOC, report.section(summaries, context_text(plan, summaries, started), IMAGE.name, extra))
        log(f"wrote {DOC.relative_to(ROOT)} and {IMAGE.relative_to(ROOT)}")
    by = {(s.target, s.concurrency): s for s in summaries}
    plat, bare = by.get(("platform", 32)), by.get(("bare", 32))
    value = report.ratio(plat and plat.output_tok_s, bare and bare.output_tok_s)
    # Failed requests are counted in the table (the "errors" column); the exit status says whether
    # the benchmark itself ran, and this line stays the last one `make bench` prints.
    print(f"platform/bare throughput at 32 streams: {'n/a' if value is None else f'{value:.3f}'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
