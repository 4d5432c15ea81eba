"""A model's files, whatever holds them (a checkpoint folder, a GGUF file or a hub id): its config,
tokenizer, generation defaults and tensors. The one place that tells a GGUF file from a folder."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import gguf_file
from .checkpoint import Checkpoint, is_gguf, resolve_model_path
from ..core.config import Qwen3Config, id_list, load_config, read_json_object
from ..errors import QwenNPError
from .gguf_file import GGUFCheckpoint
from ..core.sampling import SamplingParams
from .tokenizer import Tokenizer

GENERATION_CONFIG = "generation_config.json"
# What transformers' GenerationConfig falls back to for keys a generation_config.json leaves out.
TRANSFORMERS_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": 0.0,
                         "repetition_penalty": 1.0}


@dataclass(frozen=True)
class GenerationDefaults:
    """What a checkpoint says about generating: its sampling settings and every id that ends a reply."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: tuple[int, ...] = ()


def folder_generation_defaults(folder: str | Path, config: Qwen3Config) -> GenerationDefaults:
    """Sampling defaults from `folder/generation_config.json`, read the way transformers reads them
    (loading.read_generation_defaults also reads a GGUF's general.sampling.* keys).

    Keys the file leaves out take transformers' defaults; do_sample false (transformers' default)
    means greedy, i.e. temperature 0. The EOS ids are the file's and config.json's together.
    """
    path = Path(folder) / GENERATION_CONFIG
    return generation_defaults(read_json_object(path) if path.is_file() else {}, config, path)


def generation_defaults(raw: dict[str, Any], config: Qwen3Config, path: Path) -> GenerationDefaults:
    """GenerationDefaults from a generation_config's keys (`path`: where they came from, for errors)."""
    value = {key: default if raw.get(key) is None else raw[key] for key, default in TRANSFORMERS_DEFAULTS.items()}
    try:
        sampling = SamplingParams(
            temperature=float(value["temperature"]) if value["do_sample"] else 0.0,
            top_k=int(value["top_k"]), top_p=float(value["top_p"]), min_p=float(value["min_p"]),
            repetition_penalty=float(value["repetition_penalty"]))
        eos = tuple(dict.fromkeys(int(i) for i in id_list(raw.get("eos_token_id")) + config.eos_token_ids))
    except (TypeError, ValueError, QwenNPError) as bad:
        raise QwenNPError(f"{path}: bad sampling setting or eos_token_id ({bad})") from None
    return GenerationDefaults(sampling, eos)


def read_config(path: str | Path) -> Qwen3Config:
    """The Qwen3Config of a checkpoint folder (config.json), a GGUF file (its metadata) or a hub id."""
    return gguf_file.read_config(path) if is_gguf(path) else load_config(resolve_model_path(path))


def read_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a checkpoint folder, a GGUF file (built from its vocabulary) or a hub id."""
    return gguf_file.read_tokenizer(path) if is_gguf(path) else Tokenizer.from_folder(resolve_model_path(path))


def read_generation_defaults(path: str | Path, config: Qwen3Config) -> GenerationDefaults:
    """Sampling defaults and end ids: generation_config.json, or a GGUF's general.sampling.* keys."""
    if is_gguf(path):
        return generation_defaults(gguf_file.read_sampling(path), config, Path(path))
    return folder_generation_defaults(resolve_model_path(path), config)


def open_checkpoint(path: str | Path) -> Checkpoint:
    """The tensors of a GGUF file, a checkpoint folder or a hub id, validated against their config."""
    if is_gguf(path):
        checkpoint = GGUFCheckpoint(path)
        note = checkpoint.dequantization_note()
        if note:
            print(f"qwen_np: {note}", file=sys.stderr)
        return checkpoint
    folder = resolve_model_path(path)
    return Checkpoint(folder, load_config(folder))
