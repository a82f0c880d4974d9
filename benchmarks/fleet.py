"""``make bench-fleet``: P workers of one pool, the gateway's dispatch policies side by side.

    python -m benchmarks.fleet [--quick] [--workers 2] [--profile cpu|h200] [--model-dir DIR]

One run starts, one after the other:

1. P bare vLLM servers (vLLM's own OpenAI server, benchmarks/bare.py) behind a round-robin proxy
   (benchmarks/round_robin.py), the same engine profile as the platform's workers;
2. the platform with P workers in one pool, then, one phase per dispatch policy, only its web
   processes restarted with ``ROUTING_POLICY`` set to ``pool`` (the pool's shared queue: whichever
   worker takes the request first), ``round_robin``, ``least_loaded`` and ``cache_aware``.

Every side runs two workloads (``shared`` and ``distinct``) of streamed ``/v1/completions`` with
``ignore_eos``, sent open-loop at Poisson times whose rate rises linearly from a light load to past
saturation (``Load``). ``shared``: several tenants with several groups each; a group's requests start
with its long system prompt, and each conversation of a group re-sends its growing history turn
after turn. ``distinct``: the same requests made unique from their first word: nothing to reuse.
Every phase uses tenants of its own (the platform salts the prefix cache per tenant; the bare
servers get a ``cache_salt`` per tenant), so no phase finds blocks an earlier one left.

Each engine's KV cache is capped (``num_gpu_blocks_override`` on the CPU, ``kv_cache_memory_bytes``
on a GPU) so that the shared workload's prefixes exceed one engine's cache and fit the pool's: only
a dispatch that keeps each group on one engine keeps its prefix cached. Several engines on one GPU
each get their share of its memory (``gpu_memory_utilization``).

Per phase: output tokens/s (completion tokens over first send to last end), time to first token
p50/p90/p99 (from the request's send), the cache hit rate (prompt tokens served from the prefix
cache over prompt tokens, from the responses' ``usage.prompt_tokens_details.cached_tokens``: the
engine's own count, which the platform's ledger records), requests refused (HTTP 429/503) or failed,
and the ratios against ``pool`` and ``round_robin``. Results: JSON and a short report in
.run/bench/fleet/ (or ``--out``); the goals are printed last as PASS/FAIL lines.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime as dt
import json
import math
import os
import random
import secrets
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from benchmarks.procs import ROOT, STATE_DIR, Child, engine_cpu_env, free_port, frontend_cpus
from deploy.local.launcher import Stack

POLICIES = ("pool", "round_robin", "least_loaded", "cache_aware")
WORKLOADS = ("shared", "distinct")
BARE = "bare"  # the bare servers behind the round-robin proxy, a phase beside the policies
MODEL_NAME = "tiny-gemma4"
GPU_MODEL_NAME = "gemma-4-e4b"

# The CPU prompts' words (the tiny model's BPE tokenizer makes ~2-3 tokens of each); a GPU run's
# word-level benchmark tokenizer (benchmarks/gpu/model.py) knows only its own "wN" words.
CPU_WORDS = tuple(
    (
        "the keeper of the lighthouse found a map in an old chest and followed it across the sea "
        "through islands storms and harbours with a crew of sailors who spoke of weather ships and "
        "stars while the gateway admits each request and the worker streams tokens back to tenants"
    ).split()
)
GPU_WORDS = tuple(f"w{i}" for i in range(100, 20_000))


# ------------------------------------------------------------------------------------------ workload


@dataclasses.dataclass(frozen=True)
class Shape:
    """How many requests, and how long: ``tenants`` x ``groups`` x ``conversations`` x ``turns``."""

    tenants: int = 4
    groups: int = 3  # per tenant, each with its own system prompt
    conversations: int = 4  # per group
    turns: int = 3  # per conversation, each re-sending the history before it
    system_words: int = 320
    turn_words: int = 12  # a user turn's words, and a reply's
    output_tokens: int = 16

    @property
    def requests(self) -> int:
        return self.tenants * self.groups * self.conversations * self.turns


@dataclasses.dataclass(frozen=True)
class Call:
    """One request of a workload: whose (``tenant``, an index) and its prompt text."""

    tenant: int
    group: int
    conversation: int
    turn: int
    prompt: str


def text(seed: str, count: int, words: Sequence[str]) -> str:
    """``count`` words drawn from ``words`` by a generator seeded with ``seed`` (the same every run)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(words) for _ in range(count))


