"""A LoRA adapter folder in PEFT's format: adapter_config.json and adapter_model.safetensors, as peft's
save_pretrained writes them, read for inference into a core.adapters.Adapter checked against the model's
config before any weight is loaded (read_adapter), and written from a training run's arrays (write_adapter).

peft names each tensor after the module it adapts, under its PeftModel's "base_model.model." prefix:
base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight ([r, in]) and ...lora_B.weight ([out, r]);
a folder saved with the adapter's own name in it (lora_A.default.weight) reads the same. The update is
scale (x A^T) B^T with scale = lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora (rsLoRA,
Kalajdzievski 2023). What changes the network beyond that is refused by name (one line naming the file
and the field or tensor) rather than half applied: DoRA's magnitudes, biases, fan_in_fan_out's transposed
layout, modules_to_save (whole replaced modules, e.g. lm_head), per-module ranks and alphas, trainable tokens,
and the variants that compute another update (QALoRA, aLoRA, Arrow, KaSA, MonteCLoRA, block-diagonal LoRA).

Which tensors apply is peft's rule (tuners_utils.check_target_module_exists): a module is adapted when
target_modules names it or a dotted tail of it, exclude_modules does not, and its layer is in
layers_to_transform where that is given (a module named in full takes any layer); a tensor of the file
for any other module is left out, as peft leaves it (a ["gate_proj"] adapter holding q_proj tensors
adapts gate_proj alone). Each field is held to its JSON type: use_rslora: "yes" is no boolean.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ..core.adapters import Adapter
from ..core.config import LAYER_MATRICES, LAYER_TENSORS, Qwen3Config, dimensions, resolve
from ..errors import QwenNPError
from ..numbers.numerics import STORAGE_DTYPES, dtype_named
from .checkpoint import read_header, write_atomically

# peft's file names in an adapter folder, and the prefix its tensor names carry (PeftModel's base_model.model).
ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX = "adapter_config.json", "adapter_model.safetensors", "base_model.model."
# Fields that would change the network beyond y = x W^T + scale (x A^T) B^T, and the values that leave them off.
REFUSED: dict[str, tuple[Any, ...]] = {
    "use_dora": (None, False), "lora_bias": (None, False), "bias": (None, "none"), "fan_in_fan_out": (None, False),
    "modules_to_save": (None, []), "rank_pattern": (None, {}), "alpha_pattern": (None, {}),
    "trainable_token_indices": (None, [], {}), "layer_replication": (None, []), "target_parameters": (None, []),
    "use_qalora": (None, False), "alora_invocation_tokens": (None, []), "use_bdlora": (None, False),
    "arrow_config": (None,), "kasa_config": (None,), "monteclora_config": (None,)}
# Where Qwen3's layer number sits in a module's name, as peft's default layers_pattern finds it (model.layers.N.).
LAYERS_PATTERNS: tuple[Any, ...] = (None, "", "layers", [], ["layers"])
# lora_A.weight, or lora_A.<adapter name>.weight as a folder saved with its adapter's name holds it.
NAMED = re.compile(r"\.lora_([AB])\.[^.]+\.weight$")


def adapter_name(tensor: str, which: str) -> str:
    """model.layers.0.self_attn.q_proj.weight, "A" -> model.layers.0.self_attn.q_proj.lora_A.weight."""
    return tensor.removesuffix(".weight") + f".lora_{which}.weight"


def write_adapter(folder: Path, arrays: dict[str, np.ndarray], base: str, rank: int, alpha: float,
                  targets: Sequence[str], dropout: float = 0.0) -> Path:
    """Adapters (`arrays`, by adapter_name: model.layers.0.self_attn.q_proj.lora_A.weight) in peft's format,
    FP32, tensor names as peft writes them for Qwen3 (base_model.model.model.layers.0...), which
    peft.PeftModel.from_pretrained, vLLM's --lora-modules, llama.cpp's convert_lora_to_gguf.py and
    read_adapter read. base: the base model's name or folder (base_model_name_or_path)."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": rank,
        "lora_alpha": alpha, "lora_dropout": dropout, "target_modules": list(targets), "bias": "none",
        "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
        "use_rslora": False, "use_dora": False}
    tensors = {PEFT_PREFIX + name: np.ascontiguousarray(array, dtype=np.float32) for name, array in arrays.items()}
    write_atomically(folder / ADAPTER_WEIGHTS, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return folder


def read_adapter(folder: str | Path, config: Qwen3Config, name: str | None = None) -> Adapter:
    """The LoRA adapter in `folder` (PEFT's format), for a model of `config`; called `name` (default: the
    folder's name). A QwenNPError names the file and the field or tensor it cannot take."""
    folder = Path(folder)
    if config.is_moe:       # a PEFT adapter of Qwen3-MoE targets each expert's projections: none is read yet
        raise QwenNPError(f"{folder}: LoRA adapters are read for dense Qwen3 only, not Qwen3-MoE ({config.model_type})",
                          "lora")
    settings = _settings(folder / ADAPTER_CONFIG)
    rank, alpha = settings["r"], settings["lora_alpha"]
    scale = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    matrices = _matrices(folder / ADAPTER_WEIGHTS, config, rank, _targeted(settings))
    digest = hashlib.sha256(repr(scale).encode())
    for key in sorted(matrices):
        for array in matrices[key]:
            digest.update(repr(key).encode() + array.tobytes())
    return Adapter(name or folder.name, scale, matrices, digest.digest())


def _settings(path: Path) -> dict[str, Any]:
    """adapter_config.json, checked: a LoRA adapter (r, lora_alpha) of nothing but Qwen3's projections."""
    try:
        settings = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise QwenNPError(f"{path}: not found (an adapter folder in PEFT's format holds {ADAPTER_CONFIG} and "
                          f"{ADAPTER_WEIGHTS})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as bad:
        raise QwenNPError(f"{path}: not readable JSON ({bad})") from None
    if not isinstance(settings, dict):
        raise QwenNPError(f"{path}: must be a JSON object")
    if settings.get("peft_type", "LORA") != "LORA":
        raise QwenNPError(f"{path}: peft_type: only LORA adapters are supported, got {settings['peft_type']!r}")
    for field, off in REFUSED.items():
        if not _is_one_of(settings.get(field), off):
            raise QwenNPError(f"{path}: {field}: {settings[field]!r} is not supported (only {off[-1]!r})")
    if not _is_one_of(settings.get("use_rslora"), (None, False, True)):
        raise QwenNPError(f"{path}: use_rslora: must be true or false, got {settings['use_rslora']!r}")
    layers = settings.get("layers_to_transform")
    if layers is not None and not _is_int(layers) and not (isinstance(layers, list) and all(map(_is_int, layers))):
        raise QwenNPError(f"{path}: layers_to_transform: must be a layer number or a list of them, got {layers!r}")
    if not _is_one_of(settings.get("layers_pattern"), LAYERS_PATTERNS):
        raise QwenNPError(f"{path}: layers_pattern: only Qwen3's \"layers\" is supported, got {settings['layers_pattern']!r}")
    excluded = settings.get("exclude_modules")
    if excluded is not None and not (isinstance(excluded, list) and all(isinstance(name, str) for name in excluded)):
        raise QwenNPError(f"{path}: exclude_modules: only a list of module names is supported, got {excluded!r}")
    rank, alpha = settings.get("r"), settings.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise QwenNPError(f"{path}: r: must be a positive integer, got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise QwenNPError(f"{path}: lora_alpha: must be a number, got {alpha!r}")
    # peft matches a module by its name or a dotted tail of it (q_proj, model.layers.0.self_attn.q_proj: what it
    # writes for "all-linear"); the tensors then say which layers each adapts.
    targets = settings.get("target_modules")
    if targets != "all-linear" and not (isinstance(targets, list) and targets and all(
            isinstance(target, str) and target.rsplit(".", 1)[-1] in LAYER_MATRICES for target in targets)):
        raise QwenNPError(f"{path}: target_modules: expected some of {', '.join(LAYER_MATRICES)} (or \"all-linear\"), "
                          f"got {targets!r}")
    return settings


def _is_one_of(value: Any, allowed: tuple[Any, ...]) -> bool:
    """value equals one of `allowed` and is of its JSON type: 0 is not false, 1 not true, as Python's == has them."""
    return any(type(value) is type(one) and value == one for one in allowed)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _targeted(settings: dict[str, Any]) -> Callable[[str, int], bool]:
    """Whether (module, layer) is adapted: peft's check_target_module_exists for checked settings, where a
    module is its name in the base model (model.layers.0.self_attn.q_proj)."""
    targets, excluded = settings["target_modules"], settings.get("exclude_modules") or []
    layers = settings.get("layers_to_transform")
    layers = None if layers in (None, []) else {layers} if isinstance(layers, int) else set(layers)

    def names(module: str, listed: list[str]) -> bool:
        return module in listed or any(module.endswith(f".{name}") for name in listed)

    def targeted(module: str, layer: int) -> bool:
        if names(module, excluded):
            return False
        if targets == "all-linear" or module in targets:       # a module named in full: any layer (peft's)
            return True
        return names(module, targets) and (layers is None or layer in layers)

    return targeted


def _matrices(path: Path, config: Qwen3Config, rank: int,
              targeted: Callable[[str, int], bool]) -> dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]:
    """(layer, projection) -> (A [r, in], B [out, r]) in FP32 for the modules the config targets (`targeted`;
    a tensor of another is left out, as peft leaves it), every tensor of the file one of a pair whose shapes fit
    the model's projection, and finite."""
    dims = dimensions(config)
    expected = {adapter_name(LAYER_TENSORS[key].name.format(i=i), which): (i, key, which)
                for i in range(config.num_hidden_layers) for key in LAYER_MATRICES for which in "AB"}
    halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for stored, info in read_header(path).items():
        plain = NAMED.sub(r".lora_\1.weight", stored.removeprefix(PEFT_PREFIX))
        if plain not in expected:
            raise QwenNPError(f"{path}: tensor {stored!r} is not a LoRA matrix of a projection of this "
                              f"{config.num_hidden_layers}-layer Qwen3 (lora_A / lora_B of {', '.join(LAYER_MATRICES)})")
        layer, key, which = expected[plain]
        if not targeted(plain.rsplit(".lora_", 1)[0], layer):
            continue
        out, inp = resolve(LAYER_TENSORS[key].shape, dims)
        shape = (rank, inp) if which == "A" else (out, rank)
        if info.shape != shape:
            raise QwenNPError(f"{path}: tensor {stored!r} has shape {list(info.shape)}, the model's {key} needs "
                              f"{list(shape)} (r = {rank})")
        if info.dtype not in STORAGE_DTYPES:
            raise QwenNPError(f"{path}: tensor {stored!r} is {info.dtype}: expected one of {', '.join(STORAGE_DTYPES)}")
        with open(path, "rb") as f:
            f.seek(info.start)
            stored_values = np.fromfile(f, dtype_named(STORAGE_DTYPES[info.dtype]), count=math.prod(shape)).reshape(shape)
        values = stored_values.astype(np.float32)
        if not np.isfinite(values).all():
            raise QwenNPError(f"{path}: tensor {stored!r} holds NaN or Inf")
        if which in halves.setdefault((layer, key), {}):
            raise QwenNPError(f"{path}: tensor {stored!r}: lora_{which} of this projection is in the file twice")
        halves[layer, key][which] = values
    lone = next((key for key, pair in halves.items() if len(pair) < 2), None)
    if lone is not None:
        layer, key = lone
        missing = "B" if "A" in halves[lone] else "A"
        raise QwenNPError(f"{path}: layer {layer}'s {key} has no lora_{missing} beside its lora_{'AB'.replace(missing, '')}")
    if not halves:
        raise QwenNPError(f"{path}: holds no LoRA matrices")
    return {key: (pair["A"], pair["B"]) for key, pair in halves.items()}
