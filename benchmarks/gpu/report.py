"""Tables and goal checks from the GPU bench's result files (pure functions; runs anywhere).

    python -m benchmarks.gpu.report RESULTS.json     # prints the markdown tables

A result is one engine's or the platform's JSON (engine_bench.py, platform_bench.py): ``name``,
``levels`` (a list of ``{"streams", "tokens_per_s", "ttft_ms_p50", ...}``), ``start_s``, or ``error``;
``partial`` when the side was stopped before its last turn (measure.partial).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable

# Goals on the H200, as ratios measured in the same run.
GOALS = (
    ("h200 vs stock, 1 stream", "h200", "stock", 1, 1.75),
    ("h200 vs stock, 128 streams", "h200", "stock", 128, 2.0),
    *((f"platform vs bare engine, {n} streams", "platform-h200", "bare-h200", n, 0.95) for n in (32, 128, 256, 512)),
)


def by_name(results: Iterable[dict]) -> dict[str, dict]:
    """The results keyed by name; a later result of the same name replaces an earlier one."""
    return {result["name"]: result for result in results}


# A level's rate and the seconds it is over (see ``rate``).
_SECONDS = {"tokens_per_s": "wall_s", "full_tokens_per_s": "full_s"}


def rate(result: dict | None, streams: int, key: str = "tokens_per_s") -> float | None:
    """Tokens/s of ``result`` at ``streams`` (``key``: over the whole level, or ``full_tokens_per_s``
    while every client was sending), pooled over the level's turns when it took several (their
    tokens over their seconds); None when not measured, failed, or a turn had failed requests."""
    if not result or "error" in result:
        return None
    turns = [level for level in result.get("levels", []) if level["streams"] == streams]
    if not turns or any(level.get("errors") or level.get(key) is None for level in turns):
        return None
    if len(turns) == 1:
        return float(turns[0][key])
    seconds = [float(level[_SECONDS[key]]) for level in turns]
    return sum(float(level[key]) * s for level, s in zip(turns, seconds, strict=True)) / sum(seconds)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, 3)


def _fmt(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "—"
    return f"{value:,.{digits}f}"


def engine_table(results: dict[str, dict], names: list[str], levels: Iterable[int], reference: str = "stock",
                 key: str = "tokens_per_s") -> str:  # fmt: skip
    """Markdown: tokens/s (``key``, see ``rate``) per level for each engine, with the ratio to
    ``reference`` in parentheses."""
    levels = list(levels)
    head = "| engine | start (s) | " + " | ".join(f"{n} stream{'s' if n > 1 else ''}" for n in levels) + " |"
    lines = [head, "|---|---:|" + "---:|" * len(levels)]
    for name in names:
        result = results.get(name)
        if result is None:
            continue
        if "error" in result:
            lines.append(f"| {name} | failed: {result['error'][:120]} |" + " |" * len(levels))
            continue
        cells = []
        for n in levels:
            value, ref = rate(result, n, key), rate(results.get(reference), n, key)
            rel = ratio(value, ref)
            cells.append(_fmt(value) + (f" ({rel:.2f}x)" if rel is not None and name != reference else ""))
        label = f"{name} (cut short: {result['partial']})" if result.get("partial") else name
        lines.append(f"| {label} | {_fmt(result.get('start_s'))} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def turns_table(results: dict[str, dict], names: list[str], levels: Iterable[int]) -> str:
    """Markdown: each turn of each level, per engine: tokens/s, time to first token and time per
    output token p50, the slowest request, and the engine's steps where counted."""
    lines = ["| engine | streams | turns: tok/s, TTFT p50 ms, time per token p50 ms, slowest request s"
             "[, engine steps (of them with more tokens than streams: mixed), the engine's own mean time between "
             "a request's tokens (engine ITL)] |", "|---|---:|---|"]  # fmt: skip
    for n in levels:
        for name in names:
            turns = [lv for lv in (results.get(name) or {}).get("levels", []) if lv["streams"] == n]
            if turns:
                cells = "; ".join(f"{_fmt(lv['tokens_per_s'])}, {_fmt(lv.get('ttft_ms_p50'))}, "
                                  f"{_fmt(lv.get('tpot_ms_p50'), 2)}, {_fmt(lv.get('duration_s_max'), 2)}"
                                  + _steps(lv.get("engine_steps"))
                                  for lv in turns)  # fmt: skip
                lines.append(f"| {name} | {n} | {cells} |")
    return "\n".join(lines)