def workload_calls(shape: Shape, shared: bool, words: Sequence[str] = CPU_WORDS) -> list[Call]:
    """Every request of the workload, conversation by conversation, turn by turn.

    Shared: turn k of a conversation is its group's system prompt, then the user turns and replies
    before it, then its own user turn (a chat client re-sends the history; the replies are fixed
    text, not the model's, so the prompts do not depend on what the engine generated). Distinct: the
    same prompts, each preceded by a marker of its own, so that no two share even a first block.
    """
    calls = []
    for tenant in range(shape.tenants):
        for group in range(shape.groups):
            system = text(f"system {tenant} {group}", shape.system_words, words)
            for conversation in range(shape.conversations):
                history = system
                for turn in range(shape.turns):
                    key = f"{tenant} {group} {conversation} {turn}"
                    history += "\nUser: " + text(f"user {key}", shape.turn_words, words)
                    history += "\nAssistant:"
                    prompt = history
                    if not shared:
                        prompt = text(f"marker {key}", 4, words) + f" {tenant}-{group}-{conversation}-{turn}\n" + prompt
                    calls.append(Call(tenant, group, conversation, turn, prompt))
                    history += " " + text(f"reply {key}", shape.turn_words, words)
    return calls


def arrival_order(calls: Sequence[Call], seed: int) -> list[Call]:
    """``calls`` shuffled, each conversation's turns kept in order (turn k+1 comes after turn k:
    the positions a conversation's calls land on are handed to its turns in order)."""
    rng = random.Random(seed)
    shuffled = list(calls)
    rng.shuffle(shuffled)
    turns: dict[tuple, list[Call]] = {}
    for call in sorted(calls, key=lambda c: c.turn):
        turns.setdefault((call.tenant, call.group, call.conversation), []).append(call)
    nexts = {key: iter(value) for key, value in turns.items()}
    return [next(nexts[(call.tenant, call.group, call.conversation)]) for call in shuffled]


@dataclasses.dataclass(frozen=True)
class Load:
    """Arrivals: a Poisson process whose rate rises linearly from ``start_rate`` to ``end_rate``
    requests/s over the phase (past what the slowest policy carries, so every side saturates)."""

    start_rate: float
    end_rate: float


def poisson_times(count: int, load: Load, seed: int) -> list[float]:
    """``count`` arrival times (seconds from the phase's start) of a Poisson process whose rate
    rises linearly from ``load.start_rate`` to ``load.end_rate`` over the expected span of ``count``
    arrivals: exponential gaps in the cumulative rate, mapped back through its inverse."""
    if count <= 0:
        return []
    if load.start_rate <= 0 or load.end_rate <= 0:
        raise ValueError("rates must be positive")
    span = 2 * count / (load.start_rate + load.end_rate)  # expected count = mean rate x span
    slope = (load.end_rate - load.start_rate) / span
    rng = random.Random(seed)
    times, cumulative = [], 0.0
    for _ in range(count):
        cumulative += rng.expovariate(1.0)
        if abs(slope) < 1e-12:
            times.append(cumulative / load.start_rate)
        else:  # solve start_rate t + slope t^2 / 2 = cumulative for t >= 0
            times.append((-load.start_rate + math.sqrt(load.start_rate**2 + 2 * slope * cumulative)) / slope)
    return times


# ---------------------------------------------------------------------------------- figures and goals


def percentile(values: Sequence[float], q: float) -> float | None:
    from benchmarks.stats import percentile as _percentile

    return _percentile(values, q)


def summarize_phase(phase: str, workload: str, results: Sequence, duration: float) -> dict:
    """One phase's figures from its ``RequestResult``s (benchmarks/stats.py)."""
    ok = [r for r in results if r.ok]
    refused = [r for r in results if not r.ok and (r.error or "").startswith(("HTTP 429", "HTTP 503"))]
    tokens = sum(r.completion_tokens for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    ttfts = [r.ttft for r in ok if r.ttft is not None]

    def ms(q: float) -> float | None:
        value = percentile(ttfts, q)
        return None if value is None else round(value * 1000, 1)

    errors = [r.error for r in results if not r.ok]
    return {
        "phase": phase,
        "workload": workload,
        "requests": len(results),
        "refused": len(refused),
        "failed": len(results) - len(ok) - len(refused),
        "first_error": errors[0] if errors else None,
        "duration_s": round(duration, 2),
        "output_tok_s": round(tokens / max(duration, 1e-9), 1),
        "ttft_p50_ms": ms(50),
        "ttft_p90_ms": ms(90),
        "ttft_p99_ms": ms(99),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cache_hit_rate": round(cached / prompt, 3) if prompt else None,
        "mean_prompt_tokens": round(prompt / len(ok), 1) if ok else 0.0,
    }


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, 3)


