"""Measure one engine configuration on the bare vLLM engine (runs on the device machine).

    python -m benchmarks.gpu.engine_bench --spec SPEC.json --out RESULT.json --lock FILE

SPEC.json: {"name", "engine_args", "levels"}, and for the adapters stage "adapter_counts" (one per
level) and "adapter_dirs" (PEFT folders, benchmarks/gpu/lora.py). Builds vLLM's
``AsyncLLM`` from the arguments, waits for its turn on the GPU (an exclusive lock, as several
engines start side by side), warms up, runs each level (``measure.py``), writes the result (with the
start-up time and the resolved scheduler settings) and shuts the engine down. A level with N
adapters sends client i's requests with adapter i mod N (128 streams over 8 adapters: 16 streams
each), after a warm-up request per adapter has loaded all N onto the GPU, so loading is not
measured; N = 0 is the base model.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from benchmarks.gpu import measure
from benchmarks.gpu.plan import OUTPUT_TOKENS, WARMUP_REQUESTS, WARMUP_TOKENS, level_seconds
from benchmarks.gpu.worker_metrics import bucket_counts
from benchmarks.profiling import CpuMeter


def _resolved(engine) -> dict:
    """The settings the engine actually runs with (after vLLM's defaults and checks)."""
    cfg = engine.vllm_config
    out = {}
    for key, getter in {
        "async_scheduling": lambda: cfg.scheduler_config.async_scheduling,
        "max_num_seqs": lambda: cfg.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": lambda: cfg.scheduler_config.max_num_batched_tokens,
        "max_model_len": lambda: cfg.model_config.max_model_len,
        "quantization": lambda: cfg.model_config.quantization,
        "kv_cache_dtype": lambda: cfg.cache_config.cache_dtype,
        "num_gpu_blocks": lambda: cfg.cache_config.num_gpu_blocks,
        "cudagraph_mode": lambda: str(cfg.compilation_config.cudagraph_mode),
        "cudagraph_sizes": lambda: len(cfg.compilation_config.cudagraph_capture_sizes or []),
        "max_cudagraph_size": lambda: cfg.compilation_config.max_cudagraph_capture_size,
        "compilation_mode": lambda: str(cfg.compilation_config.mode),
        "attention_backend": lambda: str(cfg.attention_config.backend),
        "prefix_caching": lambda: cfg.cache_config.enable_prefix_caching,
        "max_loras": lambda: cfg.lora_config.max_loras if cfg.lora_config else None,
        "max_lora_rank": lambda: cfg.lora_config.max_lora_rank if cfg.lora_config else None,
        "cudagraph_specialize_lora": lambda: cfg.compilation_config.cudagraph_specialize_lora,
    }.items():
        try:
            out[key] = getter()
        except Exception as exc:  # a field moved between vLLM versions: say so, measure anyway
            out[key] = f"n/a ({type(exc).__name__})"
    return out


async def _one_request(engine, request_id: str, prompt: list[int], sampling, lora=None) -> measure.RequestRecord:
    submitted = time.perf_counter()
    first, tokens = None, 0
    async for output in engine.generate({"prompt_token_ids": prompt}, sampling, request_id, lora_request=lora):
        new = len(output.outputs[0].token_ids)
        if new and first is None:
            first = time.perf_counter()
        tokens += new
    return measure.RequestRecord(submitted, first, time.perf_counter(), tokens)


async def run_level(engine, name: str, streams: int, seconds: float, seed: int, high: int, sampling,
                    loras: list | None = None, turns: measure.Turns | None = None):  # fmt: skip
    """One level; with ``loras``, client i sends every request with ``loras[i % len(loras)]``; with
    ``turns``, as many requests per client as the stream count's first turn (``Turns.request_counts``)."""

    async def one(i: int, n: int) -> measure.RequestRecord:
        prompt = measure.prompt(seed + streams, i, n, high=high)
        lora = loras[i % len(loras)] if loras else None
        return await _one_request(engine, f"{name}-{streams}-{i}-{n}", prompt, sampling, lora)

    counts = turns.request_counts(streams) if turns is not None else None
    records, started, errors = await measure.drive(streams, seconds, one, counts)
    if turns is not None:
        turns.keep_request_counts(streams, records)
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed at {streams} streams: {errors[0]}")
    return measure.summarize(streams, records, started)


def preemptions() -> float | None:
    """vLLM's preemption counter (its Prometheus metric in this process), None where it has none."""
    try:
        from prometheus_client import REGISTRY

        total = None
        for metric in REGISTRY.collect():
            if "num_preemptions" in metric.name:
                for sample in metric.samples:
                    if sample.name.endswith("_total") or sample.name == metric.name:
                        total = (total or 0.0) + sample.value
        return total
    except Exception:
        return None


def step_token_counts() -> dict[str, float] | None:
    """vLLM's histogram of tokens per engine step in this process's Prometheus registry (``bucket_counts``)."""
    try:
        from prometheus_client import REGISTRY

        return bucket_counts(REGISTRY.collect())
    except Exception:
        return None


def lora_requests(spec: dict) -> list:
    """vLLM ``LoRARequest``s for the spec's adapter folders (ids from 1: 0 means none to vLLM)."""
    if not spec.get("adapter_dirs"):
        return []
    from vllm.lora.request import LoRARequest

    return [LoRARequest(f"adapter-{i}", i, path) for i, path in enumerate(spec["adapter_dirs"], start=1)]


async def bench(spec: dict, lock: str, barrier: str, seed: int, checkpoint: Callable[[dict], None]) -> dict:
    """Start the engine, then measure its levels in the turns the barrier hands out; ``checkpoint``
    gets the result so far after each turn (measure.partial)."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    name = spec["name"]
    result: dict = {"name": name, "engine_args": spec["engine_args"], "levels": []}
    t0 = time.monotonic()
    try:
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**spec["engine_args"]))
    except BaseException:
        measure.wait_for_start(barrier, name, ok=False, timeout=0)
        raise
    result["start_s"] = round(time.monotonic() - t0, 1)
    result["resolved"] = _resolved(engine)
    print(f"[{name}] engine ready in {result['start_s']} s: {result['resolved']}", flush=True)
    try:
        if not await asyncio.to_thread(measure.wait_for_start, barrier, name, True):
            raise TimeoutError("no go to measure came in time")
        with measure.Turns(barrier, name, lock) as turns:
            warm = SamplingParams(max_tokens=WARMUP_TOKENS, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
            sampling = SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
            high = spec.get("prompt_id_high", measure.PROMPT_ID_HIGH)
            result["level_scale"] = scale = measure.read_scale(barrier)
            loras = lora_requests(spec)

            async def measure_level(index: int, streams: int, count: int | None) -> dict:
                """One level (after loading its adapters, if any), with its CPU seconds."""
                hot, load_s = (loras[:count] if count else None), None
                if hot:  # one short request per adapter: all of them loaded before the level starts
                    loaded = time.monotonic()
                    await run_level(engine, f"{name}-load{index}", len(hot), 0, seed + 2, high, warm,
                                    loras=hot)  # fmt: skip
                    load_s = round(time.monotonic() - loaded, 2)
                # Adapter levels (and a level's later turns) share a stream count: prompts of their own,
                # or the prefix cache would hand a later level the earlier one's prefills.
                if count is None:
                    level_seed = measure.turn_seed(seed, spec["levels"], index)
                else:
                    level_seed = seed + 1000 * (index + 1)
                before, steps_before = preemptions(), step_token_counts()
                seconds = level_seconds(streams, spec.get("rounds", 1)) * scale
                # The same parts as the platform's meter (platform_bench.Stack.cpu_meter): this
                # process is the engine's client, its child the engine core.
                cpu = CpuMeter({"client": (os.getpid(), "self"), "engine core": (os.getpid(), "children")}, waits=True)
                cpu.start()
                level = (await run_level(engine, f"{name}-{index}", streams, seconds, level_seed, high, sampling,
                                         loras=hot, turns=turns)).to_dict()  # fmt: skip
                after = preemptions()
                level["engine_steps"] = measure.engine_steps(steps_before, step_token_counts(), streams)
                level["cpu_s"] = cpu.stop()
                level["target_s"] = round(seconds, 1)
                level["preemptions"] = None if before is None or after is None else after - before
                if count is not None:
                    level["adapters"] = count
                    level["adapter_load_s"] = load_s
                print(f"[{name}] {streams:>4} streams, adapters {count}: {level['tokens_per_s']:>9.1f} tok/s "
                      f"over {level['wall_s']:.1f} s "
                      f"(ttft p50 {level['ttft_ms_p50']} ms, tpot p50 {level['tpot_ms_p50']} ms, "
                      f"batch {level['max_generating']}, preemptions {level['preemptions']}, "
                      f"steps {level['engine_steps']})", flush=True)  # fmt: skip
                return level

            counts = spec.get("adapter_counts") or [None] * len(spec["levels"])
            for index, (streams, count) in enumerate(zip(spec["levels"], counts, strict=True)):
                # Off the event loop: the engine client's output handler keeps running meanwhile.
                await asyncio.to_thread(turns.wait, index)
                try:
                    if index == 0:
                        await run_level(engine, f"{name}-warmup", WARMUP_REQUESTS, 0, seed + 1, high, warm)
                    result["levels"].append(await measure_level(index, streams, count))
                    checkpoint(measure.partial(result, len(spec["levels"])))
                finally:
                    turns.done(index)
            result["waited_for_gpu_s"] = round(turns.waited, 1)
    finally:
        engine.shutdown()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--lock", required=True)
    parser.add_argument("--barrier", required=True, help="folder for the start barrier (see measure.wait_for_start)")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    spec = json.loads(args.spec.read_text())
    try:
        checkpoint = functools.partial(measure.write_json, args.out)
        result = asyncio.run(bench(spec, args.lock, args.barrier, args.seed, checkpoint))
    except Exception as exc:
        traceback.print_exc()
        result = {"name": spec["name"], "engine_args": spec["engine_args"], "error": f"{type(exc).__name__}: {exc}"}
        measure.write_json(args.out, result)
        return 1
    measure.write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
