"""`python -m qwen_np download` and `inspect`: fetch a checkpoint; describe a model's shapes, parameters and
memory from its config alone."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..files.checkpoint import INDEX_FILE, SINGLE_FILE, Checkpoint, download
from ..core.config import Qwen3Config, preset
from ..files.model_files import read_config
from . import common


def register(commands: argparse._SubParsersAction) -> None:
    fetch = commands.add_parser("download", help="fetch a hub checkpoint into the Hugging Face cache",
                                description="Download a checkpoint's safetensors, json and tokenizer files "
                                            "ahead of time (honours HF_HOME and HF_HUB_OFFLINE).")
    fetch.add_argument("repo_id", help="hub id, e.g. Qwen/Qwen3-0.6B")
    fetch.set_defaults(run=run_download)

    show = commands.add_parser("inspect", help="shapes, parameters and memory of a model (no weights needed)",
                               description="Describe a model's tensors, parameter count and memory from its "
                                           "config.json alone, or from a named preset.")
    source = show.add_mutually_exclusive_group()
    common.add_model(source)
    source.add_argument("--preset", help="a published Qwen3 size, e.g. qwen3-8b")
    show.add_argument("--tokens", type=common.at_least(1), default=7, metavar="T",
                      help="tokens in the example forward pass (default: 7)")
    show.add_argument("--context", type=common.at_least(1), metavar="N",
                      help="sequence length of the memory breakdown: KV cache positions to run, tokens per training "
                           "sequence (default: the model's context, at most 4096)")
    show.add_argument("--batch-size", type=common.at_least(1), default=16, metavar="B",
                      help="sequences per training step in the memory breakdown (default: 16)")
    common.add_json(show, "text")
    show.set_defaults(run=run_inspect)


def run_download(args: argparse.Namespace) -> int:
    print(download(args.repo_id))
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    from ..inspection import inspect_command
    if args.preset:
        config, name = preset(args.preset), args.preset
    else:
        config, name = _config_of(common.model_folder(args.model)), args.model or common.BUNDLED_NAME
    print(inspect_command(config, args.tokens, args.json, name, args.context, args.batch_size))
    return 0


def _config_of(folder: Path) -> Qwen3Config:
    """config.json, checked against the weights' headers when the folder holds weights (inspect needs none,
    but describing a config its own weights contradict would describe another model)."""
    config = read_config(folder)
    if (folder / SINGLE_FILE).is_file() or (folder / INDEX_FILE).is_file():
        Checkpoint(folder, config)
    return config