def add_ratios(phases: list[dict]) -> list[dict]:
    """Each phase's output tok/s and P90 TTFT over those of ``pool`` and ``round_robin`` of its workload."""
    by = {(p["workload"], p["phase"]): p for p in phases}
    for phase in phases:
        for base in ("pool", "round_robin"):
            other = by.get((phase["workload"], base))
            phase[f"tok_s_vs_{base}"] = ratio(phase["output_tok_s"], other and other["output_tok_s"])
            phase[f"ttft_p90_vs_{base}"] = ratio(phase["ttft_p90_ms"], other and other["ttft_p90_ms"])
    return phases


def goals(phases: list[dict], gpu: bool) -> list[tuple[str, bool | None, str]]:
    """The bench's goals: (name, passed or None when not measured, the figures)."""
    by = {(p["workload"], p["phase"]): p for p in phases}
    result: list[tuple[str, bool | None, str]] = []
    aware = by.get(("shared", "cache_aware"))
    need = 2.0 if gpu else 1.5
    for base in ("pool", "round_robin"):
        value = aware and aware.get(f"tok_s_vs_{base}")
        result.append((f"shared prefixes: cache_aware output tok/s >= {need}x {base}",
                       None if value is None else value >= need, _times(value)))  # fmt: skip
        if gpu:
            p90 = aware and aware.get(f"ttft_p90_vs_{base}")
            result.append((f"shared prefixes: cache_aware P90 TTFT <= 1/10 of {base}",
                           None if p90 is None else p90 <= 0.1, _times(p90)))  # fmt: skip
    distinct = by.get(("distinct", "cache_aware"))
    best = max((by[("distinct", n)]["output_tok_s"] for n in ("round_robin", "least_loaded")
                if ("distinct", n) in by), default=None)  # fmt: skip
    value = ratio(distinct and distinct["output_tok_s"], best)
    result.append(("no shared prefix: cache_aware >= 0.97 of the better of round_robin and least_loaded",
                   None if value is None else value >= 0.97, _times(value)))  # fmt: skip
    bad = sum(p["refused"] + p["failed"] for p in phases)
    result.append(("no request refused or failed", bool(phases) and bad == 0, f"{bad} refused or failed"))
    return result


def _times(value: float | None) -> str:
    return "not measured" if value is None else f"{value}x"


def goal_lines(checks: list[tuple[str, bool | None, str]]) -> list[str]:
    label = {True: "PASS", False: "FAIL", None: "n/a "}
    return [f"{label[passed]}  {name} ({detail})" for name, passed, detail in checks]


