"""The command line: `python -m qwen_np generate|chat|download|inspect` (also installed as `qwen-np`).

Generated text goes to stdout, token by token; everything else (notes, the memory plan, traces,
the stats line) goes to stderr. Bad input of any kind ends with one `error: ...` line on stderr and
exit code 2; Ctrl-C stops a run cleanly, still prints its stats line, and exits 130.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NoReturn, TextIO

from . import runtime, serve, trainer
from .checkpoint import download, resolve_model_path
from .config import Qwen3Config, load_config, preset
from .errors import QwenNPError
from .generate import (ChatSession, GenerationDefaults, GenerationStats, context_budget, generate, prompt_ids,
                       read_generation_defaults, resolve_sampling)
from .loading import load_model
from .memory import DEFAULT_CONTEXT, MODES
from .model import Qwen3Model, Trace
from .sampling import SamplingParams
from .tokenizer import THINK_CLOSE, THINK_OPEN, Tokenizer

BUNDLED_MODEL = Path(__file__).resolve().parents[1] / "weights"
BUNDLED_NAME = "weights (bundled, random weights)"
BUNDLED_NOTICE = ("note: using the bundled model in weights/, whose weights are RANDOM, so its text is gibberish; "
                  "for real output pass --model with a hub id (e.g. Qwen/Qwen3-0.6B) or a checkpoint folder")
DEFAULT_MAX_NEW_TOKENS = 512
EXIT_BAD_INPUT, EXIT_INTERRUPTED = 2, 130
SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "seed")


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one `error: ...` line (exit 2) like every other bad input."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"error: {message} (see `{self.prog} --help`)\n")


def build_parser(prog: str = "qwen-np") -> Parser:
    parser = Parser(prog=prog, description="The Qwen3 dense decoder in pure NumPy: generate text, chat, "
                                           "download checkpoints, inspect shapes.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = commands.add_parser("generate", help="continue one prompt and stream the reply",
                              description="Generate a reply to PROMPT (a user message rendered with the "
                                          "checkpoint's chat template, or plain text with --no-chat).")
    gen.add_argument("prompt", help="the user message (with --no-chat: the text to continue)")
    _add_model_flags(gen)
    _add_generation_flags(gen)
    gen.add_argument("--no-chat", action="store_true",
                     help="plain completion: feed PROMPT as is, without the chat template")
    _add_inspection_flags(gen)
    gen.set_defaults(run=run_generate)

    chat = commands.add_parser("chat", help="multi-turn conversation on stdin/stdout",
                               description="Chat turn by turn; the KV cache is kept between turns, so each turn "
                                           "only runs its new tokens. Ctrl-C stops a reply, Ctrl-D ends the chat.")
    _add_model_flags(chat)
    _add_generation_flags(chat)
    chat.add_argument("--ctx-size", type=_at_least(2), metavar="N",
                      help=f"KV cache positions for the whole conversation (default: {DEFAULT_CONTEXT}, "
                           "or the model's context if smaller)")
    chat.set_defaults(run=run_chat)

    train = commands.add_parser("train", help="train a Qwen3 from scratch on text, in NumPy",
                                description="Train a Qwen3 (a preset or a config.json) on Shakespeare or a text "
                                            "file; checkpoints resume bit-exactly; the best model is exported "
                                            "to DIR/model.")
    trainer.add_arguments(train)
    train.set_defaults(run=trainer.run)

    server = commands.add_parser("serve", help="an OpenAI-compatible HTTP API (chat, completions, streaming), "
                                               "concurrent requests batched",
                                  description="Serve the model over HTTP with OpenAI's API: /v1/models, "
                                              "/v1/chat/completions, /v1/completions; concurrent requests share "
                                              "decode steps (continuous batching).")
    serve.add_arguments(server)
    server.set_defaults(run=serve.run)

    fetch = commands.add_parser("download", help="fetch a hub checkpoint into the Hugging Face cache",
                                description="Download a checkpoint's safetensors, json and tokenizer files "
                                            "ahead of time (honours HF_HOME and HF_HUB_OFFLINE).")
    fetch.add_argument("repo_id", help="hub id, e.g. Qwen/Qwen3-0.6B")
    fetch.set_defaults(run=run_download)

    show = commands.add_parser("inspect", help="shapes, parameters and memory of a model (no weights needed)",
                               description="Describe a model's tensors, parameter count and memory from its "
                                           "config.json alone, or from a named preset.")
    source = show.add_mutually_exclusive_group()
    source.add_argument("--model", help="checkpoint folder or hub id (default: the bundled model)")
    source.add_argument("--preset", help="a published Qwen3 size, e.g. qwen3-8b")
    show.add_argument("--tokens", type=_at_least(1), default=7, metavar="T",
                      help="tokens in the example forward pass (default: 7)")
    show.add_argument("--json", action="store_true", help="print JSON instead of text")
    show.set_defaults(run=run_inspect)
    return parser


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="checkpoint folder or Hugging Face hub id, e.g. Qwen/Qwen3-0.6B "
                                        "(default: the bundled random-weight model in weights/)")
    parser.add_argument("--memory", choices=MODES, default="auto",
                        help="the memory plan: fp32 upcasts every weight once at load (fastest), bf16 keeps them "
                             "as stored and upcasts them per use (half the RAM), auto picks fp32 when it fits "
                             "(default: auto)")
    parser.add_argument("--threads", type=_at_least(1), default=runtime.usable_cores(), metavar="N",
                        help=f"threads for the matrix products (default: all {runtime.usable_cores()} cores)")
    parser.add_argument("--verbose", action="store_true",
                        help="print the memory plan and token-level details (prompt and generated ids, cache "
                             "use) on stderr")


def _add_generation_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", "--max-new-tokens", type=_at_least(0), default=DEFAULT_MAX_NEW_TOKENS, metavar="N",
                        help=f"stop after N new tokens (default: {DEFAULT_MAX_NEW_TOKENS}); generation also stops "
                             "at an end-of-sequence token or when the context is full")
    parser.add_argument("--temperature", type=float, metavar="T",
                        help="divide the logits by T before sampling: lower is more predictable, 0 is greedy "
                             "(always the most likely token) (default: generation_config.json; Qwen3: 0.6, "
                             "0.7 with --no-think)")
    parser.add_argument("--top-k", type=int, metavar="K",
                        help="sample only among the K most likely tokens; 0 turns it off "
                             "(default: generation_config.json; Qwen3: 20)")
    parser.add_argument("--top-p", type=float, metavar="P",
                        help="sample only among the fewest most likely tokens whose probabilities add up to P, "
                             "in (0, 1]; 1 turns it off (default: generation_config.json; Qwen3: 0.95, "
                             "0.8 with --no-think)")
    parser.add_argument("--min-p", type=float, metavar="P",
                        help="drop tokens less likely than P times the most likely one, in [0, 1]; 0 turns it off "
                             "(default: generation_config.json, else 0)")
    parser.add_argument("--repetition-penalty", type=float, metavar="R",
                        help="divide the positive logits (multiply the negative ones) of every token already in "
                             "the prompt or the output by R, as transformers does; 1 turns it off "
                             "(default: generation_config.json, else 1)")
    parser.add_argument("--presence-penalty", type=float, metavar="P",
                        help="subtract P from the logit of every token already generated (the prompt does not "
                             "count), as OpenAI and vLLM do; 0 turns it off (default: 0)")
    parser.add_argument("--seed", type=int, metavar="S",
                        help="seed of the sampler: the same seed and flags give the same text (default: random)")
    parser.add_argument("--think", action=argparse.BooleanOptionalAction, default=None,
                        help="let Qwen3 reason in a <think> block before answering, or not (--no-think renders "
                             "the chat template with enable_thinking=false and switches the sampling defaults to "
                             "the model card's non-thinking ones: temperature 0.7, top-p 0.8, top-k 20) "
                             "(default: the template's, which thinks)")
    parser.add_argument("--system", metavar="TEXT", help="a system prompt placed before the first user message")


def _add_inspection_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", action="store_true",
                        help="print every intermediate tensor of the prompt's forward pass and the first decode "
                             "step on stderr (name, shape, statistics)")
    parser.add_argument("--trace-layers", metavar="LIST",
                        help="trace only these decoder layers, comma-separated, e.g. 0,35 (implies --trace)")
    parser.add_argument("--lens", action="store_true",
                        help="logit lens: before generating, print on stderr the tokens each layer's output would "
                             "predict at the prompt's positions")
    parser.add_argument("--attention", metavar="LAYER:HEAD",
                        help="before generating, print on stderr how one attention head attends over the prompt")
    parser.add_argument("--attention-png", metavar="FILE",
                        help="also save the --attention pattern as a PNG image")


def _at_least(minimum: int) -> Callable[[str], int]:
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


# --- Checking flags before anything is loaded ---------------------------------------------------

def _explicit_sampling(args: argparse.Namespace) -> dict[str, float | int | None]:
    """The sampling flags given on the command line (None = not given), validated now, before loading."""
    given = {name: getattr(args, name) for name in SAMPLING_FLAGS}
    SamplingParams(**{name: value for name, value in given.items() if value is not None})
    return given


def _parse_attention(spec: str, config: Qwen3Config) -> tuple[int, int]:
    """`LAYER:HEAD` -> (layer, head), both checked against the model's shape."""
    try:
        layer, head = (int(part) for part in spec.split(":"))
    except ValueError:
        raise QwenNPError(f"--attention: expected LAYER:HEAD, e.g. 0:3, got {spec!r}") from None
    if not (0 <= layer < config.num_hidden_layers and 0 <= head < config.num_attention_heads):
        raise QwenNPError(f"--attention: the model has layers 0..{config.num_hidden_layers - 1} and heads "
                          f"0..{config.num_attention_heads - 1}, got {spec!r}")
    return layer, head


