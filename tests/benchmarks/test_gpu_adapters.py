"""The GPU bench's adapters stage: the LoRA adapter writer (benchmarks/gpu/lora.py), the stage's plan,
its spec for engine_bench.py and its report tables; and vLLM (CPU) serving an adapter it wrote."""

import json

import pytest
from safetensors import safe_open

from benchmarks.gpu import lora, model, plan, report
from benchmarks.gpu import run as gpu_run
from tests.adapters.lora import TINY_LAYERS, TINY_SHAPES
from workers.profiles import get_profile


@pytest.fixture(scope="module")
def e4b_config(tmp_path_factory) -> dict:
    """The bench model's config.json as model.py writes it (what vLLM reads on the device)."""
    folder = tmp_path_factory.mktemp("e4b")
    model.write_config(folder)
    return json.loads((folder / "config.json").read_text())


def tensors(folder) -> dict[str, tuple[int, ...]]:
    with safe_open(str(folder / "adapter_model.safetensors"), framework="pt") as f:
        return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118 - not a dict


def test_the_e4b_adapter_has_peft_names_and_the_shapes_of_the_transformers_model(e4b_config, tmp_path):
    import torch
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4ForCausalLM

    folder = lora.write_adapter(tmp_path / "a", e4b_config, rank=16, seed=3)
    written = tensors(folder)
    # The model itself, without memory: every attention projection a PEFT adapter could target.
    config = Gemma4TextConfig(**model.E4B_SHAPE, per_layer_config={})
    with torch.device("meta"):
        hf = Gemma4ForCausalLM(config)
    expected = {}
    for name, module in hf.named_modules():
        if name.rsplit(".", 1)[-1] in lora.MODULES and ".self_attn." in name:
            out_features, in_features = module.weight.shape
            expected[f"base_model.model.{name}.lora_A.weight"] = (16, in_features)
            expected[f"base_model.model.{name}.lora_B.weight"] = (out_features, 16)
    assert written == expected
    # 42 layers x q/o, k/v on the 24 layers that own their K/V (the last 18 share it).
    assert len(written) == 2 * (42 * 2 + 24 * 2)
    assert written["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"] == (16, 2560)
    assert written["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"] == (512, 16)
    assert written["base_model.model.model.layers.41.self_attn.o_proj.lora_B.weight"] == (2560, 16)
    assert "base_model.model.model.layers.24.self_attn.k_proj.lora_A.weight" not in written
    with safe_open(str(folder / "adapter_model.safetensors"), framework="pt") as f:
        a = f.get_tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")
    assert a.dtype == torch.bfloat16 and 0 < float(a.float().std()) < 0.1
    assert json.loads((folder / "adapter_config.json").read_text()) == {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 16, "lora_alpha": 32, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "bias": "none",
        "base_model_name_or_path": "gemma-4-E4B-shaped",
    }  # fmt: skip


def test_the_tiny_adapter_names_and_shapes_are_those_of_the_peft_test_adapters(tiny_model_dir, tmp_path):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    written = tensors(lora.write_adapter(tmp_path / "a", config, rank=8))
    expected = {}
    for layer in range(TINY_LAYERS):
        for module in lora.MODULES:
            out_features, in_features = TINY_SHAPES[module]
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            expected |= {f"{prefix}.lora_A.weight": (8, in_features), f"{prefix}.lora_B.weight": (out_features, 8)}
    assert written == expected


def test_full_attention_layers_use_the_global_head_dim_and_k_eq_v_drops_v_proj():
    config = {**model.E4B_SHAPE, "global_head_dim": 512, "attention_k_eq_v": True, "num_global_key_value_heads": 4}
    shapes = lora.attention_shapes(config)
    assert shapes["model.layers.4.self_attn.q_proj"] == (2048, 2560)  # sliding: head dim 256
    assert shapes["model.layers.5.self_attn.q_proj"] == (4096, 2560)  # full: 8 x 512
    assert shapes["model.layers.5.self_attn.k_proj"] == (2048, 2560)  # 4 global KV heads x 512
    assert shapes["model.layers.5.self_attn.o_proj"] == (2560, 4096)
    assert "model.layers.5.self_attn.v_proj" not in shapes and "model.layers.4.self_attn.v_proj" in shapes


def test_the_adapters_are_distinct_and_written_once(tiny_model_dir, tmp_path):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    dirs = lora.write_adapters(tmp_path, config, count=3, rank=4)
    assert [d.name for d in dirs] == ["a1", "a2", "a3"]
    files = [(d / "adapter_model.safetensors").read_bytes() for d in dirs]
    assert len(set(files)) == 3
    stamps = [(d / "adapter_model.safetensors").stat().st_mtime_ns for d in dirs]
    assert lora.write_adapters(tmp_path, config, count=3, rank=4) == dirs
    assert [(d / "adapter_model.safetensors").stat().st_mtime_ns for d in dirs] == stamps
    assert len(lora.write_adapters(tmp_path, config, count=4, rank=4)) == 4  # another request: rewritten