def table(phases: list[dict]) -> str:
    rows = [
        "| workload | phase | output tok/s | vs pool | vs round_robin | TTFT p50 / p90 / p99 ms | cache hit | "
        "refused / failed | prompt tokens (mean) |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for p in phases:
        rows.append(
            f"| {p['workload']} | {p['phase']} | {p['output_tok_s']:,.1f} | {p['tok_s_vs_pool']} | "
            f"{p['tok_s_vs_round_robin']} | {p['ttft_p50_ms']} / {p['ttft_p90_ms']} / {p['ttft_p99_ms']} | "
            f"{p['cache_hit_rate']} | {p['refused']} / {p['failed']} | {p['mean_prompt_tokens']} |"
        )
    return "\n".join(rows)


# ------------------------------------------------------------------------------------- the settings


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one run measures and on what: the engine profile, P, the workload's shape and load,
    and each engine's memory (``engine_args``: its ENGINE_ARGS_JSON)."""

    profile: str
    workers: int
    shape: Shape
    load: Load
    engine_args: dict
    policies: tuple[str, ...] = POLICIES
    workloads: tuple[str, ...] = WORKLOADS
    bare: bool = True
    seed: int = 1

    @property
    def gpu(self) -> bool:
        return self.profile != "cpu"

    @property
    def words(self) -> tuple[str, ...]:
        return GPU_WORDS if self.gpu else CPU_WORDS


# CPU: the tiny model's KV cache is capped at this many blocks per engine: vLLM reports ~7,800
# tokens for them (its hybrid allocator splits the 128-token blocks between the model's sliding and
# full attention layers). The shared workload's 12 system prompts (~670 tokens each, ~8k tokens)
# and the conversations' histories exceed one engine's cache and fit two, one half in each, with
# room for the sequences in flight.
CPU_KV_BLOCKS = 256
# GPU: several E4B-shaped engines share one GPU: each gets this KV cache and this share of the
# memory vLLM checks is free at start (its weights, activations and CUDA graphs come on top).
GPU_KV_CACHE_BYTES = 4 * 2**30


def cpu_plan(workers: int, quick: bool) -> Plan:
    shape = Shape(conversations=3, turns=2) if quick else Shape()
    load = Load(start_rate=2.0, end_rate=14.0)
    return Plan("cpu", workers, shape, load, {"num_gpu_blocks_override": CPU_KV_BLOCKS})


def gpu_plan(workers: int, quick: bool) -> Plan:
    """llm-d's shape: shared ~6,000-token system prompts (one token per word with the GPU model's
    tokenizer), 32 groups (~190k tokens) against ~146k tokens of KV cache per engine."""
    shape = Shape(tenants=8, groups=4, conversations=4, turns=3 if not quick else 2, system_words=6000,
                  turn_words=100, output_tokens=128)  # fmt: skip
    load = Load(start_rate=2.0, end_rate=60.0)
    args = {"load_format": "dummy", "kv_cache_memory_bytes": GPU_KV_CACHE_BYTES,
            "gpu_memory_utilization": round(0.9 / workers, 3)}  # fmt: skip
    return Plan("h200", workers, shape, load, args)


# ---------------------------------------------------------------------------------------- the sides


def log(message: str) -> None:
    print(f"fleet {time.strftime('%H:%M:%S')} {message}", flush=True)


@dataclasses.dataclass
class Side:
    """Where a phase sends its requests: ``base_url`` (ending in /v1), each tenant's headers and
    extra body fields (``tenant_setup(phase, count)`` makes a phase's tenants)."""

    base_url: str
    tenant_setup: Callable[[str, int], list[tuple[dict, dict]]]


def bare_side(plan: Plan, model_dir: str, model_name: str, stack: contextlib.ExitStack) -> Side:
    """P bare vLLM servers behind the round-robin proxy; tenants are cache salts."""
    from benchmarks.bare import BareEngine

    engines = [BareEngine(model_dir, model_name, profile=plan.profile) for _ in range(plan.workers)]
    for index, engine in enumerate(engines):
        engine.child.name, engine.child.log_path = f"fleet-bare{index}", STATE_DIR / "logs" / f"fleet-bare{index}.log"
        # The cached prompt tokens in each response's usage, as the platform reports them.
        engine.child.argv.append("--enable-prompt-tokens-details")
        engine.child.start()
        stack.callback(engine.child.stop)
    for engine in engines:
        engine.child.wait_http(f"http://127.0.0.1:{engine.port}/health", 900)
        engine.child.pin_serving_threads()
    port = free_port()
    argv = [sys.executable, "-m", "benchmarks.round_robin", "--port", str(port),
            *[arg for e in engines for arg in ("--backend", f"http://127.0.0.1:{e.port}")]]  # fmt: skip
    proxy = Child("fleet-proxy", argv, dict(os.environ))
    proxy.start()
    stack.callback(proxy.stop)
    proxy.wait_http(f"http://127.0.0.1:{port}/health", 60)

    def tenants(phase: str, count: int) -> list[tuple[dict, dict]]:
        return [({}, {"cache_salt": f"{phase}-{i}"}) for i in range(count)]

    return Side(f"http://127.0.0.1:{port}/v1", tenants)


def platform_side(plan: Plan, model_dir: str, model_name: str, stack: contextlib.ExitStack):
    """The platform with P workers in one pool (``FleetPlatform``); tenants are real tenants with keys.
    Returns the side and a function that restarts the web processes with a routing policy."""
    platform = stack.enter_context(FleetPlatform(model_dir, model_name, plan.workers, plan.profile))

    def tenants(phase: str, count: int) -> list[tuple[dict, dict]]:
        keys = platform.create_tenants([f"{phase.replace('_', '-')}-{i}" for i in range(count)])
        return [({"Authorization": f"Bearer {key}"}, {}) for key in keys]

    return Side(platform.base_url, tenants), platform.restart_web


POOL = "fleet"
DATABASE = "gemma_fleet_bench"


class FleetPlatform:
    """The platform's processes (deploy/local/launcher.py ``Stack``) with ``workers`` Celery workers
    in one pool, each its own engine, on their own database (``gemma_fleet_bench``, re-created) and
    Redis database (BENCH_REDIS_DB, default 1, emptied) of the servers DATABASE_URL and REDIS_URL
    name (else the embedded ones of .run/). The web processes start with the first ``restart_web``."""

    def __init__(self, model_dir: str, model_name: str, workers: int, profile: str) -> None:
        self.model_dir, self.model_name, self.workers, self.profile = model_dir, model_name, workers, profile
        self.redis_db = int(os.environ.get("BENCH_REDIS_DB", "1"))
        self.stack = None
        self.services = None
        # On a GPU an engine batches up to 256 sequences (h200): as many task slots per worker, and
        # 8 web processes to relay them (benchmarks/gpu/platform_bench.py).
        self.slots = 80 if profile == "cpu" else 320
        self.web_env = {} if profile == "cpu" else {"WEB_CONCURRENCY": "8"}

    @property
    def base_url(self) -> str:
        return f"{self.stack.base_url}/v1"

    def __enter__(self) -> FleetPlatform:
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self) -> None:
        import redis

        from benchmarks.platform_stack import recreate_database, with_database, with_redis_db
        from deploy.local.launcher import stack_env
        from deploy.local.services import ensure_services

        (STATE_DIR / "logs").mkdir(parents=True, exist_ok=True)
        self.services = ensure_services(ROOT / ".run")
        database_url = with_database(self.services["DATABASE_URL"], DATABASE)
        redis_url = with_redis_db(self.services["REDIS_URL"], self.redis_db)
        recreate_database(self.services["DATABASE_URL"], DATABASE)
        redis.Redis.from_url(redis_url).flushdb()
        base = {"DJANGO_DEBUG": "0", "ALLOWED_HOSTS": "127.0.0.1,localhost", "LOG_LEVEL": "WARNING",
                **engine_cpu_env(), **os.environ, "ENGINE_PROFILE": self.profile}  # fmt: skip
        self.stack = PinnedStack(env=stack_env(database_url, redis_url, base, SECRET_KEY=secrets.token_urlsafe(48)),
                                 log_dir=STATE_DIR / "logs")  # fmt: skip
        self.stack.manage("migrate", "--noinput", "-v", "0")
        self.stack.register_model(self.model_name, self.model_dir, POOL,
                                  context_length=2048 if self.profile == "cpu" else 32768)  # fmt: skip
        for index in range(self.workers):
            self.stack.start_worker(f"worker{index}", POOL, model=self.model_name, model_path=self.model_dir,
                                    pod=f"fleet-pod-{index}", concurrency=self.slots, loglevel="WARNING")  # fmt: skip
        self.stack.start_beat(STATE_DIR / "fleet-celerybeat-schedule", loglevel="WARNING")
        self.stack.wait_ready(POOL, count=self.workers, timeout=900)
        for child in self.stack.children.values():
            child.pin_serving_threads()

    def __exit__(self, *exc: object) -> None:
        if self.stack is not None:
            self.stack.stop_all()
        if self.services is not None:
            self.services.stop()  # only the embedded servers this run started

    def restart_web(self, policy: str) -> None:
        """Start the web processes anew with ``ROUTING_POLICY=policy``; the workers stay up."""
        if "web" in self.stack.children:
            self.stack.stop("web")
        web = self.stack.start_web(ROUTING_POLICY=policy, **self.web_env)
        web.pin_serving_threads()
        self.stack.wait_ready(POOL, count=self.workers, timeout=60)

    def create_tenants(self, names: list[str]) -> list[str]:
        """New tenants with one API key each, in one manage.py process; their keys in order."""
        script = (
            "import json\n"
            "from tenants.services import apikey_create, tenant_create\n"
            f"names = {names!r}\n"
            "keys = [apikey_create(tenant=tenant_create(name=n), name='fleet bench')[1] for n in names]\n"
            "print(json.dumps(keys))\n"
        )
        out = self.stack.manage("shell", "-c", script)
        return json.loads(out.strip().splitlines()[-1])


