"""Engine profiles: selection by name or environment, overrides, validation."""

import dataclasses

import pytest

from workers.profiles import PROFILES, engine_args_for, engine_env_for, get_profile


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("ENGINE_PROFILE", "ENGINE_ARGS_JSON", "ENGINE_ENFORCE_EAGER"):
        monkeypatch.delenv(name, raising=False)


def test_the_default_profile_is_cpu():
    assert get_profile().name == "cpu"


def test_engine_profile_env_selects_the_profile(monkeypatch):
    monkeypatch.setenv("ENGINE_PROFILE", "a10g")
    assert get_profile().name == "a10g"


def test_an_unknown_profile_is_refused_with_the_valid_names():
    with pytest.raises(ValueError, match=r"unknown engine profile 'tpu'; valid profiles: a10g, cpu, h200"):
        engine_args_for("tpu", "/models/x")


def test_cpu_args_are_small_and_eager_by_default():
    args = engine_args_for("cpu", "/models/tiny")
    assert args["model"] == "/models/tiny"
    assert args["max_model_len"] == 2048
    assert args["max_num_seqs"] == 64
    assert args["enforce_eager"] is True


def test_engine_enforce_eager_env_turns_compilation_on(monkeypatch):
    monkeypatch.setenv("ENGINE_ENFORCE_EAGER", "false")
    assert engine_args_for("cpu", "/m")["enforce_eager"] is False


def test_a_malformed_enforce_eager_is_refused(monkeypatch):
    monkeypatch.setenv("ENGINE_ENFORCE_EAGER", "maybe")
    with pytest.raises(ValueError, match="ENGINE_ENFORCE_EAGER must be a boolean"):
        engine_args_for("cpu", "/m")


def test_the_gpu_profiles_serve_gemma4_with_cuda_graphs():
    a10g = engine_args_for("a10g", "")
    assert a10g["model"] == "google/gemma-4-E4B-it"
    assert a10g["gpu_memory_utilization"] == 0.92
    assert a10g["enable_prefix_caching"] and a10g["enable_chunked_prefill"]
    assert a10g["enforce_eager"] is False
    h200 = engine_args_for("h200", "/weights/gemma")
    assert h200["model"] == "/weights/gemma"
    assert h200["max_num_seqs"] > a10g["max_num_seqs"]
    assert h200["max_num_batched_tokens"] > a10g["max_num_batched_tokens"]
    assert h200["async_scheduling"] is True


def test_overrides_win_over_the_profile_and_env_json_wins_last(monkeypatch):
    assert engine_args_for("cpu", "/m", max_num_seqs=8)["max_num_seqs"] == 8
    monkeypatch.setenv("ENGINE_ARGS_JSON", '{"max_num_seqs": 4, "seed": 7}')
    args = engine_args_for("cpu", "/m", max_num_seqs=8)
    assert (args["max_num_seqs"], args["seed"]) == (4, 7)


@pytest.mark.parametrize(
    ("raw", "message"),
    [("{not json", "ENGINE_ARGS_JSON is not valid JSON"), ("[1, 2]", "ENGINE_ARGS_JSON must be a JSON object")],
)
def test_a_malformed_engine_args_json_is_refused(monkeypatch, raw, message):
    monkeypatch.setenv("ENGINE_ARGS_JSON", raw)
    with pytest.raises(ValueError, match=message):
        engine_args_for("cpu", "/m")


def test_profile_env_never_overrides_a_variable_already_set(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert engine_env_for("cpu") == {"VLLM_CPU_KVCACHE_SPACE": "1"}
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    assert engine_env_for("cpu") == {}


def test_profiles_are_read_only():
    profile = PROFILES["cpu"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        profile.name = "gpu"
    with pytest.raises(TypeError):
        profile.engine_args["max_num_seqs"] = 1
    engine_args_for("cpu", "/m", max_num_seqs=1)
    assert profile.engine_args["max_num_seqs"] == 64


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_profile_is_accepted_by_vllm_engine_args(name):
    from vllm.engine.arg_utils import AsyncEngineArgs

    known = {field.name for field in dataclasses.fields(AsyncEngineArgs)}
    args = engine_args_for(name, "/models/gemma")
    assert set(args) <= known, set(args) - known
    AsyncEngineArgs(**args)  # builds without resolving the model