def test_the_stage_runs_the_lora_engine_over_0_to_32_adapters_and_the_same_profile_without_lora():
    runs = {run.name: run for run in plan.runs_for("adapters", "/m", "/t", "/tmp/gpubench/adapters")}
    assert set(runs) == {"lora-on", "lora-off"}
    on, off = runs["lora-on"], runs["lora-off"]
    h200 = {**get_profile("h200").engine_args, **plan.COMMON_ARGS, "model": "/m", "skip_tokenizer_init": True}
    assert off.engine_args == h200 and off.levels == (128,) and off.adapter_counts == (0,)
    assert on.engine_args == {**h200, **get_profile("h200").lora_args}
    assert on.engine_args["enable_lora"] is True and on.engine_args["max_loras"] == 32
    assert on.engine_args["max_lora_rank"] == plan.ADAPTER_RANK == 16
    assert on.levels == (128, 128, 128, 128) and on.adapter_counts == (0, 1, 8, 32)
    assert len(set(on.adapter_dirs)) == 32 and on.adapter_dirs[0] == "/tmp/gpubench/adapters/a1"


def test_the_stage_fits_one_call_from_a_cold_start():
    runs = plan.runs_for("adapters", "/m", "/t")
    measuring = sum(run.planned_seconds() for run in runs)
    assert measuring == (6 + 4 * 30 + 3 * plan.ADAPTER_LOAD_S) + (6 + 30)
    # ~300 s to start both engines cold, ~40 s to install the wheels and write the model and adapters,
    # and run.py's 25 s margin, within device.sh's 565 s.
    assert 300 + 40 + measuring + 25 < 565


def test_the_engine_spec_carries_the_adapter_levels(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_run, "WORK", tmp_path)
    monkeypatch.setattr(gpu_run, "RESULTS", tmp_path / "results")
    on = plan.runs_for("adapters", "/m", "/t", str(tmp_path / "adapters"))[0]
    argv = gpu_run._engine_argv(on)
    spec = json.loads((tmp_path / "specs" / "lora-on.json").read_text())
    assert argv[argv.index("--spec") + 1] == str(tmp_path / "specs" / "lora-on.json")
    assert spec["levels"] == [128] * 4 and spec["adapter_counts"] == [0, 1, 8, 32]
    assert spec["adapter_dirs"] == list(on.adapter_dirs) and spec["engine_args"]["enable_lora"] is True


def adapter_result(name, rates, start_s=150.0):
    levels = [{"streams": 128, "adapters": n, "tokens_per_s": rate, "errors": 0, "wall_s": 30.2, "tpot_ms_p50": 7.1,
               "ttft_ms_p50": 80.0, "max_generating": 128, "preemptions": 0.0,
               "adapter_load_s": 1.5 if n else None} for n, rate in rates.items()]  # fmt: skip
    return {"name": name, "start_s": start_s, "levels": levels}


ADAPTER_RESULTS = report.by_name(
    [
        adapter_result("lora-on", {0: 16000.0, 1: 12000.0, 8: 11000.0, 32: 8000.0}),
        adapter_result("lora-off", {0: 17000.0}, start_s=90.0),
        {"name": "h200", "start_s": 80.0, "levels": [{"streams": 1, "tokens_per_s": 250.0}]},
    ]
)


def test_the_summary_gives_each_adapter_count_its_ratio_to_the_base_model_and_to_the_engine_without_lora():
    assert report.adapter_summary(ADAPTER_RESULTS) == [
        {"adapters": 0, "streams": 128, "tokens_per_s": 16000.0, "vs_base": 1.0, "vs_no_lora": 0.941},
        {"adapters": 1, "streams": 128, "tokens_per_s": 12000.0, "vs_base": 0.75, "vs_no_lora": 0.706},
        {"adapters": 8, "streams": 128, "tokens_per_s": 11000.0, "vs_base": 0.688, "vs_no_lora": 0.647},
        {"adapters": 32, "streams": 128, "tokens_per_s": 8000.0, "vs_base": 0.5, "vs_no_lora": 0.471},
    ]
    assert report.adapter_summary(report.by_name([adapter_result("lora-on", {0: 1.0})])) == [
        {"adapters": 0, "streams": 128, "tokens_per_s": 1.0, "vs_base": 1.0, "vs_no_lora": None}
    ]
    assert report.adapter_summary({}) == []


def test_the_report_has_an_adapters_table_and_keeps_the_lora_engines_out_of_the_profiles_table():
    text = report.render(list(ADAPTER_RESULTS.values()))
    profiles_table = text.split("Platform path")[0]
    assert "lora-" not in profiles_table and "| h200 |" in profiles_table
    lines = text.splitlines()
    head = lines.index("| engine | start (s) | base model | 1 adapter | 8 adapters | 32 adapters |")
    assert lines[head + 2] == (
        "| lora-on | 150 | 16,000 (1.00x, 0.94x) | 12,000 (0.75x, 0.71x) | 11,000 (0.69x, 0.65x) "
        "| 8,000 (0.50x, 0.47x) |"
    )
    assert lines[head + 3] == "| lora-off | 90 | 17,000 | — | — | — |"
    assert "| lora-on | 32 | 128 | 30.2 | 7.10 | 80 | 128 | 1.5 | 0 |" in lines
    assert "| lora-off | 0 | 128 | 30.2 | 7.10 | 80 | 128 | — | 0 |" in lines


