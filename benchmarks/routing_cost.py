"""What the route step costs: the time of one decision and the memory of the prefix index.

    python -m benchmarks.routing_cost [--workers 8] [--chunks-per-worker 100000] [--decisions 2000]

Against a real Redis (``--redis-url``, a database this tool empties), it fills the index of each of
``--workers`` ready workers with ``--chunks-per-worker`` chunks (their cap set above that, as for
engines whose KV cache holds them) and ``--open`` open requests, then
times ``gateway.routing.choose_worker`` end to end (the prompt's hashing, the decision script and
its bookkeeping, one round trip) for prompts of ``--prompt-tokens`` tokens, half of them sharing an
indexed prefix, and prints p50/p99/max per decision and the index's bytes per chunk (Redis's own
MEMORY USAGE). Each decision is released at once, so the load stays as set.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

GOAL_P99_MS = 1.0


def main() -> None:
    args = _parse()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    os.environ.setdefault("SECRET_KEY", "routing-cost-benchmark")
    os.environ["REDIS_URL"] = args.redis_url
    # Each index holds its chunks (none trimmed while timing): an engine whose KV cache holds as many.
    os.environ["ROUTING_INDEX_CHUNKS"] = str(2 * args.chunks_per_worker)
    import django

    django.setup()
    import redis

    client = redis.Redis.from_url(args.redis_url, decode_responses=True)
    client.flushdb()
    prefixes = _fill(client, args)
    timings = _time_decisions(args, prefixes)
    report = _report(client, args, timings)
    print(json.dumps(report, indent=2))
    client.flushdb()


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/12")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--chunks-per-worker", type=int, default=100_000)
    parser.add_argument("--open", type=int, default=64, help="open requests per worker")
    parser.add_argument("--prompt-tokens", type=int, default=6000)
    parser.add_argument("--decisions", type=int, default=2000)
    return parser.parse_args()


def _fill(client, args) -> list[list[int]]:
    """Each worker's index filled with chunks of its own prefixes; returns prompts whose prefix is
    indexed on some worker (one per worker)."""
    from contract import protocol
    from gateway import routing

    prefixes = []
    chunk_tokens = _chunk_tokens()
    per_prompt = args.prompt_tokens // chunk_tokens
    for w in range(args.workers):
        name = f"bench-{w}#0"
        client.zadd(protocol.pool_workers_key("bench"), {name: time.time() + 86400})
        client.hset(protocol.worker_key(name), mapping={"state": "ready", "pool": "bench", "lora": 0})
        pipe = client.pipeline(transaction=False)
        for i in range(args.chunks_per_worker):
            pipe.zadd(routing.index_key(name), {f"{w:04x}{i:012x}": i})
            if i % 10_000 == 9_999:
                pipe.execute()
        for r in range(args.open):
            pipe.hset(routing.open_key(name), f"open-{w}-{r}", f"{args.prompt_tokens}:{time.time()}")
            pipe.hincrby(routing.open_key(name), routing.LOAD_FIELD, args.prompt_tokens)
        pipe.execute()
        prompt = [random.randrange(262_144) for _ in range(per_prompt * chunk_tokens)]
        prefixes.append(prompt)
        for chunk in routing.prompt_chunks(_request(prompt, "warm")):
            client.zadd(routing.index_key(name), {chunk: time.time()})
    return prefixes


def _chunk_tokens() -> int:
    from django.conf import settings

    return settings.ROUTING_CHUNK_TOKENS


def _request(prompt: list[int], request_id: str):
    from contract.protocol import RequestInput

    return RequestInput(request_id=request_id, model="bench", prompt_token_ids=prompt, params={"max_tokens": 256},
                        tenant_id=1, key_id=1, enqueued_at=time.time(), cache_salt="tenant")  # fmt: skip


def _time_decisions(args, prefixes: list[list[int]]) -> list[float]:
    from gateway import routing

    timings = []
    for i in range(args.decisions):
        if i % 2:
            prompt = prefixes[i % len(prefixes)] + [7, 8, 9]
        else:
            prompt = [random.randrange(262_144) for _ in range(args.prompt_tokens)]
        request = _request(prompt, f"decision-{i}")
        started = time.perf_counter()
        route = routing.choose_worker(request, "bench")
        timings.append((time.perf_counter() - started) * 1000)
        routing.release(request.request_id, route.worker)
    return timings


def _report(client, args, timings: list[float]) -> dict:
    from gateway import routing

    ordered = sorted(timings)
    index_bytes = sum(client.memory_usage(routing.index_key(f"bench-{w}#0")) or 0 for w in range(args.workers))
    chunks = sum(client.zcard(routing.index_key(f"bench-{w}#0")) for w in range(args.workers))
    p99 = ordered[int(len(ordered) * 0.99) - 1]
    return {
        "workers": args.workers,
        "chunks_indexed": chunks,
        "prompt_tokens": args.prompt_tokens,
        "chunk_tokens": _chunk_tokens(),
        "open_requests_per_worker": args.open,
        "decisions": len(timings),
        "decision_ms_p50": round(statistics.median(ordered), 3),
        "decision_ms_p99": round(p99, 3),
        "decision_ms_max": round(ordered[-1], 3),
        "index_bytes": index_bytes,
        "index_bytes_per_chunk": round(index_bytes / max(1, chunks), 1),
        "goal_p99_ms": GOAL_P99_MS,
        "goal_met": p99 <= GOAL_P99_MS,
    }


if __name__ == "__main__":
    main()
