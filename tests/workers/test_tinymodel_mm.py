"""The tiny multimodal Gemma 4 builder: a Gemma4ForConditionalGeneration with a vision tower, Gemma 4's
image tokens, a processor config and a chat template that renders image parts; deterministic."""

import hashlib
import json

import pytest

from workers.tinymodel_mm import BOI, EOI, IMAGE, MAX_SOFT_TOKENS, build_tiny_mm_model


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_tiny_mm_model(tmp_path_factory.mktemp("tiny-mm") / "model", seed=0)


def test_the_config_is_a_tiny_gemma4_with_a_vision_tower_and_its_image_tokens(built):
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(built)
    tokenizer = AutoTokenizer.from_pretrained(built)
    assert config.architectures == ["Gemma4ForConditionalGeneration"]
    assert config.audio_config is None
    vision = config.vision_config
    assert (vision.patch_size, vision.pooling_kernel_size, vision.num_hidden_layers) == (16, 3, 2)
    assert config.text_config.vocab_size >= len(tokenizer)
    assert (config.image_token_id, config.boi_token_id, config.eoi_token_id) == tuple(
        tokenizer.convert_tokens_to_ids(token) for token in (IMAGE, BOI, EOI)
    )
    # Gemma4Processor reads these attributes off the tokenizer.
    assert (tokenizer.image_token, tokenizer.boi_token, tokenizer.eoi_token) == (IMAGE, BOI, EOI)


def test_the_chat_template_puts_one_placeholder_per_image_part(built):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built)
    content = [
        {"type": "text", "text": "compare"},
        {"type": "image"},
        {"type": "text", "text": "and"},
        {"type": "image"},
    ]
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ids.count(tokenizer.image_token_id) == 2
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<bos><|turn>user\nhi<turn|>\n<|turn>model\n"


def test_the_processor_config_loads_at_the_smallest_image_budget(built):
    from transformers import AutoFeatureExtractor, AutoImageProcessor

    assert AutoImageProcessor.from_pretrained(built, backend="pil").max_soft_tokens == MAX_SOFT_TOKENS == 70
    assert AutoFeatureExtractor.from_pretrained(built).sampling_rate == 16000
    processor = json.loads((built / "processor_config.json").read_text())
    assert processor["processor_class"] == "Gemma4Processor" and processor["image_seq_length"] == 70


def test_the_build_is_deterministic(built, tmp_path):
    again = build_tiny_mm_model(tmp_path / "again", seed=0)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "processor_config.json"):
        assert (
            hashlib.sha256((built / name).read_bytes()).digest() == hashlib.sha256((again / name).read_bytes()).digest()
        )
