"""Library errors name the library's parameter; each front end words it: the CLI with its flag
(qwen_np/commands/__init__.py: FLAGS), the server with its JSON field (serving/requests.FIELDS).

What this protects: no library module writes a command-line flag into an error, every flag the CLI's table
names is a flag some command has, every parameter a library error is about reads as a flag on the command
line, and one error reads as the flag in the CLI and as the field at the server.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from qwen_np.cli import build_parser
from qwen_np.commands import FLAGS, error_line
from qwen_np.core.sampling import SamplingParams
from qwen_np.errors import QwenNPError

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "qwen_np"
# Parameters the command line shows under their own names: no command passes them through as they are
# (generate checks --attention LAYER:HEAD in its own words first), or no flag sets them (vocab_size is the
# model config's field, from --preset or --config; logit_bias and dimensions, of qwen_np.embed, are a
# request's fields, which no flag sets).
OWN_NAMES = {"layer", "head", "vocab_size", "logit_bias", "dimensions"}


def library_errors() -> list[tuple[Path, ast.Call]]:
    """Every QwenNPError(...) raised in the library: qwen_np/ without the command line (commands/, cli.py)."""
    calls = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent.name == "commands" or path.name == "cli.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "QwenNPError":
                calls.append((path, node))
    return calls


# A flag in a message's text: "--resume", not "`python tools/build_tokenizer.py --out DIR`" (a code span,
# removed first: a script's own command line) nor "a--b".
FLAG = re.compile(r"(?<![\w-])--[a-z][\w-]*")
CODE_SPAN = re.compile(r"`[^`]*`")


def message_texts(node: ast.expr, helpers: dict[str, ast.FunctionDef], seen: frozenset[str] = frozenset()
                  ) -> tuple[str, list[str]]:
    """A message expression's text, "{}" for each value it formats, and the texts of the messages it takes
    from helpers of its module (each return of a function it calls, read the same way)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value, []
    if isinstance(node, (ast.JoinedStr, ast.BinOp)):
        parts = [message_texts(value, helpers, seen)
                 for value in (node.values if isinstance(node, ast.JoinedStr) else [node.left, node.right])]
        return "".join(text for text, _ in parts), [text for _, more in parts for text in more]
    if isinstance(node, ast.FormattedValue):
        return message_texts(node.value, helpers, seen)
    if isinstance(node, ast.IfExp):
        return "{}", [text for branch in (node.body, node.orelse) for text in flat(branch, helpers, seen)]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in helpers.keys() - seen:
        returns = [ret.value for ret in ast.walk(helpers[node.func.id]) if isinstance(ret, ast.Return) and ret.value]
        return "{}", [text for value in returns for text in flat(value, helpers, seen | {node.func.id})]
    return "{}", []


def flat(node: ast.expr, helpers: dict[str, ast.FunctionDef], seen: frozenset[str] = frozenset()) -> list[str]:
    text, more = message_texts(node, helpers, seen)
    return [text, *more]


