"""`python -m qwen_np exercises`: the walkthrough's graded exercises. Alone it lists them; `start N` writes
exercise N's stub into the current folder; `check N [FILE]` grades a file (by default the one `start N`
wrote here), exit 0 when every input is right, 1 when one is wrong (each named, expected vs got);
`check N --solution` grades the reference solution. A bad N or a missing file: one line, exit 2."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import QwenNPError

EXIT_WRONG = 1        # an answer is wrong: not bad input (2), the learner's file was read and graded


def exercises_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = ("The walkthrough's exercises, graded: list them, write one's stub here (start N), grade "
                          "your file (check N [FILE]) or the reference solution (check N --solution).")
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    start = actions.add_parser("start", help="write exercise N's stub into the current folder")
    start.add_argument("number", type=int, metavar="N")
    start.add_argument("--force", action="store_true", help="overwrite the file if it is there")
    check = actions.add_parser("check", help="grade exercise N: your file, or the reference solution")
    check.add_argument("number", type=int, metavar="N")
    check.add_argument("file", nargs="?", type=Path, metavar="FILE",
                       help="the file to grade (default: the one `start N` wrote in the current folder)")
    check.add_argument("--solution", action="store_true", help="grade the reference solution instead")
    check.add_argument("--model", default=None, metavar="DIR_OR_ID",
                       help="where exercise 1 finds Qwen3's tokenizer and chat template (default: Qwen/Qwen3-0.6B)")
    parser.set_defaults(run=run)


PARSERS = {"exercises": exercises_parser}      # cli.py builds the command's parser with it


def run(args: argparse.Namespace) -> int:
    from ..exercises import catalog

    if args.action is None:
        for entry in catalog.EXERCISES:
            print(f"{entry.number:>3}  §{entry.section:<5} {entry.line}")
        print("\n`exercises start N` writes one into this folder; `exercises check N` grades it.")
        return 0
    entry = catalog.exercise(args.number)
    if args.action == "start":
        target = Path.cwd() / entry.file_name
        if target.exists() and not args.force:
            raise QwenNPError(f"{target} is already there (your work?): --force overwrites it")
        target.write_text(catalog.stub(entry.number), encoding="utf-8")
        print(f"wrote {target}: exercise {entry.number} ({entry.line}); fill it in, then "
              f"`python -m qwen_np exercises check {entry.number}`")
        return 0
    from ..exercises.checks import Setting

    if args.solution and args.file is not None:
        raise QwenNPError("--solution: give a FILE or --solution, not both")
    path = None if args.solution else (args.file or Path.cwd() / entry.file_name)
    if path is not None and not path.is_file():
        hint = "" if args.file else f" (`python -m qwen_np exercises start {entry.number}` writes it)"
        raise QwenNPError(f"no such file {str(path)!r}{hint}", param="file")
    report = catalog.grade(entry.number, path, Setting(**({"tokenizer": args.model} if args.model else {})))
    print(f"exercise {entry.number}: {entry.line} ({'the reference solution' if path is None else path})")
    print(report.text())
    sys.stdout.flush()
    return 0 if report.passed else EXIT_WRONG
