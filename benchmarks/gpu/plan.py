"""What the GPU bench measures: the engine configurations, the load levels and the request shape.

Pure data and small functions (no vLLM import), so the plan is testable on a CPU machine.

Every engine configuration runs the same model folder with random weights (``load_format="dummy"``).
Several engines start side by side on the one GPU (their torch.compile and CUDA-graph capture
overlap, which saves minutes of device time) and are measured one at a time. So each gets a fixed
KV cache (``kv_cache_memory_bytes``, which also skips vLLM's memory profiling, unreliable while other
processes allocate) and a small ``gpu_memory_utilization`` (vLLM only checks that much is free at
start). That is the one deviation from each configuration's own settings; it does not change the
throughput measured, as long as the cache holds every running sequence (``BENCH_KV_CACHE_BYTES``
holds 128 sequences of 640 tokens with room to spare: vLLM reports 146k tokens for it).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

PROMPT_TOKENS = 128
OUTPUT_TOKENS = 512
# Streams (concurrent clients); each client sends requests one after another for the level's seconds.
PROFILE_LEVELS = (1, 8, 32, 128)
# BENCH_PLATFORM_LEVELS=128,256 measures only those (a device call with little time left).
PLATFORM_LEVELS = tuple(int(n) for n in os.environ.get("BENCH_PLATFORM_LEVELS", "32,128,256,512").split(","))
# How many turns each side of the platform comparison takes at each level (BENCH_PLATFORM_ROUNDS);
# a level's figure pools its turns (benchmarks/gpu/report.py ``rate``). See ``platform_schedule``.
PLATFORM_ROUNDS = max(1, int(os.environ.get("BENCH_PLATFORM_ROUNDS", "2")))
CAPACITY_LEVELS = (256, 512)
# Seconds per level. Up to 32 streams a few seconds repeat within 1% between runs; at 128 streams
# and more a 4-8 s window varied by ±20% (DESIGN.md): those levels run 30 s.
SHORT_LEVEL_S, LONG_LEVEL_S, LONG_FROM_STREAMS = 8.0, 30.0, 128
WARMUP_REQUESTS = 4
WARMUP_TOKENS = 32

BENCH_KV_CACHE_BYTES = 4 * 2**30
# The platform comparison runs 256 and 512 streams on the h200 profile (256 sequences at once): 4 GiB
# holds ~160 of them (the hybrid allocator keeps blocks per KV-cache group, docs/gpu.md "Capacity"),
# so both sides preempted there; 16 GiB holds 256 with room to spare (98k FP8 blocks did, 2026-12-01).
PLATFORM_KV_CACHE_BYTES = 16 * 2**30
BENCH_GPU_MEMORY_UTILIZATION = 0.05
BENCH_ARGS: dict[str, Any] = {
    "load_format": "dummy",
    "kv_cache_memory_bytes": BENCH_KV_CACHE_BYTES,
    "gpu_memory_utilization": BENCH_GPU_MEMORY_UTILIZATION,
}

# The profiles compared with stock vLLM, and changes to the h200 profile measured one at a time
# (each entry: what it changes, applied on top of the h200 profile's engine arguments).
PROFILES = ("h200", "a10g")
H200_VARIANTS: dict[str, dict[str, Any]] = {
    # The profile without FP8 weights: what the scheduler settings alone move against stock.
    "h200-bf16": {"quantization": None},
    # FP8 KV cache on top of FP8 weights (tried in the first run; not kept).
    "h200-fp8kv": {"kv_cache_dtype": "fp8"},
    # Outputs sent to the frontend every 4 tokens instead of every token (less per-step host work).
    "h200-si4": {"stream_interval": 4},
    # Per-step statistics off (no Prometheus metrics from the engine).
    "h200-nostats": {"disable_log_stats": True},
}
# Variants that change the engine process's environment rather than its arguments.
H200_ENV_VARIANTS: dict[str, dict[str, str]] = {
    # vLLM 0.26's older (V1) GPU model runner instead of the default V2 one.
    "h200-v1runner": {"VLLM_USE_V2_MODEL_RUNNER": "0"},
}
FIRST_RUN_VARIANTS = ("h200-bf16", "h200-fp8kv")
# vLLM's torch.compile fusion passes that are off by default: at one stream a decode step
# is mostly many small kernels (docs/gpu.md), which is what these fuse. Each needs the custom ops it
# matches enabled (vLLM's default, with Inductor, is none).
H200_FUSION_VARIANTS: dict[str, dict[str, Any]] = {
    # Q/K RMSNorm -> rotary embedding in one kernel (every layer has q/k norms).
    "h200-qknorm-rope": {
        "compilation_config": {
            "custom_ops": ["+rms_norm", "+rotary_embedding"],
            "pass_config": {"enable_qk_norm_rope_fusion": True},
        }
    },
    # RMSNorm (+ residual add) -> FP8 activation quantisation, activation -> FP8 quantisation.
    "h200-norm-quant": {
        "compilation_config": {
            "custom_ops": ["+rms_norm", "+quant_fp8"],
            "pass_config": {"fuse_norm_quant": True, "fuse_act_quant": True},
        }
    },
}


# The capacity stage: the h200 profile at 256 and 512 streams, bare engine only. Each entry: engine
# argument changes on top of h200, the levels, and whether the engine detokenizes.
CAPACITY_KV_CACHE_BYTES = 10 * 2**30  # 366k tokens: 512 sequences of 640 tokens fit without preemption
CAPACITY_RUNS: dict[str, tuple[dict[str, Any], tuple[int, ...], bool]] = {
    # The profile as it is (max_num_seqs 256; vLLM captures CUDA graphs up to min(2 x 256, 512)).
    "cap-h200": ({}, CAPACITY_LEVELS, False),
    # Twice the batch, CUDA graphs captured up to 512 sequences (vLLM's cap).
    "cap-seq512": ({"max_num_seqs": 512, "compilation_config": {"max_cudagraph_capture_size": 512}}, (512,), False),
    # FP8 KV cache: twice the tokens in the same memory, if it costs no speed.
    "cap-fp8kv": ({"kv_cache_dtype": "fp8"}, (256,), False),
    # As the platform's worker runs: with the tokenizer, detokenizing every output.
    "cap-h200-tok": ({}, (512,), True),
    "cap-seq512-tok": ({"max_num_seqs": 512, "compilation_config": {"max_cudagraph_capture_size": 512}}, (512,), True),
}

# The adapters stage: tenants' LoRA adapters on one engine (the h200 profile with its LoRA settings,
# workers/profiles.py: max_loras 32, max_lora_rank 16), 128 streams with their requests spread over
# N distinct rank-16 adapters of the attention projections (benchmarks/gpu/lora.py), N = 0 (the base
# model alone, on the LoRA-enabled engine) then 1, 8 and 32, side by side in one run; and the base
# model on the same profile without LoRA, for what enabling LoRA costs requests without an adapter.
ADAPTER_STREAMS = 128
ADAPTER_COUNTS = (0, 1, 8, 32)
ADAPTER_RANK = 16
# Seconds allowed per adapter level for loading its adapters (one short request each) before it.
ADAPTER_LOAD_S = 5.0

STAGES = (
    "profiles",
    "platform",
    "compare",
    "variants",
    "fusions",
    "capacity",
    "adapters",
    "interval",
    "turnaround",
    "cudagraph",
)
# What `device.sh bench` runs without arguments: the platform comparison alone fits one 600 s call
# with a cold start (engine start ~170-300 s, then 2 x 98 s of levels); the others take a call each.
DEFAULT_STAGES = ("platform",)


def level_seconds(streams: int, rounds: int = 1) -> float:
    """How long one turn at a level runs (its clients stop sending once their next request would not
    fit): a level measured in ``rounds`` turns splits its long time between them, never below the
    short level's."""
    full = LONG_LEVEL_S if streams >= LONG_FROM_STREAMS else SHORT_LEVEL_S
    return max(SHORT_LEVEL_S, full / rounds)


