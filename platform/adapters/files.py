"""Checks an uploaded PEFT LoRA adapter against its base model before anything is stored.

Only the safetensors format is read (never pickle: a pickle file runs code when loaded), and only its
header: tensor names, dtypes, shapes and offsets, checked against the file's length (a truncated file
is refused) and against the base model's own safetensors headers (each adapted module must exist in
the base, and its lora_A / lora_B shapes must fit the base weight and the adapter's rank). Every
refusal is an `InvalidRequest` that names the problem; nothing here writes anything.
"""

import functools
import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from core.errors import InvalidRequest, ServiceUnavailable

# The linear layers vLLM applies LoRA to in Gemma 4's decoder (attention and MLP projections).
SUPPORTED_MODULES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})
_ITEM_BYTES = {"F16": 2, "BF16": 2, "F32": 4}
_HEADER_LIMIT = 16 * 1024 * 1024
_PEFT_PREFIX = "base_model.model."
_LORA_KEY = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A|lora_B)\.weight$")


@dataclass(frozen=True)
class AdapterSpec:
    """What the checks learnt of an accepted adapter."""

    rank: int
    target_modules: list[str]
    size_bytes: int


def _refuse(message: str, code: str, param: str = "weights") -> InvalidRequest:
    return InvalidRequest(message, param=param, code=code)


