"""What the GPU bench measures: the engine configurations, the load levels and the request shape.

Pure data and small functions (no vLLM import), so the plan is testable on a CPU machine.

Every engine configuration runs the same model folder with random weights (``load_format="dummy"``).
Several engines start side by side on the one GPU (their torch.compile and CUDA-graph capture
overlap, which saves minutes of device time) and are measured one at a time. So each gets a fixed
KV cache (``kv_cache_memory_bytes``, which also skips vLLM's memory profiling, unreliable while other
processes allocate) and a small ``gpu_memory_utilization`` (vLLM only checks that much is free at
start). That is the one deviation from each configuration's own settings; it does not change the
throughput measured, as long as the cache holds every running sequence (``KV_CACHE_BYTES``
holds 128 sequences of 640 tokens with room to spare: vLLM reports 146k tokens for it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PROMPT_TOKENS = 128
OUTPUT_TOKENS = 512
# Streams (concurrent clients); each client sends requests one after another for the level's seconds.
PROFILE_LEVELS = (1, 8, 32, 128)
# The platform comparison's levels (run.py ``--levels`` measures others, e.g. 128,256 in a short call).
PLATFORM_LEVELS = (32, 128, 256, 512)
# How many turns each side of the platform comparison takes at each level (run.py ``--rounds``);
# a level's figure pools its turns (benchmarks/gpu/report.py ``rate``). See ``platform_schedule``.
PLATFORM_ROUNDS = 2
CAPACITY_LEVELS = (256, 512)
# Seconds per level. Up to 32 streams a few seconds repeat within 1% between runs; at 128 streams
# and more a 4-8 s window varied by ±20% (DESIGN.md): those levels run 30 s.
SHORT_LEVEL_S, LONG_LEVEL_S, LONG_FROM_STREAMS = 8.0, 30.0, 128
WARMUP_REQUESTS = 4
WARMUP_TOKENS = 32

KV_CACHE_BYTES = 4 * 2**30
# The platform comparison runs 256 and 512 streams on the h200 profile (256 sequences at once): 4 GiB
# holds ~160 of them (the hybrid allocator keeps blocks per KV-cache group, docs/gpu.md "Capacity"),
# so both sides preempted there; 16 GiB holds 256 with room to spare (98k FP8 blocks did, 2026-12-01).
PLATFORM_KV_CACHE_BYTES = 16 * 2**30
GPU_MEMORY_UTILIZATION = 0.05
COMMON_ARGS: dict[str, Any] = {
    "load_format": "dummy",
    "kv_cache_memory_bytes": KV_CACHE_BYTES,
    "gpu_memory_utilization": GPU_MEMORY_UTILIZATION,
}

# The profiles compared with stock vLLM, and changes to the h200 profile measured one at a time
# (each entry: what it changes, applied on top of the h200 profile's engine arguments).
PROFILES = ("h200", "a10g")
# The h200 profile's variants the profiles stage measures beside it (each entry: what it changes,
# applied on top of the h200 profile's engine arguments).
H200_VARIANTS: dict[str, dict[str, Any]] = {
    # The profile without FP8 weights: what the scheduler settings alone move against stock.
    "h200-bf16": {"quantization": None},
    # FP8 KV cache on top of FP8 weights.
    "h200-fp8kv": {"kv_cache_dtype": "fp8"},
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

STAGES = ("platform", "profiles", "capacity", "adapters")
# What run.py runs without ``--stage``: the platform comparison alone fits one 600 s call with a
# cold start (engine start ~170-300 s, then 2 x 98 s of levels); the others take about as long each.
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
    # The adapters stage: hot adapters per level (0: the base model), and the adapters' folders.
    adapter_counts: tuple[int, ...] = ()
    adapter_dirs: tuple[str, ...] = ()
    # Turns per level: ``levels`` names each level this many times (``platform_schedule``).
    rounds: int = 1

    def planned_seconds(self) -> float:
        return planned_seconds(self.levels, adapter_counts=self.adapter_counts, rounds=self.rounds)


def _bench(args: dict[str, Any], model_dir: str, tokenizer: bool) -> dict[str, Any]:
    args = {**args, **COMMON_ARGS, "model": model_dir}
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


def runs_for(stage: str, model_dir: str, tok_model_dir: str, adapter_folder: str = "/tmp/adapters",
             levels: tuple[int, ...] = PLATFORM_LEVELS, rounds: int = PLATFORM_ROUNDS) -> list[EngineRun]:  # fmt: skip
    """The engines of one stage of the bench.

    ``platform``: the platform path's bare-engine counterpart (the h200 profile with the tokenizer
    and detokenization, exactly as the worker runs it) at ``levels`` in ``rounds`` turns each;
    run.py adds the platform itself. ``profiles``: stock vLLM and each profile at every level, plus
    the h200 variants without FP8 weights and with FP8 KV cache. ``capacity``: h200 at 256 and 512
    streams (``CAPACITY_RUNS``). ``adapters``: the LoRA-enabled h200 engine over 0-32 adapters and
    h200 without LoRA (``adapter_runs``).
    """
    if stage == "platform":
        bare = profile_run("h200", tok_model_dir, "bare-h200", tokenizer=True, levels=platform_schedule(levels, rounds))
        args = {**bare.engine_args, **platform_worker_overrides()}
        return [EngineRun(bare.name, args, bare.levels, bare.description, rounds=rounds)]
    if stage == "profiles":
        runs = [stock_run(model_dir)] + [profile_run(p, model_dir) for p in PROFILES]
        return runs + [profile_run("h200", model_dir, name, **changes) for name, changes in H200_VARIANTS.items()]
    if stage == "capacity":
        return capacity_runs(model_dir, tok_model_dir)
    if stage == "adapters":
        return adapter_runs(model_dir, adapter_folder)
    raise ValueError(f"unknown stage {stage!r}; expected one of {', '.join(STAGES)}")


def capacity_runs(model_dir: str, tok_model_dir: str) -> list[EngineRun]:
    """The capacity stage's engines (``CAPACITY_RUNS``), each with room for its running sequences."""
    runs = []
    for name, (changes, levels, tokenizer) in CAPACITY_RUNS.items():
        run = profile_run("h200", tok_model_dir if tokenizer else model_dir, name, tokenizer=tokenizer,
                          levels=levels, **changes)  # fmt: skip
        # Room for every running sequence (the other stages' 4 GiB holds 228 of 640 tokens).
        kv = CAPACITY_KV_CACHE_BYTES if max(levels) > 256 and run.engine_args.get("max_num_seqs", 0) > 256 \
            else CAPACITY_KV_CACHE_BYTES * 6 // 10  # fmt: skip
        runs.append(EngineRun(name, {**run.engine_args, "kv_cache_memory_bytes": kv}, levels, run.description))
    return runs


def platform_worker_overrides() -> dict[str, Any]:
    """ENGINE_ARGS_JSON for the platform's worker: random weights and the bench's memory settings
    (the platform comparison's larger KV cache, the same for its bare engine)."""
    return {**COMMON_ARGS, "kv_cache_memory_bytes": PLATFORM_KV_CACHE_BYTES}
