"""A gemma-4-E4B-shaped model without weights, for the GPU bench (runs on the device machine).

No weights can be downloaded there, so vLLM fills random ones (``load_format="dummy"``); all it
needs is a ``config.json`` with the real model's shape (``../shared/gpu/README.md``, DESIGN.md):
hidden 2560, 42 layers as [5 sliding, 1 full] x 7, intermediate 10240, 8 query / 2 KV heads, head
dim 256, vocab 262,144, per-layer embeddings (262,144 x 256 per layer), KV shared across the last
18 layers, sliding window 512, final logit softcap 30, tied embeddings.

Caveat, stated with every result: ``per_layer_config={}`` is needed for transformers 5.17 to load
the config, and it drops ``global_head_dim``, so the 7 full-attention layers run at head dim 256
instead of the real model's 512 (slightly lighter attention, and vLLM's default FlashAttention 3
path instead of the FA4/Triton path it picks for the real model's mixed head dims).

The platform's gateway loads the model's tokenizer (for the vocabulary size of id prompts, and the
worker's engine detokenizes), so ``with_tokenizer=True`` adds a word-level tokenizer with exactly
262,144 entries: token ``i`` is the word ``w<i>`` (the special tokens at Gemma's ids 0-3).
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB_SIZE = 262_144
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>"]  # Gemma's ids 0, 1, 2, 3

E4B_SHAPE = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 2560,
    "intermediate_size": 10240,
    "num_hidden_layers": 42,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "max_position_embeddings": 131072,
    "sliding_window": 512,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 7,
    "vocab_size_per_layer_input": VOCAB_SIZE,
    "hidden_size_per_layer_input": 256,
    "num_kv_shared_layers": 18,
    "final_logit_softcapping": 30.0,
    "tie_word_embeddings": True,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
}


def token_word(token_id: int) -> str:
    """The word the benchmark tokenizer uses for ``token_id``."""
    return SPECIAL_TOKENS[token_id] if token_id < len(SPECIAL_TOKENS) else f"w{token_id}"


def write_config(out_dir: Path) -> Path:
    """Write ``config.json`` (and ``generation_config.json``) through transformers' own config class,
    so the file is what the installed transformers, and so vLLM, reads back."""
    from transformers import GenerationConfig
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    config = Gemma4TextConfig(**E4B_SHAPE, per_layer_config={}, dtype="bfloat16")
    config.architectures = ["Gemma4ForCausalLM"]
    config.save_pretrained(out_dir)
    GenerationConfig(bos_token_id=2, eos_token_id=1, pad_token_id=0).save_pretrained(out_dir)
    return out_dir / "config.json"


def write_tokenizer(out_dir: Path) -> None:
    """A word-level tokenizer with ``VOCAB_SIZE`` entries (no training: the vocabulary is given)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token_word(i): i for i in range(VOCAB_SIZE)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=E4B_SHAPE["max_position_embeddings"],
    )
    fast.save_pretrained(out_dir)


def build(out_dir: Path, with_tokenizer: bool) -> Path:
    """Write the model folder (idempotent); returns it."""
    out_dir = Path(out_dir)
    marker = out_dir / ".complete"
    if marker.exists() and json.loads(marker.read_text()) == {"tokenizer": with_tokenizer}:
        return out_dir
    write_config(out_dir)
    if with_tokenizer:
        write_tokenizer(out_dir)
    marker.write_text(json.dumps({"tokenizer": with_tokenizer}))
    return out_dir