def planned_seconds(levels: tuple[int, ...] | list[int], warmup_s: float = 6.0, adapter_counts=(),
                    rounds: int = 1) -> float:  # fmt: skip
    """Seconds one engine's (or the platform's) measurement takes: warm-up and every turn of
    ``levels`` (turns of ``rounds``), plus the loading of each adapter level's adapters."""
    turns = sum(level_seconds(n, rounds) for n in levels)
    return warmup_s + turns + ADAPTER_LOAD_S * sum(1 for n in adapter_counts if n)


def platform_schedule(levels: tuple[int, ...] = PLATFORM_LEVELS, rounds: int = PLATFORM_ROUNDS) -> tuple[int, ...]:
    """The levels of the platform comparison in the order each side measures them: up, then down,
    ``rounds`` passes in all. With the turn order (``measure.turn_order``: who goes first alternates
    from one turn to the next) the two turns of each level then come as A B ... B A: a host that
    steals CPU for a while (2-5 s of steal in one side's 30 s turn, 2026-12-03) or drifts during
    the call weighs on both sides of a level, where one turn each put it all on one side."""
    schedule: list[int] = []
    for index in range(rounds):
        schedule += levels if index % 2 == 0 else levels[::-1]
    return tuple(schedule)


@dataclass(frozen=True)
class EngineRun:
    """One engine to start and measure: ``name``, its engine arguments, the stream counts."""

    name: str
    engine_args: dict[str, Any]
    levels: tuple[int, ...] = PROFILE_LEVELS
    description: str = ""
    env: dict[str, str] = field(default_factory=dict)
    # The adapters stage: hot adapters per level (0: the base model), and the adapters' folders.
    adapter_counts: tuple[int, ...] = ()
    adapter_dirs: tuple[str, ...] = ()
    # Turns per level: ``levels`` names each level this many times (``platform_schedule``).
    rounds: int = 1
    # The turnaround stage: each request waits a delay drawn from this range (ms) before it goes in.
    submit_delay_ms: tuple[float, float] | None = None

    def planned_seconds(self) -> float:
        return planned_seconds(self.levels, adapter_counts=self.adapter_counts, rounds=self.rounds)