class PinnedStack(Stack):
    """The launcher's stack, its processes pinned to the bench's serving cores (benchmarks/procs.py)."""

    def new_child(self, name: str, argv: list[str], env: dict[str, str], *, engine: bool = False) -> Child:
        return Child(f"fleet-{name}", argv, env, cwd=self.cwd, hosts_engine=engine)


# ------------------------------------------------------------------------------------------ phases


async def _send_all(base_url: str, calls: Sequence[Call], times: Sequence[float], tenants: list[tuple[dict, dict]],
                    plan: Plan, timeout_s: float) -> tuple[list, float]:  # fmt: skip
    """Send each call at its time (open loop), streamed; the results and first send to last end."""
    import aiohttp

    from benchmarks.loadgen import stream_one

    url = base_url.rstrip("/") + "/completions"
    connector = aiohttp.TCPConnector(limit=0)
    model = plan_model_name(plan)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        started = time.perf_counter()

        async def one(call: Call, at: float):
            await asyncio.sleep(max(0.0, started + at - time.perf_counter()))
            headers, extra = tenants[call.tenant]
            body = {"model": model, "prompt": call.prompt, "max_tokens": plan.shape.output_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}, **extra}  # fmt: skip
            return await stream_one(session, url, headers, body)

        results = await asyncio.gather(*(one(call, at) for call, at in zip(calls, times, strict=True)))
    ended = max((r.ended_at for r in results), default=started)
    first = min((r.sent_at for r in results), default=started)
    return list(results), ended - first