def _steps(steps: dict | None) -> str:
    """A level's ``engine_steps`` as a turn cell's tail (steps, and mixed ones); empty if not measured."""
    if not steps:
        return ""
    mixed = steps.get("steps_over_streams")
    itl = steps.get("itl_ms_mean")
    return (
        f", {steps['steps']:,} steps"
        + (f" ({mixed:,} mixed)" if mixed is not None else "")
        + (f", engine ITL {itl:.2f} ms" if itl is not None else "")
    )


def engine_itl(result: dict | None, streams: int) -> float | None:
    """The engine's own mean time between a request's tokens at ``streams``, over the level's turns
    (each turn's mean weighted by its seconds); None where a turn lacks it."""
    turns = [level for level in (result or {}).get("levels", []) if level["streams"] == streams]
    itls = [(level.get("engine_steps") or {}).get("itl_ms_mean") for level in turns]
    if not turns or None in itls:
        return None
    seconds = [float(level.get("wall_s") or 1.0) for level in turns]
    return sum(itl * s for itl, s in zip(itls, seconds, strict=True)) / sum(seconds)


def pace_table(results: dict[str, dict], reference: str, other: str, levels: Iterable[int]) -> str:
    """Markdown: per level, ``other``'s throughput against ``reference``'s, each side's engine ITL, and
    the ratio at equal engine pace (the ratio times other's ITL over reference's): what ``other``'s
    path costs once each engine core's own pace in its turns is taken out."""
    lines = ["| streams | ratio | engine ITL, ms | ratio at equal engine pace |", "|---:|---:|---|---:|"]
    for n in levels:
        measured = ratio(rate(results.get(other), n), rate(results.get(reference), n))
        ref_itl, other_itl = engine_itl(results.get(reference), n), engine_itl(results.get(other), n)
        if measured is None or ref_itl is None or other_itl is None:
            continue
        lines.append(
            f"| {n} | {measured:.2f} | {ref_itl:.2f} → {other_itl:.2f} | {measured * other_itl / ref_itl:.2f} |"
        )
    return "\n".join(lines)


def cpu_table(results: dict[str, dict], names: list[str]) -> str:
    """Markdown: CPU seconds per part and level (``cpu_s``), with the seconds its threads waited
    for a CPU in parentheses where measured."""
    lines = ["| engine | streams | CPU s per part (waiting for a CPU) |", "|---|---:|---|"]
    for name in names:
        for level in (results.get(name) or {}).get("levels", []):
            cpu = level.get("cpu_s")
            if not cpu:
                continue
            parts = [p for p in cpu if not p.endswith(" wait") and p != "steal"]
            cells = [f"{p} {cpu[p]:.2f}" + (f" ({cpu[p + ' wait']:.2f})" if p + " wait" in cpu else "") for p in parts]
            if "steal" in cpu:
                cells.append(f"stolen by the host {cpu['steal']:.2f}")
            lines.append(f"| {name} | {level['streams']} | {', '.join(cells)} |")
    return "\n".join(lines)


