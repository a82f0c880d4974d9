"""Random PEFT LoRA adapters for a Gemma 4 text model, written without peft (runs on the device machine).

The GPU machine has no peft and the bench model has no weights (``load_format="dummy"``), so the
adapters are written from the model's config alone, in the files and tensor names PEFT saves for
``Gemma4ForCausalLM`` (tests/adapters/lora.py writes the same for the tiny model):

    adapter_config.json          {"peft_type": "LORA", "r": 16, "target_modules": [...], ...}
    adapter_model.safetensors    base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_{A,B}.weight

``lora_A`` is (rank, in_features) and ``lora_B`` (out_features, rank), bf16. vLLM strips
``base_model.model.`` and packs q/k/v into its ``qkv_proj`` (``packed_modules_mapping`` of vLLM's
Gemma 4 model). The projections' shapes follow vLLM's Gemma 4 attention: head dim ``head_dim`` on
sliding layers and ``global_head_dim`` (when the config has one) on full-attention layers; with
``attention_k_eq_v`` a full-attention layer has no v_proj and ``num_global_key_value_heads`` K heads.
The last ``num_kv_shared_layers`` layers reuse an earlier layer's K/V and have a q_proj only (in
transformers, so in a PEFT adapter, and in vLLM 0.32; vLLM 0.26 builds a ``qkv_proj`` there and
applies the adapter to its Q part), so the adapter has no k/v tensors for them, as a tenant's has not.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
RANK = 16


def attention_shapes(config: dict[str, Any], modules: tuple[str, ...] = MODULES) -> dict[str, tuple[int, int]]:
    """{module path: (out_features, in_features)} of every decoder layer's attention projections, from
    a Gemma 4 text config (``config.json``'s fields, or ``model.E4B_SHAPE``)."""
    hidden, heads, layers = config["hidden_size"], config["num_attention_heads"], config["num_hidden_layers"]
    first_kv_shared = layers - (config.get("num_kv_shared_layers") or 0)
    shapes: dict[str, tuple[int, int]] = {}
    for layer, layer_type in enumerate(config["layer_types"][:layers]):
        full = layer_type == "full_attention"
        head_dim = (config.get("global_head_dim") or config["head_dim"]) if full else config["head_dim"]
        k_eq_v = full and bool(config.get("attention_k_eq_v"))
        kv_heads = (config.get("num_global_key_value_heads") or config["num_key_value_heads"]) if k_eq_v \
            else config["num_key_value_heads"]  # fmt: skip
        sizes = {
            "q_proj": (heads * head_dim, hidden),
            "k_proj": (kv_heads * head_dim, hidden),
            "v_proj": (kv_heads * head_dim, hidden),
            "o_proj": (hidden, heads * head_dim),
        }
        for module in modules:
            if module in ("k_proj", "v_proj") and layer >= first_kv_shared:
                continue  # K/V come from an earlier layer's cache: no k/v projections
            if module == "v_proj" and k_eq_v:
                continue  # K doubles as V: the layer has no v_proj
            shapes[f"model.layers.{layer}.self_attn.{module}"] = sizes[module]
    return shapes


def adapter_tensors(shapes: dict[str, tuple[int, int]], rank: int = RANK, seed: int = 0, scale: float = 0.02) -> dict:
    """The adapter's tensors by PEFT name: random ``lora_A`` and ``lora_B`` (bf16, std ``scale``)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (out_features, in_features) in shapes.items():
        prefix = f"base_model.model.{module}"
        a = torch.randn(rank, in_features, generator=generator) * scale
        b = torch.randn(out_features, rank, generator=generator) * scale
        tensors[f"{prefix}.lora_A.weight"] = a.to(torch.bfloat16).contiguous()
        tensors[f"{prefix}.lora_B.weight"] = b.to(torch.bfloat16).contiguous()
    return tensors


def adapter_config(rank: int = RANK, modules: tuple[str, ...] = MODULES) -> dict[str, Any]:
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": list(modules), "bias": "none", "base_model_name_or_path": "gemma-4-E4B-shaped",
    }  # fmt: skip


def write_adapter(out_dir: Path, config: dict[str, Any], rank: int = RANK, seed: int = 0,
                  scale: float = 0.02, modules: tuple[str, ...] = MODULES) -> Path:  # fmt: skip
    """Write one adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``); returns it."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = adapter_tensors(attention_shapes(config, modules), rank, seed, scale)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    (out_dir / "adapter_config.json").write_text(json.dumps(adapter_config(rank, modules), indent=1))
    return out_dir


def write_adapters(folder: Path, config: dict[str, Any], count: int, rank: int = RANK) -> list[Path]:
    """``count`` distinct adapters (seeds 1..count) in ``folder``/a1 ... (idempotent: a marker records
    what was written); returns their folders in order."""
    folder = Path(folder)
    marker = folder / ".complete"
    want = {"count": count, "rank": rank, "shapes": len(attention_shapes(config))}
    dirs = [folder / f"a{i}" for i in range(1, count + 1)]
    if marker.exists() and json.loads(marker.read_text()) == want:
        return dirs
    for i, path in enumerate(dirs, start=1):
        write_adapter(path, config, rank, seed=i)
    marker.write_text(json.dumps(want))
    return dirs