def plan_model_name(plan: Plan) -> str:
    return GPU_MODEL_NAME if plan.gpu else MODEL_NAME


def run_phase(side: Side, phase: str, workload: str, plan: Plan, calls_by_workload: dict) -> dict:
    calls, times = calls_by_workload[workload]
    tenants = side.tenant_setup(f"{phase}-{workload}", plan.shape.tenants)
    warm = [Call(0, 0, 0, 0, text(f"warm {phase} {i}", 24, plan.words)) for i in range(2 * plan.workers)]
    # Unmeasured: every web process and worker serves a request before the clock runs.
    asyncio.run(_send_all(side.base_url, warm, [0.0] * len(warm), tenants, plan, 600))
    results, duration = asyncio.run(_send_all(side.base_url, calls, times, tenants, plan, 1800))
    summary = summarize_phase(phase, workload, results, duration)
    log(f"{workload:8s} {phase:12s} {summary['output_tok_s']:8.1f} tok/s  TTFT p50/p90/p99 "
        f"{summary['ttft_p50_ms']}/{summary['ttft_p90_ms']}/{summary['ttft_p99_ms']} ms  cache hit "
        f"{summary['cache_hit_rate']}  refused {summary['refused']} failed {summary['failed']}"
        + (f"  ({summary['first_error']})" if summary["first_error"] else ""))  # fmt: skip
    return summary


def workloads(plan: Plan) -> dict[str, tuple[list[Call], list[float]]]:
    out = {}
    for workload in plan.workloads:
        calls = arrival_order(workload_calls(plan.shape, workload == "shared", plan.words), plan.seed)
        out[workload] = (calls, poisson_times(len(calls), plan.load, plan.seed))
    return out


def measure(plan: Plan, model_dir: str) -> list[dict]:
    os.environ["ENGINE_ARGS_JSON"] = json.dumps(
        {**json.loads(os.environ.get("ENGINE_ARGS_JSON") or "{}"), **plan.engine_args}
    )
    os.environ["ENGINE_PROFILE"] = plan.profile
    calls = workloads(plan)
    model_name = plan_model_name(plan)
    phases = []
    if plan.bare:
        with contextlib.ExitStack() as stack:
            log(f"starting {plan.workers} bare vLLM servers and the round-robin proxy")
            side = bare_side(plan, model_dir, model_name, stack)
            for workload in plan.workloads:
                phases.append(run_phase(side, BARE, workload, plan, calls))
    if not plan.policies:
        return add_ratios(phases)
    with contextlib.ExitStack() as stack:
        log(f"starting the platform with {plan.workers} workers in one pool")
        side, restart_web = platform_side(plan, model_dir, model_name, stack)
        for workload in plan.workloads:
            for policy in plan.policies:
                restart_web(policy)
                phases.append(run_phase(side, policy, workload, plan, calls))
    return add_ratios(phases)


