"""The command line, `python -m qwen_np COMMAND` (also installed as `qwen-np`): the parser assembled from
qwen_np/commands/ (one module per command: generate and chat, train, eval, precision, serve, export,
download and inspect, hardware), `main`, and its one error funnel.

Bad input of any kind ends with one `error: ...` line on stderr and exit code 2; Ctrl-C stops a run
cleanly and exits 130; a closed stdout (`| head`) exits 1 quietly.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

import numpy as np

from . import __version__
from .engine import runtime
from .commands import evaluate, export, generate, hardware, inspect, precision, serve, train
from .commands.common import EXIT_BAD_INPUT, EXIT_INTERRUPTED, error_line
from .errors import QwenNPError


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one `error: ...` line (exit 2) like every other bad input."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"error: {message} (see `{self.prog} --help`)\n")


def build_parser(prog: str = "qwen-np") -> Parser:
    parser = Parser(prog=prog, description="The Qwen3 dense decoder in pure NumPy: generate text, chat, train, "
                                           "score, compare number formats, serve an OpenAI API, export GGUF, "
                                           "inspect shapes and the machine.")
    parser.add_argument("--version", action="version", version=f"qwen_np {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    for command in (generate, train, evaluate, precision, serve, export, inspect, hardware):
        command.register(commands)
    return parser


def main(argv: list[str] | None = None, prog: str = "qwen-np") -> int:
    """Run one command; returns the exit code (0 ok, 2 bad input, 130 interrupted, 1 stdout closed)."""
    args = build_parser(prog).parse_args(argv)
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