def _parse_layers(spec: str, config: Qwen3Config) -> set[int]:
    """`0,35` -> {0, 35}, each checked against the model's layer count."""
    try:
        layers = {int(part) for part in spec.split(",")}
    except ValueError:
        raise QwenNPError(f"--trace-layers: expected comma-separated layer numbers, e.g. 0,35, got {spec!r}") from None
    bad = sorted(n for n in layers if not 0 <= n < config.num_hidden_layers)
    if bad:
        raise QwenNPError(f"--trace-layers: the model has layers 0..{config.num_hidden_layers - 1}, got {bad[0]}")
    return layers


# --- Opening a checkpoint ----------------------------------------------------------------------

@dataclass
class Opened:
    """A checkpoint's small files, read before any weight is: enough to check every input."""

    name: str
    folder: Path
    config: Qwen3Config
    defaults: GenerationDefaults
    tokenizer: Tokenizer
    bundled: bool          # the random-weight model in weights/, which the user must be told about


def _model_folder(model: str | None) -> Path:
    """The checkpoint folder of --model (fetched from the hub if need be), or the bundled one."""
    if model is not None:
        return resolve_model_path(model)
    if not (BUNDLED_MODEL / "config.json").is_file():
        raise QwenNPError(f"--model: not given, and the bundled model is not at {BUNDLED_MODEL} (run from a "
                          "checkout of the repository, or pass a hub id like Qwen/Qwen3-0.6B or a checkpoint folder)")
    return BUNDLED_MODEL


