"""`python -m qwen_np serve`: the OpenAI-compatible HTTP API (qwen_np/serving/), its flags."""

from __future__ import annotations

import argparse
import os
import socket
import sys

from ..core.defaults import (DEFAULT_CONTEXT, DEFAULT_DRAFT_TOKENS, DEFAULT_HOST, DEFAULT_MAX_BATCH, DEFAULT_MAX_TOKENS,
                             DEFAULT_PORT)
from ..errors import QwenNPError
from ..serving.access import API_KEY_ENV
from . import common


def serve_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Serve the model over HTTP with OpenAI's API: /v1/models, /v1/chat/completions, "
                          "/v1/completions, /v1/embeddings; concurrent requests share decode steps (continuous batching).")
    common.add_model(parser)
    parser.add_argument("--host", default=DEFAULT_HOST,
                        help=f"address to listen on (default: {DEFAULT_HOST}, this machine only; 0.0.0.0 opens "
                             "it to the network: set --api-key then)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help=f"TCP port (default: {DEFAULT_PORT}; 0 picks a free one)")
    parser.add_argument("--max-batch", type=common.at_least(1), default=DEFAULT_MAX_BATCH, metavar="N",
                        help=f"requests decoded together in one batch; more wait for a free row "
                             f"(default: {DEFAULT_MAX_BATCH})")
    common.add_context(parser, "context of each request, prompt and reply together")
    parser.add_argument("--default-max-tokens", type=int, default=DEFAULT_MAX_TOKENS, metavar="N",
                        help=f"max_tokens of a request that gives none (default: {DEFAULT_MAX_TOKENS}; or what "
                             "the context has left, if less; -1: always what the context has left)")
    parser.add_argument("--served-model-name", nargs="+", metavar="NAME",
                        help="the name(s) clients ask for in `model` and /v1/models lists; several are aliases, the "
                             "first answers in responses (default: --model as given, else the bundled model's name)")
    parser.add_argument("--lora", action="append", default=[], metavar="NAME=DIR",
                        help="also serve the LoRA adapter in DIR (PEFT's format) under the name NAME, over the same "
                             "base weights (repeatable: several adapters; /v1/models lists them; a request's `model` "
                             "picks one, or the base by its name; rows of different adapters share a batch)")
    common.add_memory(parser)
    parser.add_argument("--kv-memory", metavar="SIZE",
                        help="memory for the KV cache, shared by all requests, e.g. 512MiB or 2GiB; requests wait for "
                             "free blocks, and one that could never fit is refused (default: what RAM has left after "
                             "the weights, with a margin, at most --max-batch full contexts; printed at start)")
    common.add_kv_dtype(parser)
    common.add_speculation(parser)
    common.add_threads(parser)
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), metavar="KEY",
                        help=f"require `Authorization: Bearer KEY` on every request but /health (default: "
                             f"${API_KEY_ENV}, else none)")
    parser.add_argument("--reasoning-format", choices=("parsed", "raw"), default="parsed",
                        help="parsed: a chat reply's <think> part comes apart from its content, as reasoning_content "
                             "and reasoning (streamed deltas too); raw: the reply as generated, tags in the content "
                             "(default: parsed)")
    common.add_quiet(parser, "do not log each request on stderr")
    parser.set_defaults(run=run)


PARSERS = {"serve": serve_parser}      # cli.py builds the command's parser with it


def run(args: argparse.Namespace) -> int:
    """Check the flags, open the socket, then load the model and serve until Ctrl-C (or SIGTERM)."""
    from ..engine.sizes import parse_size  # here, not at the top: --help needs none of it (nor NumPy)
    from ..files.model_files import open_model
    from ..serving import launch
    if not 0 <= args.port <= 65535:
        raise QwenNPError(f"--port: must be in 0..65535, got {args.port}")
    if args.api_key == "":
        raise QwenNPError(f"--api-key: empty (give a key, or unset {API_KEY_ENV} for none)")
    kv_memory = parse_size(args.kv_memory, "kv_memory") if args.kv_memory is not None else None
    if args.default_max_tokens == 0 or args.default_max_tokens < -1:
        raise QwenNPError(f"--default-max-tokens: must be at least 1, or -1 for what the context has left, "
                          f"got {args.default_max_tokens}")
    names = args.served_model_name or [args.model or common.BUNDLED_NAME]
    if any(not name.strip() for name in names) or len(set(names)) < len(names):
        raise QwenNPError(f"--served-model-name: names must be non-empty and distinct, got {names}")
    lora = _lora_flags(args.lora, names)
    # The address first: a port taken is said at once, not after the minutes a big model's files take to read.
    try:
        listener = socket.create_server((args.host, args.port))
    except OSError as error:
        raise QwenNPError(f"--host/--port: cannot listen on {args.host}:{args.port} ({error.strerror})") from None
    with listener:                     # closed however the rest ends (a bad model, Ctrl-C)
        files = open_model(common.model_folder(args.model))
        draft = common.check_speculation(args, files.config, files.tokenizer)
        adapters = [common.read_lora(folder, files.config, name) for name, folder in lora]
        config = launch.ServeConfig(
            names, files, max_batch=args.max_batch, context=args.ctx_size or DEFAULT_CONTEXT, memory=args.memory,
            kv_memory=kv_memory, kv_dtype=args.kv_dtype, api_key=args.api_key, log=not args.quiet,
            split_reasoning=args.reasoning_format == "parsed",
            default_max_tokens=None if args.default_max_tokens == -1 else args.default_max_tokens, draft=draft,
            lookup=args.lookup, draft_tokens=args.draft_tokens or DEFAULT_DRAFT_TOKENS, adapters=adapters)
        launch.serve(config, listener, announce=lambda line: print(line, file=sys.stderr, flush=True))
    return 0


def _lora_flags(flags: list[str], names: list[str]) -> list[tuple[str, str]]:
    """(name, folder) of each --lora NAME=DIR, the names non-empty and distinct from each other and the base's."""
    pairs: list[tuple[str, str]] = []
    for flag in flags:
        name, equals, folder = flag.partition("=")
        if not (equals and name.strip() and folder):
            raise QwenNPError(f"--lora: expected NAME=DIR, got {flag!r}")
        if name in names or name in (seen for seen, _ in pairs):
            raise QwenNPError(f"--lora: the name {name!r} is served already (the base's names: {', '.join(names)})")
        pairs.append((name, folder))
    return pairs
