"""The gemma-4-E4B-shaped model folder of the GPU bench (benchmarks/gpu/model.py)."""

import json

from benchmarks.gpu import model


def test_the_config_has_the_e4b_shape_vllm_reads(tmp_path):
    model.write_config(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Gemma4ForCausalLM"]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_key_value_heads", "head_dim",
                "vocab_size", "num_kv_shared_layers", "sliding_window", "hidden_size_per_layer_input"):  # fmt: skip
        assert config[key] == model.E4B_SHAPE[key], key
    assert config["layer_types"].count("full_attention") == 7
    assert config["layer_types"][5::6] == ["full_attention"] * 7


def test_the_tokenizer_has_the_whole_vocabulary_and_round_trips_ids(tmp_path):
    from transformers import AutoTokenizer

    model.build(tmp_path, with_tokenizer=True)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tokenizer) == model.VOCAB_SIZE
    assert tokenizer.eos_token_id == 1 and tokenizer.bos_token_id == 2
    ids = [10, 4321, model.VOCAB_SIZE - 1]
    assert tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False) == ids


def test_build_is_idempotent_and_redone_when_the_tokenizer_choice_changes(tmp_path):
    model.build(tmp_path, with_tokenizer=False)
    assert not (tmp_path / "tokenizer.json").exists()
    (tmp_path / "config.json").write_text("{}")
    model.build(tmp_path, with_tokenizer=False)
    assert (tmp_path / "config.json").read_text() == "{}"  # complete: left alone
    model.build(tmp_path, with_tokenizer=True)
    assert (tmp_path / "tokenizer.json").exists()