def safetensors_header(data: bytes, *, what: str, param: str) -> dict[str, dict]:
    """The tensors a safetensors file declares ({name: {dtype, shape, data_offsets}}), after checking
    that the file is complete and its offsets consistent."""
    try:
        return _safetensors_header(data, what=what, param=param)
    except InvalidRequest as exc:
        if exc.code == "adapter_not_safetensors" and (data[:2] in (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")
                                                      or data[:4] == b"PK\x03\x04"):  # fmt: skip
            raise _refuse(f"{what} is a pickle (PyTorch .bin/.pt) file; only safetensors is accepted.",
                          "adapter_not_safetensors", param) from None  # fmt: skip
        raise


def _safetensors_header(data: bytes, *, what: str, param: str) -> dict[str, dict]:
    if len(data) < 8:
        raise _refuse(f"{what} is not a safetensors file (too short).", "adapter_not_safetensors", param)
    (length,) = struct.unpack("<Q", data[:8])
    if length > _HEADER_LIMIT:
        raise _refuse(f"{what} is not a safetensors file (header length {length}).", "adapter_not_safetensors", param)
    if 8 + length > len(data):
        raise _refuse(f"{what} is truncated: its header runs past the end of the file.", "adapter_truncated", param)
    try:
        header = json.loads(data[8 : 8 + length])
    except (UnicodeDecodeError, ValueError):
        raise _refuse(f"{what} is not a safetensors file (bad header).", "adapter_not_safetensors", param) from None
    if not isinstance(header, dict):
        raise _refuse(f"{what} is not a safetensors file (bad header).", "adapter_not_safetensors", param)
    header.pop("__metadata__", None)
    body = len(data) - 8 - length
    end = 0
    for name, entry in header.items():
        _check_entry(name, entry, what=what, param=param)
        end = max(end, entry["data_offsets"][1])
    if end > body:
        raise _refuse(f"{what} is truncated: {body} bytes of tensor data, {end} declared.", "adapter_truncated", param)
    return header


def _check_entry(name: str, entry, *, what: str, param: str) -> None:
    ok = isinstance(entry, dict) and entry.get("dtype") in _ITEM_BYTES and isinstance(entry.get("shape"), list)
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    ok = ok and all(isinstance(d, int) and d >= 0 for d in entry["shape"])
    if not (ok and isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise _refuse(
            f"{what}: tensor {name!r} has an unsupported dtype or a malformed entry.", "adapter_bad_tensor", param
        )
    if offsets[1] - offsets[0] != math.prod(entry["shape"]) * _ITEM_BYTES[entry["dtype"]] or offsets[0] < 0:
        raise _refuse(f"{what}: tensor {name!r} has offsets that do not match its shape.", "adapter_bad_tensor", param)


def _read_header(path: Path) -> dict[str, dict]:
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header


@functools.lru_cache(maxsize=8)
def base_weight_shapes(model_path: str) -> dict[str, tuple[int, ...]]:
    """Every 2-D weight of the base model by name, from its safetensors headers (no weights read)."""
    files = sorted(Path(model_path).glob("*.safetensors")) if Path(model_path).is_dir() else []
    if not files:
        raise ServiceUnavailable(
            "The base model's weights are not available to this server, so adapters for it cannot be checked.",
            code="adapter_base_unavailable",
        )
    shapes = {}
    for file in files:
        for name, entry in _read_header(file).items():
            if name.endswith(".weight") and len(entry["shape"]) == 2:
                shapes[name[: -len(".weight")]] = tuple(entry["shape"])
    return shapes


def parse_config(raw: bytes) -> dict:
    try:
        config = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        raise _refuse("adapter_config.json is not valid JSON.", "adapter_bad_config", "config") from None
    if not isinstance(config, dict):
        raise _refuse("adapter_config.json must be a JSON object.", "adapter_bad_config", "config")
    if str(config.get("peft_type", "")).upper() != "LORA":
        raise _refuse("Only PEFT LoRA adapters (peft_type LORA) are accepted.", "adapter_bad_config", "config")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _refuse("adapter_config.json: r (the rank) must be a positive integer.", "adapter_bad_config", "config")
    if config.get("use_dora") or config.get("modules_to_save") or config.get("bias", "none") != "none":
        raise _refuse(
            "DoRA, modules_to_save and trained biases are not supported; only plain LoRA weights.",
            "adapter_bad_config",
            "config",
        )
    return config


def _target_names(config: dict) -> list[str] | None:
    """The target module names the config lists (None for a regex, which the tensors then settle)."""
    targets = config.get("target_modules")
    if isinstance(targets, str):
        return None
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise _refuse("adapter_config.json: target_modules must list module names.", "adapter_bad_config", "config")
    return targets


def adapter_check(*, config_raw: bytes, weights: bytes, base_path: str, max_rank: int, max_bytes: int) -> AdapterSpec:
    """The adapter's rank, modules and size once every check passed; InvalidRequest otherwise."""
    size = len(config_raw) + len(weights)
    if size > max_bytes:
        raise _refuse(f"The adapter is {size} bytes; at most {max_bytes} are accepted.", "adapter_too_large")
    config = parse_config(config_raw)
    rank = config["r"]
    if rank > max_rank:
        raise _refuse(f"The adapter's rank is {rank}; this platform serves ranks up to {max_rank}.",
                      "adapter_rank_too_large", "config")  # fmt: skip
    header = safetensors_header(weights, what="adapter_model.safetensors", param="weights")
    base = base_weight_shapes(base_path)
    modules = _lora_modules(header)
    targets = _target_names(config)
    for target in targets or []:
        if target not in SUPPORTED_MODULES:
            supported = ", ".join(sorted(SUPPORTED_MODULES))
            raise _refuse(f"target module {target!r} is not supported; supported: {supported}.",
                          "adapter_unsupported_module", "config")  # fmt: skip
        if not any(name.rsplit(".", 1)[-1] == target for name in base):
            raise _refuse(
                f"target module {target!r} does not exist in the base model.", "adapter_base_mismatch", "config"
            )
    for module, parts in modules.items():
        _check_module(module, parts, base=base, rank=_module_rank(config, module), targets=targets)
    names = sorted({module.rsplit(".", 1)[-1] for module in modules})
    return AdapterSpec(rank=rank, target_modules=names, size_bytes=size)


def _lora_modules(header: dict[str, dict]) -> dict[str, dict[str, list[int]]]:
    """{base module name: {"lora_A": shape, "lora_B": shape}} from the adapter's tensor names."""
    modules: dict[str, dict[str, list[int]]] = {}
    for name, entry in header.items():
        match = _LORA_KEY.match(name[len(_PEFT_PREFIX) :] if name.startswith(_PEFT_PREFIX) else "")
        if match is None:
            raise _refuse(f"tensor {name!r} is not a LoRA weight (base_model.model.<module>.lora_A/B.weight).",
                          "adapter_bad_tensor")  # fmt: skip
        if len(entry["shape"]) != 2:
            raise _refuse(f"tensor {name!r} must be 2-D.", "adapter_shape_mismatch")
        modules.setdefault(match["module"], {})[match["part"]] = entry["shape"]
    if not modules:
        raise _refuse("adapter_model.safetensors holds no LoRA weights.", "adapter_bad_tensor")
    return modules


def _module_rank(config: dict, module: str) -> int:
    pattern = config.get("rank_pattern") or {}
    for key, value in pattern.items() if isinstance(pattern, dict) else ():
        if module == key or module.endswith(f".{key}"):
            return value
    return config["r"]


def _check_module(module: str, parts: dict, *, base: dict, rank: int, targets: list[str] | None) -> None:
    short = module.rsplit(".", 1)[-1]
    if short not in SUPPORTED_MODULES or (targets is not None and short not in targets):
        raise _refuse(f"the weights adapt {module!r}, which is not a supported target module of this adapter.",
                      "adapter_unsupported_module")  # fmt: skip
    if module not in base:
        raise _refuse(f"the weights adapt {module!r}, which does not exist in the base model.", "adapter_base_mismatch")
    if set(parts) != {"lora_A", "lora_B"}:
        raise _refuse(f"{module!r} needs both lora_A and lora_B weights.", "adapter_bad_tensor")
    out_features, in_features = base[module]
    expected = {"lora_A": [rank, in_features], "lora_B": [out_features, rank]}
    for part, shape in parts.items():
        if shape != expected[part]:
            raise _refuse(f"{module}.{part} has shape {shape}; the base model and rank {rank} need {expected[part]}.",
                          "adapter_shape_mismatch")  # fmt: skip
