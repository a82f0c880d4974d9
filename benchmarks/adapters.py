"""Tenants' LoRA adapters against the base model on one engine: tokens/s with N adapters hot.

    python -m benchmarks.adapters --model .run/models/tiny-gemma4 --adapters 1,8,32 --batch 32
    python -m benchmarks.adapters --model DIR --engine-arg max_loras=32 --json out.json

One engine, built as a worker builds it (``workers.profiles.engine_args_for``: ``enable_lora`` with
the profile's ``max_loras``/``max_lora_rank``/``max_cpu_loras``; ``--engine-arg`` on top), serves in
the same run: the base model alone, then for each N, ``--batch`` concurrent requests spread round
robin over N adapters. The adapters are random rank-``--rank`` PEFT adapters of the model's attention
projections (q/k/v/o_proj, from its safetensors headers), written to a temporary folder and loaded
(made hot) by a short warm-up before each measured round; each round is repeated ``--rounds`` times
and the median kept. Prompts are random token ids, completions exactly ``--output-tokens`` long
(``ignore_eos``), greedy. Reported: aggregate output tok/s and its ratio to the base model's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.engine_profile import build_engine_args, parse_engine_args, prompt_ids, vocab_size

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


def projection_shapes(model_dir: Path) -> dict[str, tuple[int, int]]:
    """{module name: (out, in)} of the model's attention projections, from its safetensors headers."""
    shapes = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, entry in header.items():
            # The decoder's layers only (a multimodal checkpoint's towers have projections too).
            decoder = name.startswith(("model.layers.", "model.language_model.layers."))
            if decoder and name.endswith(".weight") and name.rsplit(".", 2)[-2] in MODULES:
                shapes[name[: -len(".weight")]] = tuple(entry["shape"])
    if not shapes:
        raise SystemExit(f"{model_dir}: no attention projections in its safetensors files")
    return shapes


def write_adapter(out: Path, shapes: dict[str, tuple[int, int]], rank: int, seed: int) -> Path:
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (out_features, in_features) in shapes.items():
        prefix = f"base_model.model.{module}"
        tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, in_features, generator=generator) * 0.05).to(
            torch.bfloat16
        )
        tensors[f"{prefix}.lora_B.weight"] = (torch.randn(out_features, rank, generator=generator) * 0.05).to(
            torch.bfloat16
        )
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank, "lora_dropout": 0.0,
        "target_modules": list(MODULES), "bias": "none",
    }))  # fmt: skip
    return out


async def _one(engine, request_id: str, ids: list[int], params, lora) -> tuple[float, float, int]:
    submitted, tokens = time.perf_counter(), 0
    async for output in engine.generate({"prompt_token_ids": ids}, params, request_id, lora_request=lora):
        tokens += len(output.outputs[0].token_ids)  # DELTA outputs: the new tokens only
        if output.finished:
            break
    return submitted, time.perf_counter(), tokens


async def _round(engine, loras: list, batch: int, output_tokens: int, args, rng, vocab: int, tag: str) -> float:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(max_tokens=output_tokens, ignore_eos=True, temperature=0.0,
                            output_kind=RequestOutputKind.DELTA)  # fmt: skip
    records = await asyncio.gather(*(
        _one(engine, f"{tag}-{i}", prompt_ids(rng, args.prompt_tokens, vocab), params,
             loras[i % len(loras)] if loras else None)
        for i in range(batch)
    ))  # fmt: skip
    start, end = min(r[0] for r in records), max(r[1] for r in records)
    return sum(r[2] for r in records) / (end - start)


async def measure(engine_args: dict, args, adapter_dirs: list[Path], counts: list[int]) -> list[dict]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))
    rng = random.Random(args.seed)
    vocab = vocab_size(Path(args.model))
    loras = [LoRARequest(f"adapter-{i + 1}", i + 1, str(path)) for i, path in enumerate(adapter_dirs)]
    results = []
    try:
        for count in counts:
            hot = loras[:count]
            # Warm-up: every adapter of the round loaded (hot) before it is measured.
            await _round(engine, hot, max(len(hot), 1), 4, args, rng, vocab, f"warm{count}")
            runs = [await _round(engine, hot, args.batch, args.output_tokens, args, rng, vocab, f"n{count}r{r}")
                    for r in range(args.rounds)]  # fmt: skip
            result = {
                "adapters": count, "enable_lora": bool(engine_args.get("enable_lora")), "batch": args.batch,
                "tokens_per_second": round(statistics.median(runs), 1), "runs": [round(r, 1) for r in runs],
            }  # fmt: skip
            results.append(result)
            print(json.dumps(result), flush=True)
    finally:
        engine.shutdown()
    return results


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("ENGINE_LORA", "1")  # the profile's LoRA settings, as an adapter-serving worker runs
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default=os.environ.get("ENGINE_PROFILE", "cpu"))
    parser.add_argument("--model", required=True, help="model folder with safetensors weights")
    parser.add_argument("--adapters", default="1,8,32", help="numbers of hot adapters to compare with the base")
    parser.add_argument("--batch", type=int, default=32, help="concurrent requests per round")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-arg", action="append", default=[], metavar="NAME=JSON")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--without-lora", action="store_true",
                        help="also measure the base model on an engine built without enable_lora")  # fmt: skip
    args = parser.parse_args(argv)
    args.adapters = [int(n) for n in args.adapters.split(",")]

    from workers.profiles import engine_env_for

    os.environ.update(engine_env_for(args.profile))
    overrides = {"max_cpu_loras": max(args.adapters), **parse_engine_args(args.engine_arg)}
    engine_args = build_engine_args(args.profile, args.model, False, overrides)
    print(json.dumps({"profile": args.profile, "engine_args": engine_args}, default=str), flush=True)
    shapes = projection_shapes(Path(args.model))
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        dirs = [write_adapter(Path(tmp) / f"a{i}", shapes, args.rank, seed=i) for i in range(max(args.adapters))]
        results = asyncio.run(measure(engine_args, args, dirs, [0, *args.adapters]))
        if args.without_lora:
            plain = dict(engine_args, enable_lora=False)
            for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
                plain.pop(name, None)
            results = asyncio.run(measure(plain, args, [], [0])) + results
    base = next(r for r in results if r["adapters"] == 0 and r["enable_lora"] == bool(engine_args.get("enable_lora")))
    for result in results:
        result["vs_base"] = round(result["tokens_per_second"] / base["tokens_per_second"], 3)
    report = {"profile": args.profile, "model": args.model, "engine_args": engine_args, "rank": args.rank,
              "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens, "results": results}  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps(report, default=str))
    return 0


if __name__ == "__main__":  # vLLM starts its engine process with spawn: the guard is required
    sys.exit(main())
