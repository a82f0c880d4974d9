"""Measure an engine profile: tokens/s at one stream and batched, on the engine the worker hosts.

    python -m benchmarks.engine_profile --profile cpu --model .run/models/tiny-gemma4
    python -m benchmarks.engine_profile --profile a10g --model /path/to/gemma-4-E4B-it-int4 \\
        --batches 1,8,32,64 --output-tokens 512 --json a10g.json
    python -m benchmarks.engine_profile --profile h200 --model CONFIG_ONLY_DIR --dummy \\
        --engine-arg 'max_model_len=4096'

The engine is vLLM's ``AsyncLLM`` built from ``workers.profiles.engine_args_for(profile, model)``,
exactly the arguments a worker uses (ENGINE_ARGS_JSON and ``--engine-arg NAME=JSON`` apply on top).
Prompts are random token ids (distinct per request, so prefix caching does not skip prefills);
completions are exactly ``--output-tokens`` long (``ignore_eos``), greedy.

``--dummy`` loads random weights (``load_format="dummy"``): a model folder with only config.json is
enough. A folder without tokenizer files is run with ``skip_tokenizer_init`` (token ids in and out,
no detokenization), so no tokenizer is needed either. Throughput on random weights equals real
weights' for the same shapes, except with speculative decoding, whose drafter accepts nothing.

For each batch size B, B requests are submitted at once; reported: aggregate output tok/s (all
tokens over first submission to last token), per-stream decode tok/s (median of (tokens - 1) /
(last token - first token)) and the median time to first token. Batch 1 runs ``--rounds`` times
and reports the median round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def parse_engine_args(items: list[str]) -> dict[str, Any]:
    """``NAME=JSON`` pairs (a value that is not JSON is taken as a string)."""
    out: dict[str, Any] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"--engine-arg takes NAME=VALUE, got {item!r}")
        try:
            out[name] = json.loads(raw)
        except json.JSONDecodeError:
            out[name] = raw
    return out


def vocab_size(model_dir: Path) -> int:
    """The text vocabulary size from config.json (nested text_config for multimodal Gemma)."""
    config = json.loads((model_dir / "config.json").read_text())
    return int((config.get("text_config") or {}).get("vocab_size") or config["vocab_size"])


def build_engine_args(profile: str, model: str, dummy: bool, overrides: dict[str, Any]) -> dict[str, Any]:
    from workers.profiles import engine_args_for

    extra: dict[str, Any] = {}
    model_dir = Path(model)
    if dummy:
        extra["load_format"] = "dummy"
    if model_dir.is_dir() and not any((model_dir / name).exists() for name in TOKENIZER_FILES):
        extra["skip_tokenizer_init"] = True
    return engine_args_for(profile, model, **extra, **overrides)


def prompt_ids(rng: random.Random, count: int, vocab: int) -> list[int]:
    # Clear of the special tokens at the bottom of Gemma's vocabulary.
    return [rng.randrange(10, vocab) for _ in range(count)]


async def one_request(engine, request_id: str, ids: list[int], params) -> dict:
    submitted, first, tokens = time.perf_counter(), None, 0
    async for output in engine.generate({"prompt_token_ids": ids}, params, request_id):
        new = len(output.outputs[0].token_ids)  # DELTA outputs: the new tokens only
        if new and first is None:
            first = time.perf_counter()
        tokens += new
        if output.finished:
            break
    return {"submitted": submitted, "first": first, "ended": time.perf_counter(), "tokens": tokens}


async def run_batch(engine, batch: int, args, rng: random.Random, vocab: int, tag: str, output_tokens: int) -> dict:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(max_tokens=output_tokens, ignore_eos=True, temperature=0.0,
                            output_kind=RequestOutputKind.DELTA, detokenize=not args.skip_tokenizer)  # fmt: skip
    records = await asyncio.gather(*(
        one_request(engine, f"{tag}-{i}", prompt_ids(rng, args.prompt_tokens, vocab), params) for i in range(batch)
    ))  # fmt: skip
    start = min(r["submitted"] for r in records)
    end = max(r["ended"] for r in records)
    total = sum(r["tokens"] for r in records)
    decode = [(r["tokens"] - 1) / (r["ended"] - r["first"]) for r in records if r["first"] and r["tokens"] > 1]
    ttft = [r["first"] - r["submitted"] for r in records if r["first"]]
    return {
        "batch": batch,
        "output_tokens": total,
        "seconds": round(end - start, 3),
        "tokens_per_second": round(total / (end - start), 1),
        "per_stream_decode_tokens_per_second": round(statistics.median(decode), 1) if decode else None,
        "ttft_median_ms": round(1000 * statistics.median(ttft), 1) if ttft else None,
    }


async def measure(engine_args: dict[str, Any], args) -> dict:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    started = time.perf_counter()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))
    startup = time.perf_counter() - started
    rng = random.Random(args.seed)
    vocab = vocab_size(Path(args.model)) if Path(args.model, "config.json").exists() else 256
    try:
        await run_batch(engine, max(args.batches), args, rng, vocab, "warmup", 16)
        await run_batch(engine, 1, args, rng, vocab, "warmup1", 16)
        results = []
        for batch in args.batches:
            rounds = args.rounds if batch == 1 else 1
            runs = [await run_batch(engine, batch, args, rng, vocab, f"b{batch}r{r}", args.output_tokens)
                    for r in range(rounds)]  # fmt: skip
            result = sorted(runs, key=lambda r: r["tokens_per_second"])[len(runs) // 2]
            print(json.dumps(result), flush=True)
            results.append(result)
    finally:
        engine.shutdown()
    return {"startup_seconds": round(startup, 1), "results": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default=os.environ.get("ENGINE_PROFILE", "cpu"), help="workers.profiles name")
    parser.add_argument("--model", required=True, help="model folder (or hub id where the hub is reachable)")
    parser.add_argument("--dummy", action="store_true", help="random weights (load_format=dummy)")
    parser.add_argument("--batches", default="1,8,32,64", help="batch sizes (concurrent requests)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3, help="repetitions of the one-stream run (median kept)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-arg", action="append", default=[], metavar="NAME=JSON",
                        help="engine argument override, e.g. max_model_len=4096")  # fmt: skip
    parser.add_argument("--json", type=Path, default=None, help="write the results here too")
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]

    from workers.profiles import engine_env_for

    os.environ.update(engine_env_for(args.profile))  # e.g. VLLM_CPU_KVCACHE_SPACE on the cpu profile
    engine_args = build_engine_args(args.profile, args.model, args.dummy, parse_engine_args(args.engine_arg))
    args.skip_tokenizer = bool(engine_args.get("skip_tokenizer_init"))
    print(json.dumps({"profile": args.profile, "engine_args": engine_args}, default=str), flush=True)
    report = asyncio.run(measure(engine_args, args))
    report.update(profile=args.profile, model=args.model, engine_args=engine_args,
                  prompt_tokens=args.prompt_tokens, output_tokens_per_request=args.output_tokens)  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps(report, default=str))
    return 0


if __name__ == "__main__":  # vLLM starts its engine process with spawn: the guard is required
    sys.exit(main())