def _open_checkpoint(model: str | None) -> Opened:
    folder = _model_folder(model)
    bundled = folder.resolve() == BUNDLED_MODEL.resolve()
    config = load_config(folder)
    return Opened(BUNDLED_NAME if bundled else model or str(folder), folder, config,
                  read_generation_defaults(folder, config), Tokenizer.from_folder(folder), bundled)


def _load_weights(opened: Opened, args: argparse.Namespace, max_tokens: int) -> Qwen3Model:
    """Load the weights, once every input has been checked (so a bad input is the only line printed)."""
    if opened.bundled:
        print(BUNDLED_NOTICE, file=sys.stderr)
    model = load_model(opened.folder, memory=args.memory, max_tokens=max_tokens)
    if args.verbose and model.plan is not None:
        print(model.plan.describe(), file=sys.stderr)
    return model


# --- Writing the reply -------------------------------------------------------------------------

class ReplyWriter:
    """Streams reply text to stdout as it arrives; on a terminal the <think> part is shown dimmed.

    <think> and </think> are single tokens, so a text delta never holds half a tag.
    """

    DIM, RESET = "\x1b[2m", "\x1b[0m"

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.styled = stream.isatty() and "NO_COLOR" not in os.environ
        self.thinking = False
        self.wrote = False

    def write(self, text: str) -> None:
        if self.styled:
            text = text.replace(THINK_OPEN, self.DIM + THINK_OPEN).replace(THINK_CLOSE, THINK_CLOSE + self.RESET)
            self.thinking = (self.thinking or THINK_OPEN in text) and THINK_CLOSE not in text
        self.stream.write(text)
        self.stream.flush()
        self.wrote = self.wrote or bool(text)

    def end(self) -> None:
        """Finish the reply: undo the style of an unfinished think block and end the line."""
        if self.thinking:
            self.stream.write(self.RESET)
        if self.wrote:
            self.stream.write("\n")
        self.stream.flush()
        self.thinking = self.wrote = False


# --- Commands ----------------------------------------------------------------------------------