def _bench(args: dict[str, Any], model_dir: str, tokenizer: bool) -> dict[str, Any]:
    args = {**args, **BENCH_ARGS, "model": model_dir}
    if not tokenizer:
        # Prompt token ids in, token ids out: no tokenizer, no detokenization.
        args["skip_tokenizer_init"] = True
    return {key: value for key, value in args.items() if value is not None}


def stock_run(model_dir: str) -> EngineRun:
    """vLLM's defaults (AsyncEngineArgs with only the model), as the reference."""
    return EngineRun("stock", _bench({}, model_dir, tokenizer=False), description="vLLM 0.26 defaults")


def profile_args(profile: str, model_dir: str, **changes: Any) -> dict[str, Any]:
    """A profile's engine arguments (workers/profiles.py) with ``changes`` on top, unbenched."""
    from workers.profiles import get_profile

    args = dict(get_profile(profile).engine_args)
    args.update(changes)
    return args


def profile_run(profile: str, model_dir: str, name: str | None = None, tokenizer: bool = False,
                levels: tuple[int, ...] = PROFILE_LEVELS, **changes: Any) -> EngineRun:  # fmt: skip
    args = _bench(profile_args(profile, model_dir, **changes), model_dir, tokenizer)
    description = f"profile {profile} {changes or ''}".strip()
    return EngineRun(name or profile, args, levels=levels, description=description)


def adapter_dirs(folder: str, count: int = max(ADAPTER_COUNTS)) -> tuple[str, ...]:
    """The adapters' folders (written by benchmarks/gpu/lora.py ``write_adapters``)."""
    return tuple(f"{folder}/a{i}" for i in range(1, count + 1))


def adapter_runs(model_dir: str, adapter_folder: str) -> list[EngineRun]:
    """``lora-on``: the h200 profile with its LoRA settings, at ``ADAPTER_STREAMS`` for each of
    ``ADAPTER_COUNTS``; ``lora-off``: the same profile without LoRA, base model, same streams."""
    from workers.profiles import get_profile

    lora_args = dict(get_profile("h200").lora_args)
    if lora_args["max_lora_rank"] < ADAPTER_RANK or lora_args["max_loras"] < max(ADAPTER_COUNTS):
        raise ValueError(f"the h200 profile's LoRA settings {lora_args} cannot hold {max(ADAPTER_COUNTS)} "
                         f"rank-{ADAPTER_RANK} adapters in one batch")  # fmt: skip
    on = profile_run("h200", model_dir, "lora-on", levels=(ADAPTER_STREAMS,) * len(ADAPTER_COUNTS), **lora_args)
    off = profile_run("h200", model_dir, "lora-off", levels=(ADAPTER_STREAMS,))
    dirs = adapter_dirs(adapter_folder)
    return [
        EngineRun(on.name, on.engine_args, on.levels, on.description, adapter_counts=ADAPTER_COUNTS, adapter_dirs=dirs),
        EngineRun(off.name, off.engine_args, off.levels, "profile h200 without LoRA", adapter_counts=(0,)),
    ]


