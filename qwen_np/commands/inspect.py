"""`python -m qwen_np download` and `inspect`: fetch a checkpoint; describe a model's shapes, parameters and
memory from its config alone."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..core.config import Qwen3Config, preset
from ..core.defaults import DEFAULT_CONTEXT
from . import common


def download_parser(fetch: argparse.ArgumentParser) -> None:
    fetch.description = ("Download a checkpoint's safetensors, json and tokenizer files ahead of time (honours HF_HOME "
                         "and HF_HUB_OFFLINE).")
    fetch.add_argument("repo_id", help="hub id, e.g. Qwen/Qwen3-0.6B")
    fetch.set_defaults(run=run_download)


def inspect_parser(show: argparse.ArgumentParser) -> None:
    show.description = ("Describe a model's tensors, parameter count and memory from its config.json alone, or from a "
                        "named preset.")
    source = show.add_mutually_exclusive_group()
    common.add_model(source)
    source.add_argument("--preset", help="a published Qwen3 size, e.g. qwen3-8b")
    show.add_argument("--tokens", type=common.at_least(1), default=7, metavar="T",
                      help="tokens in the example forward pass (default: 7)")
    common.add_context(show, "sequence length of the memory breakdown and of this machine's memory plan: KV cache "
                             "positions to run, tokens per training sequence", minimum=1,
                       default_text=f"the model's context, at most {DEFAULT_CONTEXT}")
    show.add_argument("--batch-size", type=common.at_least(1), default=16, metavar="N",
                      help="sequences per training step in the memory breakdown (default: 16)")
    show.add_argument("--lora", type=common.at_least(1), metavar="RANK",
                      help="also the memory to train LoRA adapters of this rank on all seven projections "
                           "(train --lora RANK): trainable weights, their AdamW state, the frozen base held each way")
    common.add_json(show, "text")
    show.set_defaults(run=run_inspect)


PARSERS = {"download": download_parser, "inspect": inspect_parser}      # cli.py builds each command's parser with these


def run_download(args: argparse.Namespace) -> int:
    from ..files.checkpoint import download      # here: --help needs none of it (nor NumPy)
    print(download(args.repo_id))
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    from ..inspection.report import inspect_command
    if args.preset:
        config, name, source, weights_file = preset(args.preset), args.preset, "preset", None
    else:
        (config, source, weights_file), name = _config_of(common.model_folder(args.model)), args.model or common.BUNDLED_NAME
    print(inspect_command(config, args.tokens, args.json, name, args.ctx_size, args.batch_size, args.lora, source,
                          weights_file))
    return 0


def _config_of(folder: Path) -> tuple[Qwen3Config, str, dict[str, Any] | None]:
    """(config, where it came from, the file's own weights or None): config.json, checked against the weights'
    headers when the folder holds weights, or a GGUF's metadata, checked against its tensors and their values,
    with its tensors' kinds and bytes (inspect needs no weights, but describing a config its own weights
    contradict would describe another model; a damaged file is refused as a load refuses it)."""
    from ..files.checkpoint import INDEX_FILE, SINGLE_FILE, Checkpoint, is_gguf
    from ..files.model_files import read_config
    if is_gguf(folder):
        from ..files.gguf_file import GGUFCheckpoint
        checkpoint = GGUFCheckpoint(folder)
        return checkpoint.config, "GGUF metadata", checkpoint.file_summary()
    config = read_config(folder)
    if (folder / SINGLE_FILE).is_file() or (folder / INDEX_FILE).is_file():
        Checkpoint(folder, config)
    return config, "config.json", None
