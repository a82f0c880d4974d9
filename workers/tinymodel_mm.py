"""Build a tiny random-weight multimodal Gemma 4 model (text and vision) that vLLM can serve.

The multimodal sibling of workers/tinymodel.py: ``Gemma4ForConditionalGeneration`` with the tiny
text model's shape, a two-layer vision tower, the same byte-level BPE tokenizer plus Gemma 4's
image, audio and video tokens, a ``Gemma4Processor`` (image processor at its smallest budget,
70 soft tokens per image) and a chat template that puts ``<|image|>`` where a message has an
image part. Its output is gibberish; greedy decoding is deterministic.

Usage::

    python -m workers.tinymodel_mm OUT_DIR [--seed 0]

Deterministic and idempotent, like the text model (a marker file written last).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from workers import tinymodel

MARKER_NAME = tinymodel.MARKER_NAME

# Gemma 4's multimodal tokens (the real model's spellings), appended after the text specials.
BOI, EOI, IMAGE = "<|image>", "<image|>", "<|image|>"
BOA, EOA, AUDIO = "<|audio>", "<audio|>", "<|audio|>"
VIDEO = "<|video|>"
MM_TOKENS = [BOI, EOI, IMAGE, BOA, EOA, AUDIO, VIDEO]

# The smallest image budget Gemma 4's image processor supports (70, 140, 280, 560 or 1120 soft
# tokens per image): the longest side is resized so an image costs at most this many tokens.
MAX_SOFT_TOKENS = 70

# As the text model's template, with an image part rendered as the image placeholder, which the
# engine expands to ``<|image>`` + one ``<|image|>`` per soft token + ``<image|>``.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<|turn>' + role + '\\n' }}"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] | trim }}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] | trim }}"
    "{%- elif part['type'] == 'image' -%}{{ '<|image|>' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<turn|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|turn>model\\n' }}{%- endif -%}"
)


def _build_tokenizer():
    fast = tinymodel._build_tokenizer()
    fast.add_special_tokens({"additional_special_tokens": tinymodel.SPECIAL_TOKENS[4:] + MM_TOKENS})
    # Attributes Gemma4Processor reads (saved as named special tokens in tokenizer_config.json).
    fast._set_model_specific_special_tokens(
        special_tokens={
            "image_token": IMAGE, "boi_token": BOI, "eoi_token": EOI,
            "audio_token": AUDIO, "boa_token": BOA, "eoa_token": EOA,
        }
    )  # fmt: skip
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _vocab_size(tokenizer) -> int:
    # Room past the last special token, a multiple of 64.
    return -(-len(tokenizer) // 64) * 64


def _build_model(tokenizer, seed: int):
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4VisionConfig, GenerationConfig

    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in tinymodel.SPECIAL_TOKENS + MM_TOKENS}
    text = tinymodel._text_config(ids, vocab_size=_vocab_size(tokenizer))
    vision = Gemma4VisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        patch_size=16,
        pooling_kernel_size=3,
        position_embedding_size=1024,
        default_output_length=MAX_SOFT_TOKENS,
    )
    config = Gemma4Config(
        text_config=text,
        vision_config=vision,
        audio_config=None,
        boi_token_id=ids[BOI],
        eoi_token_id=ids[EOI],
        image_token_id=ids[IMAGE],
        video_token_id=ids[VIDEO],
        boa_token_id=ids[BOA],
        eoa_token_index=ids[EOA],
        audio_token_id=ids[AUDIO],
        tie_word_embeddings=True,
    )
    config.pad_token_id, config.eos_token_id, config.bos_token_id = (
        ids[tinymodel.PAD], ids[tinymodel.EOS], ids[tinymodel.BOS],
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=ids[tinymodel.BOS],
        pad_token_id=ids[tinymodel.PAD],
        eos_token_id=[ids[tinymodel.EOS], ids[tinymodel.TURN_END]],
    )
    return model


# What ``Gemma4Processor.save_pretrained`` writes, written as data: transformers imports
# Gemma4Processor only beside torchvision, which has no CPU build on the package index here.
PROCESSOR_CONFIG = {
    "processor_class": "Gemma4Processor",
    "image_seq_length": MAX_SOFT_TOKENS,
    "audio_seq_length": 750,
    "audio_ms_per_token": 40,
    "image_processor": {
        "image_processor_type": "Gemma4ImageProcessor",
        "processor_class": "Gemma4Processor",
        "max_soft_tokens": MAX_SOFT_TOKENS,
        "patch_size": 16,
        "pooling_kernel_size": 3,
        "do_convert_rgb": True,
        "do_resize": True,
        "resample": 3,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": False,
        "image_mean": [0.0, 0.0, 0.0],
        "image_std": [1.0, 1.0, 1.0],
    },
    # Gemma4Processor loads all its parts, audio and video too (the model has no audio tower).
    "feature_extractor": {
        "feature_extractor_type": "Gemma4AudioFeatureExtractor",
        "processor_class": "Gemma4Processor",
        "feature_size": 128,
        "sampling_rate": 16000,
        "padding_value": 0.0,
        "padding_side": "right",
        "return_attention_mask": True,
        "frame_length": 320,
        "hop_length": 160,
        "fft_length": 512,
        "min_frequency": 0.0,
        "max_frequency": 8000.0,
        "mel_floor": 0.001,
        "dither": 0.0,
        "input_scale_factor": 1.0,
        "preemphasis": 0.0,
        "preemphasis_htk_flavor": True,
        "fft_overdrive": False,
    },
    "video_processor": {
        "video_processor_type": "Gemma4VideoProcessor",
        "processor_class": "Gemma4Processor",
        "max_soft_tokens": MAX_SOFT_TOKENS,
        "patch_size": 16,
        "pooling_kernel_size": 3,
        "num_frames": 32,
    },
}


def build_tiny_mm_model(out_dir: Path, seed: int = 0) -> Path:
    """Build the tiny multimodal model into ``out_dir`` (no-op when already built); returns it."""
    out_dir = Path(out_dir)
    if tinymodel.is_complete(out_dir):
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer()
    model = _build_model(tokenizer, seed)
    (out_dir / "processor_config.json").write_text(json.dumps(PROCESSOR_CONFIG, indent=2) + "\n")
    tokenizer.save_pretrained(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / MARKER_NAME).write_text(json.dumps({"seed": seed, "multimodal": True}) + "\n")
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m workers.tinymodel_mm",
        description="Build a tiny random-weight multimodal Gemma 4 model (for tests and local development).",
    )
    parser.add_argument("out_dir", type=Path, help="directory to write the model into")
    parser.add_argument("--seed", type=int, default=0, help="random seed for the weights (default 0)")
    args = parser.parse_args(argv)
    build_tiny_mm_model(args.out_dir, seed=args.seed)
    print(f"{args.out_dir}: tiny multimodal model ready (seed {args.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
