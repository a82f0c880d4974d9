"""The tiny Gemma 4 model builder: complete, deterministic, idempotent, Gemma-shaped."""

import hashlib
import json

import pytest

from workers import tinymodel
from workers.tinymodel import MARKER_NAME, build_tiny_model, is_complete

EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    MARKER_NAME,
}


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def test_it_writes_a_complete_model(built):
    names = {p.name for p in built.iterdir()}
    assert EXPECTED_FILES <= names
    assert is_complete(built)


def test_the_config_is_a_tiny_gemma4_text_model(built):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(built)
    assert config.model_type == "gemma4_text"
    assert config.architectures == ["Gemma4ForCausalLM"]
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (64, 4, 1024)
    assert config.layer_types[-1] == "full_attention"


def test_the_same_seed_gives_the_same_files(built, tmp_path):
    again = build_tiny_model(tmp_path / "again", seed=0)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _digest(again / name) == _digest(built / name), name


def test_another_seed_gives_other_weights_and_the_same_tokenizer(built, tmp_path):
    other = build_tiny_model(tmp_path / "other", seed=1)
    assert _digest(other / "model.safetensors") != _digest(built / "model.safetensors")
    assert _digest(other / "tokenizer.json") == _digest(built / "tokenizer.json")


def test_a_second_build_does_nothing(built, capsys):
    before = {p.name: p.stat().st_mtime_ns for p in built.iterdir()}
    assert tinymodel.main([str(built)]) == 0
    assert "already built, nothing to do" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in built.iterdir()} == before


def test_an_interrupted_build_is_redone(tmp_path):
    target = tmp_path / "partial"
    target.mkdir()
    (target / "config.json").write_text("{}")  # a build that died before its marker
    assert not is_complete(target)
    build_tiny_model(target)
    assert is_complete(target)
    assert json.loads((target / "config.json").read_text())["model_type"] == "gemma4_text"


def test_the_chat_template_renders_gemma4_turns(built):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": [{"type": "text", "text": "How are you?"}]},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nHello there<turn|>\n"
        "<|turn>model\nHi.<turn|>\n<|turn>user\nHow are you?<turn|>\n<|turn>model\n"
    )
    without_prompt = tokenizer.apply_chat_template(messages[:2], add_generation_prompt=False, tokenize=False)
    assert not without_prompt.endswith("<|turn>model\n")


def test_special_tokens_are_single_tokens_at_gemma_ids(built):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built)
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id) == (0, 1, 2)
    ids = tokenizer.encode("<|turn>user\nhi<turn|>", add_special_tokens=False)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|turn>")
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<turn|>")
    assert tokenizer.decode(tokenizer.encode("Hello, world!", add_special_tokens=False)) == "Hello, world!"


def test_generation_stops_at_end_of_text_and_end_of_turn(built):
    generation = json.loads((built / "generation_config.json").read_text())
    assert sorted(generation["eos_token_id"]) == [1, 5]  # <eos>, <turn|>


def test_the_cli_builds_into_a_new_folder(tmp_path, capsys):
    assert tinymodel.main([str(tmp_path / "cli"), "--seed", "3"]) == 0
    assert "tiny model built (seed 3)" in capsys.readouterr().out
    assert is_complete(tmp_path / "cli")
