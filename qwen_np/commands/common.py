"""What every command shares: one definition of each common flag (the same name, letter, default and help
wherever it appears), and which model --model means when it is not given (the bundled one).

Light at the top: a command's --help builds these flags and imports nothing heavy (the values they show
come from core.defaults); what runs a model is imported by the functions that run it.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..core.config import Qwen3Config
from ..core.defaults import BUNDLED, DEFAULT_CONTEXT, DEFAULT_DRAFT_TOKENS, KV_DTYPES, MODES, usable_cores
from ..errors import QwenNPError

if TYPE_CHECKING:
    from ..core.adapters import Adapter
    from ..files.model_files import ModelFiles
    from ..files.tokenizer import Tokenizer
    from ..generation.speculative import Speculation

BUNDLED_NAME = BUNDLED        # what the bundled model is called where it is served and in stats lines
# `--draft bundled`: the bundled model's own draft (bundled_model_path()/draft) from any folder, as `--model bundled`
# (its default) is the bundled model from any folder. No hub id is a bare word; a folder named so is ./bundled.
BUNDLED_DRAFT = BUNDLED
MEMORY_HELP = ("how to hold the weights: fp32 upcasts every weight once at load (fastest), bf16 (or stored) keeps them "
               "as stored (a GGUF's quantized blocks too) and widens them per use (half the RAM), int8 quantizes every "
               "matrix to int8 rows at load (a quarter, slightly different logits), q8_0 and q4_0 to llama.cpp's "
               "blocks of 32 (8.5 and 4.5 bits a weight), "
               "auto picks fp32 when it fits (default: auto)")


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= minimum (argparse names the flag in its error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def add_model(parser: argparse.ArgumentParser | argparse._MutuallyExclusiveGroup) -> None:
    parser.add_argument("-m", "--model", help="checkpoint folder, GGUF file or Hugging Face hub id, e.g. "
                                              "Qwen/Qwen3-0.6B (default: the bundled model, a tiny Qwen3 trained on "
                                              "Shakespeare)")


def add_lora(parser: argparse.ArgumentParser) -> None:
    """--lora DIR: an adapter to run the model through (generate, chat, eval; serve takes NAME=DIR, several)."""
    parser.add_argument("--lora", metavar="DIR",
                        help="apply the LoRA adapter in DIR (PEFT's format: adapter_config.json and "
                             "adapter_model.safetensors, as `train --lora` and peft write it) without merging it: "
                             "the model's weights stay as --memory holds them, the adapter's products are added")


def add_memory(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--memory", choices=MODES, default="auto", metavar="MODE", help=MEMORY_HELP)


def add_kv_dtype(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-dtype", choices=tuple(KV_DTYPES), default="fp32",
                        help="how the KV cache stores keys and values: fp32 as computed, bf16 or fp16 in half the memory "
                             "(rounded once when stored), int8 in about a quarter (codes with an FP32 scale per "
                             "position and head); attention still runs in FP32 (default: fp32)")


def add_threads(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-t", "--threads", type=at_least(1), default=usable_cores(), metavar="N",
                        help=f"threads for the matrix products, at most (fewer while other processes keep the cores "
                             f"busy; default: all {usable_cores()} cores)")


def add_context(parser: argparse.ArgumentParser, what: str, minimum: int = 2, default: int | None = None,
                default_text: str = f"{DEFAULT_CONTEXT}, or the model's if smaller") -> None:
    """-c/--ctx-size N, also spelt --context: every command's one flag for how many tokens a run holds at
    once (llama.cpp's spelling, and the one train, eval and inspect had); its value is args.ctx_size."""
    parser.add_argument("-c", "--ctx-size", "--context", dest="ctx_size", type=at_least(minimum), default=default,
                        metavar="N", help=f"{what} (default: {default_text})")


def add_speculation(parser: argparse.ArgumentParser) -> None:
    """--draft MODEL | --lookup N, and --draft-tokens K: speculative decoding (qwen_np/generation/speculative.py)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--draft", metavar="MODEL",
                       help="speculative decoding: a smaller Qwen3 with the same tokenizer (folder, GGUF or hub id, e.g. "
                            "Qwen/Qwen3-0.6B for Qwen3-8B; `bundled`: the bundled model's own tiny draft) drafts "
                            "--draft-tokens tokens, the model checks them in one forward pass; the output is the same "
                            "(greedy: the same tokens; sampled: the same distribution)")
    group.add_argument("--lookup", type=at_least(1), metavar="N",
                       help="speculative decoding without a second model: draft the tokens that followed the last "
                            "N (down to 1) tokens where they occur earlier in the prompt or reply (prompt lookup)")
    parser.add_argument("--draft-tokens", type=at_least(1), metavar="K",
                        help=f"tokens drafted per step with --draft or --lookup (default: {DEFAULT_DRAFT_TOKENS})")


def check_speculation(args: argparse.Namespace, config: Qwen3Config, tokenizer: Tokenizer) -> ModelFiles | None:
    """The --draft checkpoint's files (fetched if need be), checked against the model's config and tokenizer;
    None without --draft. Called before the model's weights load; what it read is kept in the ModelFiles."""
    if args.draft_tokens is not None and args.draft is None and args.lookup is None:
        raise QwenNPError("--draft-tokens: drafts only with --draft MODEL or --lookup N")
    if args.draft is None:
        return None
    from ..files.model_files import open_model
    from ..generation.speculative import check_draft_folder
    draft = open_model(draft_folder(args.draft), "draft")
    check_draft_folder(draft, config, tokenizer)
    return draft


def draft_folder(draft: str) -> Path:
    """The checkpoint of --draft: the bundled draft (BUNDLED_DRAFT), or a folder, GGUF file or hub id."""
    from ..files.checkpoint import bundled_model_path, resolve_model_path
    if draft != BUNDLED_DRAFT:
        return resolve_model_path(draft, "draft")
    folder = bundled_model_path() / "draft"
    if not (folder / "config.json").is_file():
        raise QwenNPError(f"--draft {BUNDLED_DRAFT}: the bundled draft is not at {folder} (reinstall qwen_np, or pass "
                          "a checkpoint folder)")
    return folder


def speculation(args: argparse.Namespace, draft: ModelFiles | None, max_tokens: int) -> Speculation | None:
    """The speculation --draft (its checkpoint `draft`, loaded now; its cache stores --kv-dtype like the
    model's) or --lookup asks for, or None."""
    from ..engine.paged import OwnPoolCache
    from ..generation.speculative import draft_speculation, load_draft, lookup_speculation
    tokens = args.draft_tokens or DEFAULT_DRAFT_TOKENS
    if draft is not None:
        model = load_draft(draft, memory=args.memory, max_tokens=max_tokens + tokens)
        return draft_speculation(model, tokens, lambda positions: OwnPoolCache(model.config, positions, args.kv_dtype))
    return lookup_speculation(args.lookup, tokens) if args.lookup is not None else None


def read_lora(folder: str, config: Qwen3Config, name: str | None = None) -> Adapter:
    """The LoRA adapter --lora names (files.adapter.read_adapter), checked for a model of `config`; a path that
    is no folder is said to be one before its files are looked for (a GGUF adapter is a single file)."""
    from ..files.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, read_adapter
    path = Path(folder).expanduser()
    if not path.is_dir():
        what = "is a file, not a folder" if path.exists() else "does not exist"
        raise QwenNPError(f"--lora: {folder} {what}: a LoRA adapter is a folder holding {ADAPTER_CONFIG} and "
                          f"{ADAPTER_WEIGHTS} (PEFT's format; GGUF adapters are not read)")
    return read_adapter(path, config, name)


def add_json(parser: argparse.ArgumentParser, what: str = "the table") -> None:
    parser.add_argument("--json", action="store_true", help=f"print JSON instead of {what}")


def add_quiet(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("-q", "--quiet", action="store_true", help=what)


def model_folder(model: str | None) -> Path:
    """The checkpoint folder of --model (fetched from the hub if need be); not given, the bundled one."""
    from ..files.checkpoint import resolve_model_path
    return resolve_model_path(BUNDLED if model is None else model)


def is_bundled(folder: Path) -> bool:
    from ..files.checkpoint import bundled_model_path
    return folder.resolve() == bundled_model_path().resolve()