def test_a_failed_lora_engine_is_reported_as_such():
    results = report.by_name([{"name": "lora-on", "error": "ValueError: LoRA rank 16 is greater than 8"},
                              adapter_result("lora-off", {0: 17000.0})])  # fmt: skip
    table = report.adapters_table(results)
    assert "| lora-on | failed: ValueError: LoRA rank 16 is greater than 8 |" in table
    assert "| lora-off | 150 | 17,000 |" in table
    assert report.adapter_summary(results) == []


@pytest.mark.engine
def test_vllm_serves_an_adapter_the_writer_made_for_the_tiny_model(tiny_model_dir, tmp_path):
    """vLLM (CPU build) loads the writer's files for the tiny Gemma 4 and applies them: greedy output
    changes with the adapter, differs between two adapters and repeats for the same one."""
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    config = json.loads((tiny_model_dir / "config.json").read_text())
    # Large weights so that an adapter moves the random model's greedy choice.
    first, second = (lora.write_adapter(tmp_path / f"a{seed}", config, seed=seed, scale=1.0) for seed in (1, 2))
    llm = LLM(model=str(tiny_model_dir), enable_lora=True, max_loras=2, max_lora_rank=16, enforce_eager=True,
              dtype="bfloat16", max_model_len=512, max_num_seqs=8, skip_tokenizer_init=True)  # fmt: skip
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        prompt = {"prompt_token_ids": list(range(10, 40))}

        def run(adapter=None):
            return list(llm.generate([prompt], params, lora_request=adapter, use_tqdm=False)[0].outputs[0].token_ids)

        base = run()
        one, two = LoRARequest("a1", 1, str(first)), LoRARequest("a2", 2, str(second))
        with_one, with_two = run(one), run(two)
        assert len(base) == len(with_one) == len(with_two) == 12
        assert with_one != base and with_two != base and with_one != with_two
        assert run(one) == with_one and run() == base
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.mark.engine
def test_engine_bench_measures_adapter_levels_on_the_cpu_engine(tiny_model_dir, tmp_path):
    """engine_bench.py's adapter levels on vLLM's CPU build: the base model, then 2 streams each with
    its own adapter, loaded before the level; the result says which level ran with how many."""
    import asyncio

    from benchmarks.gpu import engine_bench

    config = json.loads((tiny_model_dir / "config.json").read_text())
    dirs = lora.write_adapters(tmp_path / "adapters", config, count=2)
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    (barrier / "scale").write_text("0.05")  # every client sends one request: 0.4 s levels
    (barrier / "go").touch()
    # Its levels take turns with another side's (measure.Turns), one that has already ended.
    (barrier / "turns.json").write_text('["lora-on:0", "other:0", "lora-on:1"]')
    (barrier / "other.ended").touch()
    engine_args = {"model": str(tiny_model_dir), "enable_lora": True, "max_loras": 2, "max_lora_rank": 16,
                   "enforce_eager": True, "dtype": "bfloat16", "max_model_len": 1024, "max_num_seqs": 8,
                   "skip_tokenizer_init": True}  # fmt: skip
    spec = {
        "name": "lora-on",
        "engine_args": engine_args,
        "levels": [2, 2],
        "adapter_counts": [0, 2],
        "adapter_dirs": [str(d) for d in dirs],
        "prompt_id_high": 1000,
    }
    checkpoints: list[dict] = []
    result = asyncio.run(engine_bench.bench(spec, str(tmp_path / "lock"), str(barrier), seed=7,
                                            checkpoint=checkpoints.append))  # fmt: skip
    assert result["resolved"]["max_loras"] == 2 and result["resolved"]["max_lora_rank"] == 16
    # After each turn, the result so far: what a side stopped at the deadline leaves behind.
    assert [(len(c["levels"]), c["partial"]) for c in checkpoints] == [(1, "1 of 2 turns"), (2, "2 of 2 turns")]
    assert "partial" not in result
    base, adapters = result["levels"]
    assert (base["adapters"], adapters["adapters"]) == (0, 2)
    assert base["adapter_load_s"] is None and adapters["adapter_load_s"] > 0
    for level in (base, adapters):
        assert level["errors"] == 0 and level["requests"] >= 2
        assert level["tokens"] == level["requests"] * plan.OUTPUT_TOKENS
    assert report.adapter_summary({"lora-on": result})[1]["vs_base"] > 0
    assert all((barrier / name).exists() for name in ("lora-on:0.done", "lora-on:1.done", "lora-on.ended"))
    assert base["cpu_s"]["engine core"] > 0 and "engine core wait" in base["cpu_s"]