def runs_for(stage: str, model_dir: str, tok_model_dir: str, adapter_folder: str = "/tmp/adapters") -> list[EngineRun]:
    """The engines of one stage of the bench.

    ``profiles``: stock vLLM and each profile at every level, plus the h200 variants without FP8
    and without FP8 KV cache. ``platform``: the platform path's bare-engine counterpart (the h200
    profile with the tokenizer and detokenization, exactly as the worker runs it) at the platform
    levels; run.py adds the platform itself. ``compare``: stock and h200 alone. ``variants``: the
    other single changes to h200, with stock and h200 again as the same-run references. ``fusions``:
    the compile-time fusion passes on top of h200, with the same references. ``adapters``: the
    LoRA-enabled h200 engine over 0-32 adapters and h200 without LoRA (``adapter_runs``).
    ``interval``: the platform stage's bare engine with one output per token (its profile) and with
    ``stream_interval`` 4 (``interval_runs``). ``turnaround``: that bare engine, and the same with
    each request held back before it goes in, as the platform's admission and hop hold it
    (``turnaround_runs``). ``cudagraph``: those two with piecewise and with full CUDA graphs for
    mixed prefill/decode steps (``cudagraph_runs``).
    """
    if stage == "profiles":
        runs = [stock_run(model_dir)] + [profile_run(p, model_dir) for p in PROFILES]
        return runs + [profile_run("h200", model_dir, name, **H200_VARIANTS[name]) for name in FIRST_RUN_VARIANTS]
    if stage == "platform":
        bare = profile_run("h200", tok_model_dir, "bare-h200", tokenizer=True, levels=platform_schedule())
        args = {**bare.engine_args, **platform_worker_overrides()}
        return [EngineRun(bare.name, args, bare.levels, bare.description, rounds=PLATFORM_ROUNDS)]
    if stage == "compare":
        return [stock_run(model_dir), profile_run("h200", model_dir)]
    if stage == "variants":
        runs = [stock_run(model_dir), profile_run("h200", model_dir)]
        runs += [profile_run("h200", model_dir, name, **changes) for name, changes in H200_VARIANTS.items()
                 if name not in FIRST_RUN_VARIANTS]  # fmt: skip
        for name, env in H200_ENV_VARIANTS.items():
            run = profile_run("h200", model_dir, name)
            runs.append(EngineRun(run.name, run.engine_args, run.levels, f"profile h200, env {env}", env=env))
        return runs
    if stage == "fusions":
        runs = [stock_run(model_dir), profile_run("h200", model_dir)]
        fusions = H200_FUSION_VARIANTS.items()
        return runs + [profile_run("h200", model_dir, name, **changes) for name, changes in fusions]
    if stage == "capacity":
        runs = []
        for name, (changes, levels, tokenizer) in CAPACITY_RUNS.items():
            run = profile_run("h200", tok_model_dir if tokenizer else model_dir, name, tokenizer=tokenizer,
                              levels=levels, **changes)  # fmt: skip
            # Room for every running sequence (the other stages' 4 GiB holds 228 of 640 tokens).
            kv = CAPACITY_KV_CACHE_BYTES if max(levels) > 256 and run.engine_args.get("max_num_seqs", 0) > 256 \
                else CAPACITY_KV_CACHE_BYTES * 6 // 10  # fmt: skip
            runs.append(EngineRun(name, {**run.engine_args, "kv_cache_memory_bytes": kv}, levels, run.description))
        return runs
    built_elsewhere = {
        "adapters": lambda: adapter_runs(model_dir, adapter_folder),
        "interval": lambda: interval_runs(tok_model_dir),
        "turnaround": lambda: turnaround_runs(tok_model_dir),
        "cudagraph": lambda: cudagraph_runs(tok_model_dir),
    }
    if stage in built_elsewhere:
        return built_elsewhere[stage]()
    raise ValueError(f"unknown stage {stage!r}; expected one of {', '.join(STAGES)}")


# The interval stage's levels: where the platform's worker handles the most outputs per second.
INTERVAL_LEVELS = (128, 256, 512)


def interval_runs(tok_model_dir: str) -> list[EngineRun]:
    """The h200 profile (one output per request and token) against ``stream_interval`` 4 (an output
    every 4 tokens, which would spare the platform's worker three outputs in four), each as the
    platform stage's bare engine runs (tokenizer, detokenization, its KV cache): what the setting
    costs or gains the engine itself at large batches."""
    runs = []
    for name, interval in (("bare-si1", 1), ("bare-si4", 4)):
        run = profile_run("h200", tok_model_dir, name, tokenizer=True, levels=INTERVAL_LEVELS, stream_interval=interval)
        args = {**run.engine_args, **platform_worker_overrides()}
        runs.append(EngineRun(run.name, args, run.levels, run.description))
    return runs


