"""The command line, `python -m qwen_np COMMAND` (also installed as `qwen-np`): the commands and their
one-line summaries (COMMANDS), the parser assembled from qwen_np/commands/ (one module per command:
generate and chat, train, eval, precision, serve, export, download and inspect, hardware, exercises), `main`, and
its one error funnel.

A command's module is imported only when that command runs or shows its help: `qwen-np --help` and
`--version` load no NumPy, and each command loads what its own flags and run need, not the others'.

Bad input of any kind ends with one `error: ...` line on stderr and exit code 2 (a usage error points
at the help of the command it was given to); Ctrl-C stops a run cleanly and exits 130; a closed stdout
(`| head`) exits 1 quietly.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Collection, Sequence
from importlib import import_module
from typing import NoReturn

from . import __version__
from .commands import EXIT_BAD_INPUT, EXIT_INTERRUPTED, error_line
from .errors import QwenNPError

# command -> (the module of qwen_np/commands whose PARSERS builds its flags, its line in `qwen-np --help`)
COMMANDS = {
    "generate": ("generate", "continue one prompt and stream the reply"),
    "chat": ("generate", "multi-turn conversation on stdin/stdout"),
    "train": ("train", "train a Qwen3 from scratch on text, in NumPy"),
    "eval": ("evaluate", "loss per token, perplexity and loss per character of a model on a text"),
    "precision": ("precision", "how far each number format moves the model's predictions from FP32"),
    "serve": ("serve", "an OpenAI-compatible HTTP API (chat, completions, streaming), concurrent requests batched"),
    "export": ("export", "write a model as a GGUF file for llama.cpp, Ollama and LM Studio"),
    "download": ("inspect", "fetch a hub checkpoint into the Hugging Face cache"),
    "inspect": ("inspect", "shapes, parameters and memory of a model (no weights needed)"),
    "hardware": ("hardware", "this machine's cores and caches, and how fast it reads memory"),
    "exercises": ("exercises", "the walkthrough's exercises: list them, start one, check your answer"),
}

class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one `error: ...` line (exit 2) like every other bad input."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"error: {message} (see `{self.prog} --help`)\n")


class CommandParser(Parser):
    """A command's parser: a flag it does not know is its own usage error, which points at its own help
    (argparse would hand it up to the top-level parser, whose help does not list the command's flags)."""

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace or argparse.Namespace())
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


def build_parser(prog: str = "qwen-np", flags_of: Collection[str] | None = None) -> Parser:
    """The parser of every command; with `flags_of`, only those commands' flags are built (and their
    modules imported), the others are listed by name and summary alone: what `main` asks for."""
    parser = Parser(prog=prog, description="The Qwen3 dense decoder in pure NumPy: generate text, chat, train, "
                                           "score, compare number formats, serve an OpenAI API, export GGUF, "
                                           "inspect shapes and the machine.")
    parser.add_argument("--version", action="version", version=f"qwen_np {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=CommandParser)
    for name, (module, summary) in COMMANDS.items():
        command = commands.add_parser(name, help=summary)
        if flags_of is None or name in flags_of:
            import_module(f"{__package__}.commands.{module}").PARSERS[name](command)
    return parser


def main(argv: list[str] | None = None, prog: str = "qwen-np") -> int:
    """Run one command; returns the exit code (0 ok, 2 bad input, 130 interrupted, 1 stdout closed)."""
    argv = sys.argv[1:] if argv is None else argv
    # The command is the first word that is not a flag (the top level's flags take no value).
    command = next((word for word in argv if not word.startswith("-")), None)
    args = build_parser(prog, flags_of=[command] if command else []).parse_args(argv)   # --help exits here
    import numpy as np               # only now: the help and a usage error need none of it

    from .engine import runtime

    try:
        if getattr(args, "threads", None) is not None:
            if args.threads > runtime.usable_cores():
                print(f"warning: --threads {args.threads} is more than the {runtime.usable_cores()} cores this "
                      "process may use; extra threads only wait for a core (and slow the others down)", file=sys.stderr)
            runtime.set_threads(args.threads)
        # Logits that are not finite are stopped and the layer named (finite.py): NumPy's warnings about
        # the NaN and Inf on the way would only add lines, with a source line in them.
        with np.errstate(all="ignore"):
            return args.run(args)
    except QwenNPError as exc:            # the library names its parameter; here it reads as the flag
        return _fail(error_line(exc))
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