def flags_in_errors(source: str) -> list[tuple[int, str]]:
    """(line, flag) for each command-line flag the QwenNPError messages of a module's source can hold, the
    messages its helpers build included."""
    tree = ast.parse(source)
    helpers = {node.name: node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "QwenNPError" and node.args:
            for text in flat(node.args[0], helpers):
                found += [(node.lineno, flag) for flag in FLAG.findall(CODE_SPAN.sub("", text))]
    return found


@pytest.mark.slow
def test_no_library_error_is_worded_as_a_command_line_flag() -> None:
    """Anywhere in its text, in a message a helper builds too: a parameter the text names again is written
    in backticks (`resume`), which each front end words."""
    flagged = [f"{path.relative_to(ROOT)}:{line}: {flag}" for path in sorted(PACKAGE.rglob("*.py"))
               if path.parent.name != "commands" and path.name != "cli.py"
               for line, flag in flags_in_errors(path.read_text(encoding="utf-8"))]
    assert len(library_errors()) > 100 and flagged == []


def test_the_flag_check_reads_messages_that_helpers_build_and_skips_code_spans() -> None:
    source = ('''def _advice(out):\n    if out:\n        return f"start {out} again without --resume"\n'''
              '''    return "--resume: nothing there"\n'''
              '''def resumed(out):\n    raise QwenNPError(f"{out}: {_advice(out)}", "resume")\n'''
              '''def built(path):\n    raise QwenNPError(f"build it with `python tools/build_tokenizer.py --out {path}`")\n'''
              '''def plain(path):\n    raise QwenNPError(f"{path}: start it again without `resume`", "resume")\n'''
              '''def chosen(ok):\n    raise QwenNPError("fine" if ok else "use --type bf16")\n''')
    assert flags_in_errors(source) == [(6, "--resume"), (6, "--resume"), (12, "--type")]


def test_no_library_function_takes_a_command_line_flag_to_name_in_its_errors() -> None:
    """A library function told where a value came from is told the parameter ("draft"), not the flag."""
    flagged = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent.name == "commands" or path.name == "cli.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.Call)):
                values = (node.args.defaults + node.args.kw_defaults if isinstance(node, ast.FunctionDef)
                          else node.args + [keyword.value for keyword in node.keywords])
                flagged += [f"{path.relative_to(ROOT)}:{node.lineno}" for value in values
                            if isinstance(value, ast.Constant) and isinstance(value.value, str)
                            and value.value.startswith("--") and value.value[2:3].isalpha()]
    assert flagged == []


def test_every_parameter_a_library_error_names_reads_as_a_flag_of_some_command() -> None:
    named = {call.args[1].value for _, call in library_errors()
             if len(call.args) > 1 and isinstance(call.args[1], ast.Constant)}
    assert {"kv_dtype", "num_blocks", "max_batch", "preset", "seed", "memory"} <= named
    assert named - OWN_NAMES <= set(FLAGS), named - OWN_NAMES - set(FLAGS)
    assert not OWN_NAMES & set(FLAGS)
    parser = build_parser()
    options = {option for command in parser._subparsers._group_actions[0].choices.values()      # type: ignore[union-attr]
               for action in command._actions for option in action.option_strings}
    flags = {flag.rstrip(",") for words in FLAGS.values() for flag in words.split() if flag.startswith("--")}
    assert flags <= options, flags - options


def test_one_error_reads_as_its_parameter_the_flag_and_the_field() -> None:
    from qwen_np.serving.requests import api_error

    with pytest.raises(QwenNPError) as caught:
        SamplingParams(top_k=-1)
    problem = caught.value
    assert (str(problem), problem.param) == ("top_k: must be an integer >= 0 (0 = off), got -1", "top_k")
    assert error_line(problem) == "--top-k: must be an integer >= 0 (0 = off), got -1"
    answer = api_error(problem)
    assert (answer.status, answer.message, answer.param) == (400, "top_k: must be an integer >= 0 (0 = off), got -1",
                                                             "top_k")
    renamed = api_error(QwenNPError("must be >= 1, got 0", "max_new_tokens"))
    assert (renamed.message, renamed.param) == ("max_tokens: must be >= 1, got 0", "max_tokens")
    # A parameter no request carries is not passed off as a field.
    assert api_error(QwenNPError("expected one of fp32, bf16, fp16, got 'x'", "kv_dtype")).param is None


def test_a_parameter_named_again_in_the_message_reads_as_the_flag_there_too() -> None:
    problem = QwenNPError("the run has `seed` 0, which a resumed run keeps; drop `seed` (or `nothing_known`)", "seed")
    assert str(problem) == "seed: the run has `seed` 0, which a resumed run keeps; drop `seed` (or `nothing_known`)"
    assert error_line(problem) == "--seed: the run has --seed 0, which a resumed run keeps; drop --seed (or `nothing_known`)"


def test_a_library_function_names_the_parameter_its_caller_gave_the_value_as() -> None:
    from qwen_np.files.model_files import open_model

    for param, flag in (("model", "--model"), ("draft", "--draft")):
        with pytest.raises(QwenNPError) as caught:
            open_model("/no/such/folder", param)
        assert caught.value.param == param and error_line(caught.value).startswith(f"{flag}: '/no/such/folder' does not exist")


def test_an_error_copied_or_pickled_keeps_its_parameter() -> None:
    import copy
    import pickle

    problem = QwenNPError("must be >= 1, got 0", "max_batch")
    for twin in (copy.copy(problem), pickle.loads(pickle.dumps(problem))):
        assert (str(twin), twin.param, error_line(twin)) == (str(problem), "max_batch", "--max-batch: must be >= 1, got 0")


def test_the_command_line_shows_a_library_error_as_its_flag(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "qwen_np", "inspect", "--preset", "no-such-model"],
                            cwd=ROOT, capture_output=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 2
    assert result.stderr.decode().startswith("error: --preset: unknown preset 'no-such-model'; known: "), result.stderr
