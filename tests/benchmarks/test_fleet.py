"""The fleet bench's pure logic (benchmarks/fleet.py): workloads, the Poisson schedule, ratios, goals."""

from __future__ import annotations

import statistics

import pytest

from benchmarks import fleet
from benchmarks.stats import RequestResult


def test_a_shared_workload_repeats_each_groups_system_prompt_and_each_conversations_history():
    shape = fleet.Shape(tenants=2, groups=2, conversations=2, turns=3, system_words=50, turn_words=5)
    calls = fleet.workload_calls(shape, shared=True)
    assert len(calls) == shape.requests == 24
    by_group: dict = {}
    for call in calls:
        by_group.setdefault((call.tenant, call.group), []).append(call)
    systems = {key: group[0].prompt.split("\nUser:")[0] for key, group in by_group.items()}
    assert len(set(systems.values())) == 4  # one system prompt per group
    for key, group in by_group.items():
        assert all(call.prompt.startswith(systems[key]) for call in group)
    conversation = [c for c in calls if (c.tenant, c.group, c.conversation) == (1, 0, 1)]
    assert [c.turn for c in conversation] == [0, 1, 2]
    for earlier, later in zip(conversation, conversation[1:], strict=False):
        # The next turn re-sends the whole earlier prompt, a reply and a new user turn.
        assert later.prompt.startswith(earlier.prompt.removesuffix("\nAssistant:"))
        assert len(later.prompt.split()) == len(earlier.prompt.split()) + 2 * shape.turn_words + 2


def test_a_distinct_workload_has_the_same_lengths_and_no_shared_start():
    shape = fleet.Shape(tenants=1, groups=2, conversations=2, turns=2, system_words=40, turn_words=4)
    shared = fleet.workload_calls(shape, shared=True)
    distinct = fleet.workload_calls(shape, shared=False)
    assert [len(c.prompt.split()) for c in distinct] == [len(c.prompt.split()) + 5 for c in shared]
    firsts = {" ".join(c.prompt.split()[:5]) for c in distinct}
    assert len(firsts) == len(distinct)


def test_the_workload_is_the_same_every_run_and_draws_only_the_given_words():
    shape = fleet.Shape(tenants=1, groups=1, conversations=1, turns=1, system_words=30, turn_words=3)
    first = fleet.workload_calls(shape, True, fleet.GPU_WORDS)
    assert first == fleet.workload_calls(shape, True, fleet.GPU_WORDS)
    words = set(first[0].prompt.replace("User:", "").replace("Assistant:", "").split())
    assert words <= set(fleet.GPU_WORDS)


def test_arrival_order_shuffles_but_keeps_each_conversations_turns_in_order():
    shape = fleet.Shape(tenants=2, groups=2, conversations=3, turns=4, system_words=5, turn_words=2)
    calls = fleet.workload_calls(shape, shared=True)
    ordered = fleet.arrival_order(calls, seed=7)
    assert sorted(ordered, key=calls.index) == calls
    assert ordered != calls
    seen: dict = {}
    for call in ordered:
        key = (call.tenant, call.group, call.conversation)
        assert call.turn == seen.get(key, -1) + 1
        seen[key] = call.turn
    assert ordered == fleet.arrival_order(calls, seed=7)


def test_poisson_times_rise_in_rate_and_keep_the_mean_rate():
    load = fleet.Load(start_rate=2.0, end_rate=18.0)
    times = fleet.poisson_times(4000, load, seed=3)
    assert len(times) == 4000 and times == sorted(times) and times[0] > 0
    span = 2 * 4000 / (2.0 + 18.0)
    assert times[-1] == pytest.approx(span, rel=0.05)
    first, last = [t for t in times if t < span / 4], [t for t in times if t > 3 * span / 4]
    # The rate rises 2 -> 6/s over the first quarter (4/s on average) and 14 -> 18/s over the last.
    assert len(first) / (span / 4) == pytest.approx(4.0, rel=0.15)
    assert len(last) / (span / 4) == pytest.approx(16.0, rel=0.15)


def test_a_flat_load_is_a_plain_poisson_process():
    times = fleet.poisson_times(3000, fleet.Load(5.0, 5.0), seed=1)
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert statistics.mean(gaps) == pytest.approx(0.2, rel=0.06)
    assert fleet.poisson_times(0, fleet.Load(1, 2), seed=1) == []
    with pytest.raises(ValueError):
        fleet.poisson_times(3, fleet.Load(0, 2), seed=1)


def _result(sent: float, first: float, end: float, tokens: int = 10, prompt: int = 100, cached: int = 0,
            error: str | None = None) -> RequestResult:  # fmt: skip
    return RequestResult(sent_at=sent, ended_at=end, chunk_times=[first] if error is None else [],
                         completion_tokens=tokens if error is None else 0, prompt_tokens=prompt,
                         cached_tokens=cached, error=error)  # fmt: skip