def run_generate(args: argparse.Namespace) -> int:
    explicit = _explicit_sampling(args)
    if args.attention_png and not args.attention:
        raise QwenNPError("--attention-png: needs --attention LAYER:HEAD to say which head to draw")
    stats, name, writer = GenerationStats(), args.model or BUNDLED_NAME, ReplyWriter(sys.stdout)
    generated: list[int] = []
    try:
        started = time.perf_counter()
        opened = _open_checkpoint(args.model)
        name = opened.name
        params = resolve_sampling(opened.defaults, args.think, **explicit)
        ids = prompt_ids(opened.tokenizer, args.prompt, chat=not args.no_chat, enable_thinking=args.think,
                         system=args.system)
        budget = context_budget(opened.config, len(ids), args.max_new_tokens)
        trace = _tracer(args, opened.config)
        attention = _parse_attention(args.attention, opened.config) if args.attention else None
        model = _load_weights(opened, args, budget)
        stats.load_seconds = time.perf_counter() - started
        if args.verbose:
            print(f"prompt ids: {ids}", file=sys.stderr)
        _show_inspections(args, model, ids, opened.tokenizer, attention)
        for event in generate(model, opened.tokenizer, ids, params, args.max_new_tokens,
                              eos_token_ids=opened.defaults.eos_token_ids, trace=trace, stats=stats):
            generated.append(event.token_id)
            writer.write(event.text)
    except KeyboardInterrupt:
        stats.finish_reason = "interrupted"
    writer.end()
    if args.verbose:
        print(f"generated ids: {generated}", file=sys.stderr)
    print(stats.summary(name), file=sys.stderr)
    return EXIT_INTERRUPTED if stats.finish_reason == "interrupted" else 0


def _tracer(args: argparse.Namespace, config: Qwen3Config) -> Trace | None:
    if not (args.trace or args.trace_layers):
        return None
    from .inspection import Tracer   # the debugging tools load only when asked for
    return Tracer(stream=sys.stderr, layers=_parse_layers(args.trace_layers, config) if args.trace_layers else None)


def _show_inspections(args: argparse.Namespace, model: Qwen3Model, ids: list[int], tokenizer: Tokenizer,
                      attention: tuple[int, int] | None) -> None:
    """The views of the prompt asked for with --lens / --attention, on stderr before generating."""
    if not (args.lens or attention):
        return
    from . import inspection
    if args.lens:
        print(inspection.logit_lens(model, ids, tokenizer), file=sys.stderr)
    if attention:
        print(inspection.attention_view(model, ids, tokenizer, *attention, png_path=args.attention_png),
              file=sys.stderr)


def run_chat(args: argparse.Namespace) -> int:
    explicit = _explicit_sampling(args)
    started = time.perf_counter()
    try:
        opened = _open_checkpoint(args.model)
        context = min(args.ctx_size or DEFAULT_CONTEXT, opened.config.max_position_embeddings)
        session = ChatSession(_load_weights(opened, args, context), opened.tokenizer,
                              resolve_sampling(opened.defaults, args.think, **explicit),
                              eos_token_ids=opened.defaults.eos_token_ids, system=args.system,
                              enable_thinking=args.think, max_tokens=context)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    load_seconds = time.perf_counter() - started
    print("chat: type a message and press Enter; Ctrl-C stops a reply, Ctrl-D ends the chat", file=sys.stderr)
    writer = ReplyWriter(sys.stdout)
    while True:
        try:
            line = input("> " if sys.stdin.isatty() else "")
        except EOFError:
            return 0
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return EXIT_INTERRUPTED
        if not line.strip():
            continue
        stats = GenerationStats(load_seconds=load_seconds)
        load_seconds = 0.0          # reported once, with the first turn
        try:
            for event in session.send(line, args.max_new_tokens, stats):
                writer.write(event.text)
        except KeyboardInterrupt:
            stats.finish_reason = "interrupted"
        except QwenNPError as problem:      # e.g. the conversation outgrew --ctx-size: say so, keep chatting
            writer.end()
            print(f"error: {problem}", file=sys.stderr)
            continue
        writer.end()
        if args.verbose:
            print(f"cache: {session.cache.length} positions after this turn", file=sys.stderr)
        print(stats.summary(opened.name), file=sys.stderr)


def run_download(args: argparse.Namespace) -> int:
    print(download(args.repo_id))
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    from .inspection import inspect_command
    if args.preset:
        config, name = preset(args.preset), args.preset
    else:
        config, name = load_config(_model_folder(args.model)), args.model or BUNDLED_NAME
    print(inspect_command(config, args.tokens, args.json, name))
    return 0


def main(argv: list[str] | None = None, prog: str = "qwen-np") -> int:
    """Run one command; returns the exit code (0 ok, 2 bad input, 130 interrupted, 1 stdout closed)."""
    args = build_parser(prog).parse_args(argv)
    try:
        if hasattr(args, "threads"):
            runtime.set_threads(args.threads)
        return args.run(args)
    except QwenNPError as exc:
        return _fail(str(exc))
    except BrokenPipeError:   # the reader left (e.g. `| head`): nothing to report, nothing more to write
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # so the exit-time flush is silent
        return 1
    except OSError as exc:    # unreadable files and the like: name the file, skip the traceback
        return _fail(f"{exc.filename}: {exc.strerror}" if exc.filename else str(exc))
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def _fail(message: str) -> int:
    print("error: " + " ".join(message.splitlines()), file=sys.stderr)
    return EXIT_BAD_INPUT
