"""Build a tiny random-weight Gemma 4 text model that vLLM can serve.

The real model (google/gemma-4-E4B-it) cannot be downloaded on development machines and would
not fit on two CPU cores anyway. This module builds, in seconds and without network access, a
model of the same architecture (``Gemma4ForCausalLM``, per-layer embeddings, sliding and global
attention layers) with random weights, a byte-level BPE tokenizer trained on a small built-in
corpus, Gemma 4's special tokens and a Gemma-4-style chat template. Its output is gibberish, but
greedy decoding is deterministic, which is what tests and benchmarks of the serving path need.

Usage::

    python -m workers.tinymodel OUT_DIR [--seed 0]

The build is deterministic (same seed, same files) and idempotent: a marker file written last
records a finished build, and a second call on the same directory does nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

# Written last: its presence means every other file is complete.
MARKER_NAME = ".tinymodel-complete"

VOCAB_SIZE = 1024

# Gemma 4's special tokens, at the low ids Gemma reserves for them (pad 0, eos 1, bos 2, unk 3).
# A chat turn is ``<|turn>role\n...<turn|>``; ``<|channel>``/``<channel|>`` delimit thinking.
PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
TURN_START, TURN_END = "<|turn>", "<turn|>"
SPECIAL_TOKENS = [PAD, EOS, BOS, UNK, TURN_START, TURN_END, "<|channel>", "<channel|>"]

# Gemma 4's template shape: bos once, each message as ``<|turn>{role}\n{content}<turn|>\n``, the
# assistant role spelled ``model``, and ``<|turn>model\n`` as the generation prompt. Tools as Gemma
# 4 places them (declarations in a system turn first, calls in the model's turn, results in a tool
# turn), with their definitions and arguments as JSON rather than Gemma 4's own argument syntax.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools -%}"
    "{{ '<|turn>system\\n' }}"
    "{%- for tool in tools -%}"
    "{{ '<|tool>declaration:' + tool['function']['name'] + (tool['function'] | tojson) + '<tool|>' }}"
    "{%- endfor -%}"
    "{{ '<turn|>\\n' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{%- if message['content'] is string -%}"
    "{%- set content = message['content'] -%}"
    "{%- else -%}"
    "{%- set content = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('\\n') -%}"
    "{%- endif -%}"
    "{%- set turn = namespace(text=content | trim) -%}"
    "{%- if message['tool_calls'] is defined -%}{%- for call in message['tool_calls'] -%}"
    "{%- set turn.text = turn.text + '<|tool_call>call:' + call['function']['name']"
    " + (call['function']['arguments'] | tojson) + '<tool_call|>' -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{%- set turn.text = '<|tool_response>response:' + (message['name'] | default('')) + turn.text"
    " + '<tool_response|>' -%}"
    "{%- endif -%}"
    "{{ '<|turn>' + role + '\\n' + turn.text + '<turn|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|turn>model\\n' }}{%- endif -%}"
)

# A small, fixed corpus: enough text for a 1024-entry byte-level BPE vocabulary.
_CORPUS_LINES = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, how are you today? I am fine, thank you.",
    "A multi-tenant platform serves many customers from one deployment.",
    "Each tenant has its own API keys, quotas, usage ledger and invoices.",
    "The gateway authenticates a request, admits it, and dispatches it to a worker.",
    "Workers host a language model engine and stream tokens back to the gateway.",
    "Continuous batching lets the engine decode many requests at the same time.",
    "Tokens per second is the number of generated tokens divided by the elapsed time.",
    "Time to first token measures how long a client waits before output starts.",
    "Please summarise the following paragraph in one sentence.",
    "Write a short poem about the sea, the wind and the stars.",
    "What is the capital of France? The capital of France is Paris.",
    "Translate to German: good morning, good evening, good night.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "SELECT id, name FROM tenants WHERE active = true ORDER BY name;",
    '{"model": "gemma", "messages": [{"role": "user", "content": "hi"}], "stream": true}',
    "One, two, three, four, five, six, seven, eight, nine, ten.",
    "0123456789 + - * / = < > ( ) [ ] { } ! ? . , ; : ' \" @ # $ % ^ & _ ~",
    "Monday Tuesday Wednesday Thursday Friday Saturday Sunday",
    "January February March April May June July August September October November December",
    "Science, history, music, art, mathematics, geography, literature and philosophy.",
    "The weather today is sunny with a light breeze and a few clouds in the afternoon.",
]


def _corpus() -> list[str]:
    # Repetition with small variations gives the BPE trainer stable pair counts.
    return [f"{line} {i}" for i in range(8) for line in _CORPUS_LINES]


def _build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=[TURN_START, TURN_END, "<|channel>", "<channel|>"],
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _text_config(ids: dict[str, int], vocab_size: int = VOCAB_SIZE):
    """The tiny text model's config (also the text half of the multimodal one); ``ids``: special
    token -> id."""
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        # The CPU attention kernels support head sizes 32, 64, 80, 96, 112, 128, 256 (not 16).
        head_dim=32,
        max_position_embeddings=4096,
        sliding_window=128,
        # Three sliding layers then one global one, like the real model's pattern (last is global).
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        # Per-layer embeddings, as in the E-series models, kept tiny.
        vocab_size_per_layer_input=vocab_size,
        hidden_size_per_layer_input=16,
        # Same head dim and KV heads on every layer (the real model uses 512 on global layers).
        per_layer_config={},
        final_logit_softcapping=30.0,
        pad_token_id=ids[PAD],
        eos_token_id=ids[EOS],
        bos_token_id=ids[BOS],
        tie_word_embeddings=True,
        dtype="bfloat16",
    )


def _build_model(tokenizer, seed: int):
    import torch
    from transformers import Gemma4ForCausalLM, GenerationConfig

    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in SPECIAL_TOKENS}
    config = _text_config(ids)
    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=ids[BOS],
        pad_token_id=ids[PAD],
        # Generation ends at end of text or end of the model's turn, as with the real model.
        eos_token_id=[ids[EOS], ids[TURN_END]],
    )
    return model


def is_complete(out_dir: Path) -> bool:
    """True when ``out_dir`` holds a finished build (its marker file exists)."""
    return (Path(out_dir) / MARKER_NAME).is_file()


def _refresh_chat_template(out_dir: Path) -> None:
    """Bring a finished build's chat template up to CHAT_TEMPLATE (a build made before the template
    rendered tools), atomically: a process loading the tokenizer meanwhile reads one or the other."""
    path = out_dir / "chat_template.jinja"
    if not path.is_file() or path.read_text() == CHAT_TEMPLATE:
        return
    staged = path.with_name(f".{path.name}.{os.getpid()}")
    staged.write_text(CHAT_TEMPLATE)
    os.replace(staged, path)


def build_tiny_model(out_dir: Path, seed: int = 0) -> Path:
    """Build the tiny model into ``out_dir`` (created if needed) and return ``out_dir``.

    Does nothing when ``out_dir`` already holds a complete build. Same ``seed``, same weights and
    tokenizer. The marker file is written last, so an interrupted build is redone next time.
    """
    out_dir = Path(out_dir)
    if is_complete(out_dir):
        _refresh_chat_template(out_dir)
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer()
    model = _build_model(tokenizer, seed)
    tokenizer.save_pretrained(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / MARKER_NAME).write_text(json.dumps({"seed": seed}) + "\n")
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m workers.tinymodel",
        description="Build a tiny random-weight Gemma 4 text model (for tests and local development).",
    )
    parser.add_argument("out_dir", type=Path, help="directory to write the model into")
    parser.add_argument("--seed", type=int, default=0, help="random seed for the weights (default 0)")
    args = parser.parse_args(argv)
    if is_complete(args.out_dir):
        print(f"{args.out_dir}: tiny model already built, nothing to do")
        return 0
    build_tiny_model(args.out_dir, seed=args.seed)
    print(f"{args.out_dir}: tiny model built (seed {args.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
