"""Tiny PEFT LoRA adapters for the tiny Gemma 4 model, written directly (adapter_config.json and
adapter_model.safetensors, exactly as PEFT saves them) so the tests need no training library."""

import json

import torch
from safetensors.torch import save

# The tiny model's projections (workers/tinymodel.py): (out_features, in_features).
TINY_SHAPES = {
    "q_proj": (128, 64), "k_proj": (64, 64), "v_proj": (64, 64), "o_proj": (64, 128),
    "gate_proj": (128, 64), "up_proj": (128, 64), "down_proj": (64, 128),
}  # fmt: skip
TINY_LAYERS = 4


def lora_files(
    *, rank: int = 8, seed: int = 1, modules=("q_proj", "v_proj", "o_proj", "down_proj"), layers: int = TINY_LAYERS,
    shapes=None, scale: float = 1.0, config_overrides=None,
) -> tuple[bytes, bytes]:  # fmt: skip
    """(adapter_config.json, adapter_model.safetensors) of a random LoRA adapter. The weights are
    large enough that greedy output differs from the base model's."""
    shapes = shapes or TINY_SHAPES
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for module in modules:
            out_features, in_features = shapes[module]
            parent = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            a = torch.randn(rank, in_features, generator=generator) * scale
            b = torch.randn(out_features, rank, generator=generator) * scale
            tensors[f"{prefix}.lora_A.weight"] = a.to(torch.bfloat16).contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.to(torch.bfloat16).contiguous()
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": list(modules), "base_model_name_or_path": "tiny-gemma4", "bias": "none",
        **(config_overrides or {}),
    }  # fmt: skip
    return json.dumps(config).encode(), save(tensors)
