"""The GPU bench's plan: which engines it starts, with which arguments (benchmarks/gpu/plan.py)."""

import json

import pytest

from benchmarks.gpu import measure, plan
from workers.profiles import get_profile

MODEL, TOK_MODEL = "/bench/model", "/bench/model-tok"


def runs(stage):
    return {run.name: run for run in plan.runs_for(stage, MODEL, TOK_MODEL)}


def test_stock_is_vllm_defaults_plus_only_the_bench_settings():
    stock = runs("profiles")["stock"]
    assert stock.engine_args == {"model": MODEL, "skip_tokenizer_init": True, **plan.COMMON_ARGS}
    assert stock.levels == (1, 8, 32, 128)


@pytest.mark.parametrize("name", ["h200", "a10g"])
def test_a_profile_run_is_the_profile_with_random_weights_and_the_bench_memory(name):
    args = runs("profiles")[name].engine_args
    expected = {**get_profile(name).engine_args, **plan.COMMON_ARGS, "model": MODEL, "skip_tokenizer_init": True}
    assert args == expected
    assert args["load_format"] == "dummy"
    assert args["kv_cache_memory_bytes"] == plan.KV_CACHE_BYTES


def test_each_variant_changes_only_its_own_settings():
    h200 = runs("profiles")["h200"].engine_args
    all_runs = runs("profiles")
    for name, changes in plan.H200_VARIANTS.items():
        args = all_runs[name].engine_args
        differing = {key for key in set(args) | set(h200) if args.get(key) != h200.get(key)}
        assert differing == set(changes), name
        for key, value in changes.items():
            assert args.get(key) == value  # a None change removes the setting (vLLM's default)


def test_the_bare_engine_of_the_platform_comparison_detokenizes_like_the_worker():
    bare = runs("platform")["bare-h200"]
    assert "skip_tokenizer_init" not in bare.engine_args
    assert bare.engine_args["model"] == TOK_MODEL
    assert sorted(set(bare.levels)) == list(plan.PLATFORM_LEVELS)
    worker_args = {**get_profile("h200").engine_args, "model": TOK_MODEL, **plan.platform_worker_overrides()}
    assert bare.engine_args == worker_args


def test_the_platform_stage_measures_the_levels_and_rounds_asked_for():
    bare = plan.runs_for("platform", MODEL, TOK_MODEL, levels=(128, 256), rounds=3)[0]
    assert bare.levels == (128, 256, 256, 128, 128, 256)
    assert bare.rounds == 3


def test_every_stage_has_unique_names_and_json_serialisable_specs():
    for stage in plan.STAGES:
        stage_runs = plan.runs_for(stage, MODEL, TOK_MODEL)
        assert len({run.name for run in stage_runs}) == len(stage_runs)
        for run in stage_runs:
            json.dumps({"engine_args": run.engine_args})
            assert None not in run.engine_args.values()


def test_an_unknown_stage_is_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match="platform, profiles, capacity, adapters"):
        plan.runs_for("everything", MODEL, TOK_MODEL)


def test_the_bench_kv_cache_holds_128_streams_of_prompt_and_output():
    # 24 layers own KV (the last 18 share it): 4 full-attention layers keep every token, 20 sliding
    # ones a 512-token window (plus a 16-token block); 2 KV heads x 256 dims x (K, V) x 2 bytes.
    tokens = plan.PROMPT_TOKENS + plan.OUTPUT_TOKENS
    per_sequence = (4 * tokens + 20 * min(tokens, 512 + 16)) * 2 * 256 * 2 * 2
    assert plan.KV_CACHE_BYTES >= 1.2 * 128 * per_sequence


def test_platform_levels_reach_512_streams_and_long_levels_run_30_s():
    assert plan.PLATFORM_LEVELS == (32, 128, 256, 512)
    assert [plan.level_seconds(n) for n in (1, 32, 128, 512)] == [8, 8, 30, 30]
    # In two turns a long level runs 15 s each; a short one keeps its 8 s.
    assert [plan.level_seconds(n, rounds=2) for n in (32, 128, 512)] == [8, 15, 15]
    # The default stage fits one 600 s call: ~300 s cold start, both sides' turns (shortened by at
    # most a tenth by run.py's level scale when the start was slow), install.
    schedule, rounds = plan.platform_schedule(), plan.PLATFORM_ROUNDS
    platform = plan.planned_seconds(schedule, warmup_s=15, rounds=rounds)
    both_sides = platform + plan.planned_seconds(schedule, rounds=rounds)
    assert plan.DEFAULT_STAGES == ("platform",) and 300 + 0.9 * both_sides + 40 < 565


def test_each_side_measures_every_platform_level_twice_up_then_down():
    assert plan.PLATFORM_ROUNDS == 2
    assert plan.platform_schedule() == (32, 128, 256, 512, 512, 256, 128, 32)
    assert plan.platform_schedule((32, 128), rounds=3) == (32, 128, 128, 32, 32, 128)
    assert plan.platform_schedule((32, 128), rounds=1) == (32, 128)
    bare = runs("platform")["bare-h200"]
    assert bare.levels == plan.platform_schedule() and bare.rounds == 2


def test_with_the_turn_order_each_levels_two_turns_come_a_b_then_b_a():
    for levels in [(32,), (32, 128), (32, 128, 256), (32, 128, 256, 512)]:
        schedule = plan.platform_schedule(levels, rounds=2)
        order = measure.turn_order(["platform", "bare"], len(schedule))
        for streams in levels:
            first, second = (i for i, n in enumerate(schedule) if n == streams)
            sides = [order[2 * first], order[2 * first + 1], order[2 * second], order[2 * second + 1]]
            assert [turn.split(":")[0] for turn in sides] in (
                ["platform", "bare", "bare", "platform"], ["bare", "platform", "platform", "bare"],
            )  # fmt: skip
            # Both sides' turn indexes name the same level.
            assert {int(turn.split(":")[1]) for turn in sides} == {first, second}


def test_capacity_runs_give_every_running_sequence_room():
    runs = {run.name: run for run in plan.runs_for("capacity", "/m", "/t")}
    assert runs["cap-h200"].levels == (256, 512) and runs["cap-seq512"].engine_args["max_num_seqs"] == 512
    assert (
        runs["cap-seq512"].engine_args["kv_cache_memory_bytes"] > runs["cap-h200"].engine_args["kv_cache_memory_bytes"]
    )
    assert runs["cap-fp8kv"].engine_args["kv_cache_dtype"] == "fp8"
    assert "skip_tokenizer_init" not in runs["cap-h200-tok"].engine_args
    assert runs["cap-h200"].engine_args["skip_tokenizer_init"] is True
