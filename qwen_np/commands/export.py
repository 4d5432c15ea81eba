"""`python -m qwen_np export OUT.gguf`: any model qwen_np loads, written as a GGUF for llama.cpp, Ollama
and LM Studio (gguf_export.write_gguf)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..core.defaults import GGUF_FILE_TYPES
from ..errors import QwenNPError
from . import common


def export_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Write any model qwen_np loads (a checkpoint folder, GGUF file or hub id) as one GGUF file: "
                          "weights in f32/f16/bf16/q8_0/q4_0, the config, tokenizer and chat template llama.cpp reads.")
    parser.add_argument("out", metavar="OUT.gguf", help="the file to write (replaced only once it is complete)")
    common.add_model(parser)
    parser.add_argument("--type", choices=GGUF_FILE_TYPES, default="f16",
                        help="how the matrices are stored: f32, f16, bf16, or llama.cpp's q8_0 (8.5 bits per weight) "
                             "or q4_0 (4.5 bits); norm weights stay f32 (default: f16)")
    parser.set_defaults(run=run)


PARSERS = {"export": export_parser}      # cli.py builds the command's parser with it


def run(args: argparse.Namespace) -> int:
    from ..files.gguf_export import write_gguf        # here, not at the top: --help needs none of it (nor NumPy)
    from ..files.model_files import open_checkpoint, read_generation_defaults, read_tokenizer
    out = Path(args.out)
    if out.is_dir() or not out.parent.is_dir():
        raise QwenNPError(f"OUT.gguf: {out} is a folder or its folder does not exist")
    source = common.model_folder(args.model)
    checkpoint = open_checkpoint(source)
    tokenizer = read_tokenizer(source)
    sampling = read_generation_defaults(source, checkpoint.config).sampling
    # The name llama.cpp shows: the hub id's or folder's last part ('Qwen3-0.6B', not a hub snapshot's hash).
    name = Path(args.model).name.removesuffix(".gguf") if args.model else source.name
    for note in write_gguf(out, checkpoint, tokenizer, sampling, args.type, name=name):
        print(f"note: {note}", file=sys.stderr)
    print(f"wrote {out} ({out.stat().st_size / 2 ** 20:.1f} MiB, {args.type})", file=sys.stderr)
    return 0