def report_text(plan: Plan, phases: list[dict], checks: list, started: float) -> str:
    import vllm

    mean_prompt = {p["workload"]: p["mean_prompt_tokens"] for p in phases}
    lines = [
        f"Fleet bench, {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {time.time() - started:.0f} s, "
        f"vLLM {vllm.__version__}, {os.cpu_count()} CPU cores, profile {plan.profile}, {plan.workers} workers "
        f"(and {plan.workers} bare servers behind a round-robin proxy).",
        "",
        f"Workload per phase: {plan.shape.requests} streamed completions of {plan.shape.output_tokens} tokens "
        f"({plan.shape.tenants} tenants x {plan.shape.groups} groups x {plan.shape.conversations} conversations x "
        f"{plan.shape.turns} turns; system prompts of {plan.shape.system_words} words; mean prompt tokens "
        f"{mean_prompt}); Poisson arrivals rising from {plan.load.start_rate} to {plan.load.end_rate} requests/s. "
        f"Engine arguments on top of the profile: `{json.dumps(plan.engine_args)}`.",
        "",
        table(phases),
        "",
        *goal_lines(checks),
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer conversations and turns")
    parser.add_argument("--workers", type=int, default=0, help="workers in the pool (default 2 on the CPU, 4 on a GPU)")
    parser.add_argument("--profile", default="cpu", help="the engine profile (cpu, or h200 on a GPU)")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="the model (default: the tiny model; on a GPU the E4B shape, random weights)")  # fmt: skip
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated subset of the policies")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="shared, distinct or both")
    parser.add_argument("--no-bare", action="store_true", help="skip the bare servers")
    parser.add_argument("--rates", default="", metavar="START,END", help="the arrival rate's ramp, requests/s")
    parser.add_argument("--out", type=Path, default=None, help="folder for results.json and report.md")
    return parser


def plan_from(args: argparse.Namespace) -> Plan:
    gpu = args.profile != "cpu"
    workers = args.workers or (4 if gpu else 2)
    plan = gpu_plan(workers, args.quick) if gpu else cpu_plan(workers, args.quick)
    policies = tuple(p for p in args.policies.split(",") if p)
    loads = tuple(w for w in args.workloads.split(",") if w)
    unknown = (set(policies) - set(POLICIES)) | (set(loads) - set(WORKLOADS))
    if unknown:
        raise SystemExit(f"unknown policies or workloads: {sorted(unknown)}")
    load = plan.load
    if args.rates:
        start, end = (float(x) for x in args.rates.split(","))
        load = Load(start, end)
    return dataclasses.replace(plan, policies=policies, workloads=loads, bare=not args.no_bare, load=load)


def model_folder(plan: Plan, given: Path | None) -> str:
    if given:
        return str(given)
    if plan.gpu:
        from benchmarks.gpu import model

        return str(model.build(Path("/tmp/gpubench/model-e4b-tok"), with_tokenizer=True))
    from workers.tinymodel import build_tiny_model

    return str(build_tiny_model(ROOT / ".run" / "models" / MODEL_NAME))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    plan = plan_from(args)
    started = time.time()
    if frontend_cpus():
        os.sched_setaffinity(0, frontend_cpus())  # the load generator joins the serving processes' cores
    # The cpu profile's eager engines (ENGINE_ENFORCE_EAGER=false compiles them): this workload's
    # time goes to prefills, which compiling speeds up less than decode, and eight engines start in
    # a run, each in seconds instead of minutes of compile on a busy 2-core machine.
    model_dir = model_folder(plan, args.model_dir)
    log(f"{'quick' if args.quick else 'full'} run: {plan.workers} workers, profile {plan.profile}, "
        f"{plan.shape.requests} requests per phase, policies {plan.policies}, workloads {plan.workloads}")  # fmt: skip
    phases = measure(plan, model_dir)
    checks = goals(phases, plan.gpu)
    out = args.out or STATE_DIR / "fleet" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    text_report = report_text(plan, phases, checks, started)
    (out / "report.md").write_text(text_report + "\n")
    data = {"plan": dataclasses.asdict(plan), "phases": phases,
            "goals": [{"goal": n, "passed": p, "figures": d} for n, p, d in checks]}  # fmt: skip
    (out / "results.json").write_text(json.dumps(data, indent=2))
    print(text_report, flush=True)
    log(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
