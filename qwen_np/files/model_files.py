"""A model's files, whatever holds them (a checkpoint folder, a GGUF file or a hub id): its config,
tokenizer, generation defaults and tensors. The one place that tells a GGUF file from a folder."""

from __future__ import annotations

import functools
import hashlib
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import gguf_metadata, gguf_tokenizer
from .checkpoint import Checkpoint, is_gguf, resolve_model_path
from ..core.config import Qwen3Config, id_list, load_config, read_json_object
from ..errors import QwenNPError
from .gguf_file import GGUFCheckpoint
from ..core.sampling import SamplingParams
from .tokenizer import Tokenizer

GENERATION_CONFIG = "generation_config.json"
# A checkpoint folder's files that say how to tokenize and generate: what a model written from it keeps.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", GENERATION_CONFIG,
                   "special_tokens_map.json")
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
    (ModelFiles.generation_defaults also reads a GGUF's general.sampling.* keys).

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


class ModelFiles:
    """One model's files, opened once: where they are (`path`: a checkpoint folder or a GGUF file; a hub id
    is fetched into the Hugging Face cache first) and what they say, each read on first use and kept, so
    that whoever holds it never asks "is it a GGUF, where is it, what is its config" again."""

    def __init__(self, source: str | Path, param: str = "model") -> None:
        self.source = str(source)                          # as given: a folder, a GGUF file or a hub id
        self.path = resolve_model_path(source, param)      # `param`: the caller's name for it, in the error
        self.gguf = is_gguf(self.path)                      # by its magic: Ollama's blobs have no suffix

    @functools.cached_property
    def config(self) -> Qwen3Config:
        """config.json, or a GGUF file's metadata."""
        return gguf_metadata.read_config(self.path) if self.gguf else load_config(self.path)

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """The folder's tokenizer files, or one built from a GGUF file's vocabulary."""
        return gguf_tokenizer.read_tokenizer(self.path) if self.gguf else Tokenizer.from_folder(self.path)

    @functools.cached_property
    def generation_defaults(self) -> GenerationDefaults:
        """Sampling defaults and end ids: generation_config.json, or a GGUF's general.sampling.* keys."""
        return self.generation_defaults_for(self.config)

    def generation_defaults_for(self, config: Qwen3Config) -> GenerationDefaults:
        """generation_defaults with the end ids of `config` (a config the caller already holds)."""
        if self.gguf:
            return generation_defaults(gguf_metadata.read_sampling(self.path), config, self.path)
        return folder_generation_defaults(self.path, config)

    def config_json(self) -> dict[str, Any]:
        """config.json as written: the folder's own (every key it holds), or a GGUF's metadata as one."""
        if not self.gguf:
            return read_json_object(self.path / "config.json")
        return {"architectures": [self.config.architecture], "model_type": self.config.model_type, **self.config.to_dict()}

    def weight_files(self) -> list[Path]:
        """The files that hold the weights: the GGUF file, or the folder's *.safetensors in name order."""
        return [self.path] if self.gguf else sorted(self.path.glob("*.safetensors"))

    def weights_sha256(self) -> str:
        """The SHA-256 of weight_files (each name and its bytes, in name order). It reads every byte once
        (about a second a GB)."""
        digest = hashlib.sha256()
        for path in self.weight_files():
            digest.update(path.name.encode() + b"\0")
            with path.open("rb") as f:
                for block in iter(lambda: f.read(1 << 24), b""):
                    digest.update(block)
        return digest.hexdigest()

    def save_tokenizer_files(self, folder: Path) -> None:
        """The tokenizer written beside a checkpoint saved in `folder`: the folder's TOKENIZER_FILES copied
        (those it has), or a GGUF's vocabulary written as tokenizer.json and tokenizer_config.json."""
        if self.gguf:
            self.tokenizer.save(folder)
            return
        for file in TOKENIZER_FILES:
            if (self.path / file).is_file():
                shutil.copyfile(self.path / file, folder / file)

    def checkpoint(self) -> Checkpoint:
        """The tensors, validated against the config (memory-mapped; a new one each call)."""
        if not self.gguf:
            return Checkpoint(self.path, self.config)
        checkpoint = GGUFCheckpoint(self.path)
        note = checkpoint.dequantization_note()
        if note:
            print(f"qwen_np: {note}", file=sys.stderr)
        return checkpoint


def open_model(source: str | Path | ModelFiles, param: str = "model") -> ModelFiles:
    """The ModelFiles of a folder, GGUF file or hub id (one already opened is handed back as it is); `param`:
    the caller's parameter it came from, named in the error (e.g. "draft")."""
    return source if isinstance(source, ModelFiles) else ModelFiles(source, param)


# One question each, for a caller that needs only that one.
def read_config(path: str | Path) -> Qwen3Config:
    return open_model(path).config


def read_tokenizer(path: str | Path) -> Tokenizer:
    return open_model(path).tokenizer


def read_generation_defaults(path: str | Path, config: Qwen3Config) -> GenerationDefaults:
    return open_model(path).generation_defaults_for(config)


def open_checkpoint(path: str | Path) -> Checkpoint:
    return open_model(path).checkpoint()