def capacity_details(results: dict[str, dict], names: list[str]) -> str:
    """Per engine and level: seconds measured, time per output token, batch reached, preemptions."""
    lines = ["| engine | streams | wall (s) | tpot p50 (ms) | ttft p50 (ms) | batch | preemptions |",
             "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name in names:
        for level in (results.get(name) or {}).get("levels", []):
            lines.append(f"| {name} | {level['streams']} | {_fmt(level.get('wall_s'), 1)} | "
                         f"{_fmt(level.get('tpot_ms_p50'), 2)} | {_fmt(level.get('ttft_ms_p50'))} | "
                         f"{_fmt(level.get('max_generating'))} | {_fmt(level.get('preemptions'))} |")  # fmt: skip
    return "\n".join(lines)


def adapter_rate(result: dict | None, adapters: int) -> float | None:
    """Tokens/s of ``result``'s level with ``adapters`` hot adapters (0: the base model)."""
    if not result or "error" in result:
        return None
    for level in result.get("levels", []):
        if level.get("adapters") == adapters and not level.get("errors"):
            return float(level["tokens_per_s"])
    return None


def adapter_summary(results: dict[str, dict], on: str = "lora-on", off: str = "lora-off") -> list[dict]:
    """Per adapter count measured on ``on``: tokens/s, its ratio to the base model on the same engine
    (``vs_base``) and to the base model on the engine without LoRA (``vs_no_lora``); [] when none."""
    base, plain = adapter_rate(results.get(on), 0), adapter_rate(results.get(off), 0)
    rows = []
    for level in (results.get(on) or {}).get("levels", []):
        if "adapters" not in level:
            continue
        value = adapter_rate(results.get(on), level["adapters"])
        rows.append({"adapters": level["adapters"], "streams": level["streams"], "tokens_per_s": value,
                     "vs_base": ratio(value, base), "vs_no_lora": ratio(value, plain)})  # fmt: skip
    return rows


def adapters_table(results: dict[str, dict], on: str = "lora-on", off: str = "lora-off") -> str:
    """Markdown: tokens/s per adapter count on the LoRA engine, with its ratios to the base model on
    the same engine and on the engine without LoRA; then that engine's base-model row."""
    rows = adapter_summary(results, on, off)
    counts = [row["adapters"] for row in rows] or [0]
    head = "| engine | start (s) | " + " | ".join(
        "base model" if n == 0 else f"{n} adapter{'s' if n > 1 else ''}" for n in counts) + " |"  # fmt: skip
    lines = [head, "|---|---:|" + "---:|" * len(counts)]
    for name in (on, off):
        result = results.get(name)
        if result is None:
            continue
        if "error" in result:
            lines.append(f"| {name} | failed: {result['error'][:120]} |" + " |" * len(counts))
            continue
        cells = []
        for row in rows if name == on else [{"adapters": n} for n in counts]:
            value = adapter_rate(result, row["adapters"])
            rel = [f"{row[key]:.2f}x" for key in ("vs_base", "vs_no_lora") if row.get(key) is not None]
            cells.append(_fmt(value) + (f" ({', '.join(rel)})" if rel and value is not None else ""))
        lines.append(f"| {name} | {_fmt(result.get('start_s'))} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def adapter_details(results: dict[str, dict], names: list[str]) -> str:
    """Per engine and adapter level: time per output token, time to first token, batch reached,
    seconds to load the level's adapters, preemptions."""
    lines = ["| engine | adapters | streams | wall (s) | tpot p50 (ms) | ttft p50 (ms) | batch | load (s) "
             "| preemptions |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name in names:
        for level in (results.get(name) or {}).get("levels", []):
            lines.append(f"| {name} | {level.get('adapters', '—')} | {level['streams']} | "
                         f"{_fmt(level.get('wall_s'), 1)} | {_fmt(level.get('tpot_ms_p50'), 2)} | "
                         f"{_fmt(level.get('ttft_ms_p50'))} | {_fmt(level.get('max_generating'))} | "
                         f"{_fmt(level.get('adapter_load_s'), 1)} | {_fmt(level.get('preemptions'))} |")  # fmt: skip
    return "\n".join(lines)


def goal_rows(results: dict[str, dict]) -> list[tuple[str, float | None, float, bool | None]]:
    """(goal, measured ratio, target, met) for each goal; ratio None when a side was not measured."""
    rows = []
    for label, numerator, denominator, streams, target in GOALS:
        value = ratio(rate(results.get(numerator), streams), rate(results.get(denominator), streams))
        rows.append((label, value, target, None if value is None else value >= target))
    return rows


def goals_table(results: dict[str, dict]) -> str:
    lines = ["| goal | measured | target | met |", "|---|---:|---:|---|"]
    for label, value, target, met in goal_rows(results):
        verdict = "—" if met is None else "yes" if met else "no"
        lines.append(f"| {label} | {_fmt(value, 2)} | {target:.2f} | {verdict} |")
    return "\n".join(lines)


def measured_levels(results: dict[str, dict], names: list[str]) -> list[int]:
    """The stream counts measured by any of ``names``, in order (run.py ``--levels`` may pick others)."""
    return sorted({level["streams"] for name in names for level in (results.get(name) or {}).get("levels", [])})


def render(results_list: list[dict]) -> str:
    from benchmarks.gpu.plan import CAPACITY_LEVELS, PLATFORM_LEVELS, PROFILE_LEVELS

    results = by_name(results_list)
    platform_levels = sorted(set(PLATFORM_LEVELS) | set(measured_levels(results, ["bare-h200", "platform-h200"])))
    engines = [n for n in results if not n.startswith(("platform", "bare", "cap-", "lora-"))]
    capacity = sorted(n for n in results if n.startswith("cap-"))
    order = ["stock", "h200", "a10g"] + sorted(n for n in engines if n not in ("stock", "h200", "a10g"))
    parts = [
        "Engine configurations (output tokens/s, ratio to stock vLLM in the same run):",
        engine_table(results, [n for n in order if n in results], PROFILE_LEVELS),
        "",
        "Platform path against the bare engine (same profile, same GPU):",
        engine_table(results, ["bare-h200", "platform-h200"], platform_levels, reference="bare-h200"),
        "",
        "The same at full concurrency (tokens until the first client stopped sending, benchmarks/gpu/measure.py):",
        engine_table(results, ["bare-h200", "platform-h200"], platform_levels, "bare-h200", "full_tokens_per_s"),
        "",
        "CPU per level (platform: web processes, worker process, its engine core, bench client; bare: the "
        "bench process as the engine's client, its engine core):",
        cpu_table(results, ["bare-h200", "platform-h200"]),
        "",
        goals_table(results),
    ]
    if "platform-h200" in results:
        parts += ["", "Each turn of the platform comparison:",
                  turns_table(results, ["bare-h200", "platform-h200"], platform_levels), "",
                  "The platform against bare at equal engine pace (a reading aid, not a goal: each side's "
                  "engine core steps faster or slower from turn to turn with the host; this takes it out):",
                  pace_table(results, "bare-h200", "platform-h200", platform_levels)]  # fmt: skip
    if capacity:
        order = ["cap-h200"] + [n for n in capacity if n != "cap-h200"]
        parts += ["", "Capacity, bare engine (output tokens/s, ratio to cap-h200 in the same run; batch: most "
                      "requests generating at once):",
                  engine_table(results, order, CAPACITY_LEVELS, reference="cap-h200"),
                  "", capacity_details(results, order)]  # fmt: skip
    if "lora-on" in results or "lora-off" in results:
        parts += ["", "Tenants' LoRA adapters (rank 16, q/k/v/o_proj), h200 profile, 128 streams: output tokens/s; "
                      "in parentheses the ratio to the base model on the same engine, then to the engine "
                      "without LoRA:",
                  adapters_table(results), "", adapter_details(results, ["lora-on", "lora-off"])]  # fmt: skip
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    results: list[dict] = []
    for path in argv:
        data = json.loads(open(path).read())
        results.extend(data["results"] if isinstance(data, dict) and "results" in data else data)
    print(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