# The turnaround stage: the levels around the engine's max_num_seqs (256 in the h200 profile), and
# the mean delay a request is held back (BENCH_TURNAROUND_MS): about what a request spent between
# the client's send and the engine through the platform at 256 streams (gateway + hop p50, 94-118
# ms on 2026-12-05). Each delay is drawn from 0 to twice the mean, as the platform's vary.
TURNAROUND_LEVELS = (128, 256, 512)
TURNAROUND_MS = float(os.environ.get("BENCH_TURNAROUND_MS") or 100)


def turnaround_runs(tok_model_dir: str, levels: tuple[int, ...] = TURNAROUND_LEVELS, prefix: str = "bare",
                    **changes: Any) -> list[EngineRun]:  # fmt: skip
    """The platform stage's bare engine as it is (``bare-h200``) and with every request held back a
    random 0 to 2 x ``TURNAROUND_MS`` before it goes in (``bare-turnaround``), the two taking turns
    level by level like the platform stage's sides: what the platform's time from a client's send
    to the engine costs the throughput by itself, with no other part of the platform running. At
    256 streams, the engine's ``max_num_seqs``, a finished request's slot then stays empty until
    the client's next request is in; at 512 the engine's own queue fills it. ``changes`` go on top
    of the profile for both (``prefix`` names them: ``PREFIX-h200``, ``PREFIX-turnaround``)."""
    levels = platform_schedule(levels)
    bare = profile_run("h200", tok_model_dir, f"{prefix}-h200", tokenizer=True, levels=levels, **changes)
    args = {**bare.engine_args, **platform_worker_overrides()}
    held_back = f"{bare.description}, requests held back 0-{2 * TURNAROUND_MS:.0f} ms"
    return [
        EngineRun(bare.name, args, levels, bare.description, rounds=PLATFORM_ROUNDS),
        EngineRun(f"{prefix}-turnaround", args, levels, held_back, rounds=PLATFORM_ROUNDS,
                  submit_delay_ms=(0.0, 2 * TURNAROUND_MS)),
    ]  # fmt: skip


# The cudagraph stage: 256 streams (the engine's max_num_seqs), where requests that arrive spread out
# put a prefill into many more engine steps than a wave that arrives at once. FULL_AND_PIECEWISE (vLLM's
# default) runs such a mixed step on piecewise CUDA graphs (attention outside them); FULL captures
# whole-step graphs for mixed batches too (FlashAttention 3, on Hopper, supports them). Four engines
# of ~29 GiB each (10.4 GiB of weights, the platform stage's 16 GiB KV cache, graphs): an H200's
# memory, not an H100's.
CUDAGRAPH_LEVELS = tuple(int(n) for n in os.environ.get("BENCH_CUDAGRAPH_LEVELS", "256").split(","))
CUDAGRAPH_MODES = {"piecewise": "FULL_AND_PIECEWISE", "full": "FULL"}


def cudagraph_runs(tok_model_dir: str) -> list[EngineRun]:
    """The turnaround stage's two engines once per CUDA-graph mode of ``CUDAGRAPH_MODES``
    (``piecewise-h200``, ``piecewise-turnaround``, ``full-h200``, ``full-turnaround``), whatever the
    profile sets, all four taking turns at ``CUDAGRAPH_LEVELS``: whether spread-out arrivals cost
    the engine time per token, and whether whole-step graphs for mixed steps win it back."""
    runs = []
    for prefix, mode in CUDAGRAPH_MODES.items():
        runs += turnaround_runs(tok_model_dir, CUDAGRAPH_LEVELS, prefix, compilation_config={"cudagraph_mode": mode})
    return runs


def engine_changes() -> dict[str, Any]:
    """``BENCH_ENGINE_CHANGES``, a JSON object of engine arguments put on top of the h200 profile on
    both sides of the platform comparison (and of the interval, turnaround and cudagraph stages):
    a change to the profile measured through the platform without editing the profile."""
    raw = os.environ.get("BENCH_ENGINE_CHANGES", "").strip()
    changes = json.loads(raw) if raw else {}
    if not isinstance(changes, dict):
        raise ValueError(f"BENCH_ENGINE_CHANGES must be a JSON object, got {raw!r}")
    return changes


def platform_worker_overrides() -> dict[str, Any]:
    """ENGINE_ARGS_JSON for the platform's worker: ``engine_changes``, random weights and the bench's
    memory settings (the platform comparison's larger KV cache, the same for its bare engine)."""
    return {**engine_changes(), **BENCH_ARGS, "kv_cache_memory_bytes": PLATFORM_KV_CACHE_BYTES}