def test_a_phase_summary_counts_tokens_cache_hits_refusals_and_failures():
    results = [
        _result(0.0, 0.1, 1.0, cached=50),
        _result(0.5, 0.8, 2.0, cached=0),
        _result(1.0, 1.0, 1.0, error="HTTP 429: slow down"),
        _result(1.0, 1.0, 1.0, error="stream ended without [DONE]"),
    ]
    summary = fleet.summarize_phase("cache_aware", "shared", results, duration=2.0)
    assert summary["output_tok_s"] == 10.0  # 20 tokens over 2 s
    assert summary["refused"] == 1 and summary["failed"] == 1
    assert summary["cache_hit_rate"] == 0.25 and summary["prompt_tokens"] == 200
    assert summary["ttft_p50_ms"] == pytest.approx(200.0)
    assert summary["first_error"] == "HTTP 429: slow down"


def _phase(workload: str, phase: str, tok_s: float, p90: float, bad: int = 0) -> dict:
    return {"workload": workload, "phase": phase, "output_tok_s": tok_s, "ttft_p90_ms": p90, "refused": bad,
            "failed": 0}  # fmt: skip


def test_ratios_are_against_pool_and_round_robin_of_the_same_workload():
    phases = fleet.add_ratios([
        _phase("shared", "pool", 100.0, 1000.0),
        _phase("shared", "round_robin", 80.0, 2000.0),
        _phase("shared", "cache_aware", 200.0, 100.0),
        _phase("distinct", "pool", 50.0, 10.0),
        _phase("distinct", "bare", 60.0, 10.0),
    ])  # fmt: skip
    aware = phases[2]
    assert aware["tok_s_vs_pool"] == 2.0 and aware["tok_s_vs_round_robin"] == 2.5
    assert aware["ttft_p90_vs_pool"] == 0.1 and aware["ttft_p90_vs_round_robin"] == 0.05
    assert phases[4]["tok_s_vs_pool"] == 1.2 and phases[4]["tok_s_vs_round_robin"] is None


def test_goals_pass_and_fail_on_the_thresholds():
    phases = fleet.add_ratios([
        _phase("shared", "pool", 100.0, 1000.0),
        _phase("shared", "round_robin", 100.0, 1000.0),
        _phase("shared", "cache_aware", 160.0, 200.0),
        _phase("distinct", "round_robin", 100.0, 10.0),
        _phase("distinct", "least_loaded", 110.0, 10.0),
        _phase("distinct", "cache_aware", 107.0, 10.0),
    ])  # fmt: skip
    cpu = {name: passed for name, passed, _ in fleet.goals(phases, gpu=False)}
    assert all(cpu.values()), cpu  # 1.6x >= 1.5x; 107 >= 0.97 x 110
    gpu = {name: passed for name, passed, _ in fleet.goals(phases, gpu=True)}
    assert not gpu["shared prefixes: cache_aware output tok/s >= 2.0x pool"]
    assert not gpu["shared prefixes: cache_aware P90 TTFT <= 1/10 of pool"]
    phases[5]["output_tok_s"] = 106.0
    phases[0]["refused"] = 1
    checks = {name: passed for name, passed, _ in fleet.goals(phases, gpu=False)}
    assert not checks["no shared prefix: cache_aware >= 0.97 of the better of round_robin and least_loaded"]
    assert not checks["no request refused or failed"]


def test_a_goal_not_measured_is_neither_pass_nor_fail():
    checks = fleet.goals([_phase("shared", "pool", 100.0, 1.0)], gpu=False)
    assert [passed for _, passed, _ in checks[:3]] == [None, None, None]
    assert fleet.goal_lines(checks)[0].startswith("n/a")


def test_the_command_line_picks_the_plan():
    quick = fleet.plan_from(fleet.build_parser().parse_args(["--quick", "--policies", "pool,cache_aware"]))
    assert quick.workers == 2 and not quick.gpu and quick.policies == ("pool", "cache_aware")
    assert quick.shape.requests < fleet.cpu_plan(2, quick=False).shape.requests
    gpu = fleet.plan_from(fleet.build_parser().parse_args(["--profile", "h200", "--rates", "1,9"]))
    assert gpu.workers == 4 and gpu.load == fleet.Load(1.0, 9.0)
    assert gpu.engine_args["kv_cache_memory_bytes"] == fleet.GPU_KV_CACHE_BYTES
    assert gpu.engine_args["gpu_memory_utilization"] * gpu.workers <= 0.9
    with pytest.raises(SystemExit):
        fleet.plan_from(fleet.build_parser().parse_args(["--policies", "random"]))
