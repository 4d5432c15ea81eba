"""The house's floors: each folder of qwen_np/ says in its __init__.py what it may import (a "May import:" line:
"May import: core/, numbers/, qwen_np.errors."), and every module of the folder keeps to it.

An import counts wherever it is written: at the top, inside a function (the lazy imports that keep `--help`
free of NumPy), under `if TYPE_CHECKING:`, relative (`from ..core import config` is qwen_np.core.config), or as
a module path in a string (the PEP 562 tables that import_module reads). A module may always import its own
folder. The top-level modules keep the rule qwen_np/__init__.py states: errors.py, which every folder imports,
imports nothing of qwen_np; the package's face (__init__.py, __main__.py, cli.py) may import everything.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from tests.conftest import ROOT

PACKAGE = ROOT / "qwen_np"
FOLDERS = sorted(path.parent.name for path in PACKAGE.glob("*/__init__.py"))
TOP_MODULES = sorted(path.stem for path in PACKAGE.glob("*.py"))          # __init__, __main__, cli, errors
# A part of the package: a folder ("core"), a top-level module ("errors", "cli"), or "__init__" (qwen_np itself).
EVERYTHING = frozenset(FOLDERS) | frozenset(TOP_MODULES)
# The top-level modules' rules, from qwen_np/__init__.py's docstring ("commands may import everything, numbers
# nothing of qwen_np but errors"): errors.py is below numbers/; __init__.py (its public names, imported when
# first used), __main__.py and cli.py (which assembles commands/) are above commands/.
TOP_RULES = {"errors": frozenset(), "__init__": EVERYTHING, "__main__": EVERYTHING, "cli": EVERYTHING}
RULE = re.compile(r"May import:(.*?)(?:\.\s|\.$|\n\s*\n)", re.DOTALL)
MODULE_PATH = re.compile(r"qwen_np(\.\w+)+")


@dataclass(frozen=True)
class Import:
    module: str      # the importing file, as qwen_np/numbers/formats.py
    line: int
    target: str      # the absolute module imported, as qwen_np.core.defaults
    written: str     # the import as written (its source line, stripped)

    @property
    def part(self) -> str:
        """The part of the package imported: a folder, a top-level module, or "__init__" (qwen_np itself)."""
        names = self.target.split(".")
        return names[1] if len(names) > 1 else "__init__"


def is_module(dotted: str) -> bool:
    """Whether qwen_np.a.b names a module or a package of this checkout (not a name defined in one)."""
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def module_name(relative: str) -> tuple[str, str]:
    """qwen_np/core/config.py -> ("qwen_np.core.config", "qwen_np.core"): the module and its package."""
    names = list(Path(relative).with_suffix("").parts)
    if names[-1] == "__init__":
        names.pop()
        return ".".join(names), ".".join(names)
    return ".".join(names), ".".join(names[:-1])


def imports_in(source: str, relative: str) -> list[Import]:
    """Every import of qwen_np that `source`, the module at `relative` (qwen_np/core/config.py), makes, wherever
    it is written, resolved to absolute names."""
    lines = source.splitlines()
    _, package = module_name(relative)
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename=relative)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:            # from ..core import x: the package, less one folder per dot beyond the first
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                source_module = ".".join(base + ([node.module] if node.module else []))
            else:
                source_module = node.module or ""
            for alias in node.names:  # from qwen_np import cli imports the module qwen_np.cli
                submodule = f"{source_module}.{alias.name}"
                found.append((node.lineno, submodule if is_module(submodule) else source_module))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_PATH.fullmatch(node.value):
            if is_module(node.value):   # a PEP 562 table's "qwen_np.core.config", imported by import_module
                found.append((node.lineno, node.value))
    return [Import(relative, line, target, lines[line - 1].split("  #")[0].strip())
            for line, target in dict.fromkeys(found)         # one per module a line imports, in order
            if target == "qwen_np" or target.startswith("qwen_np.")]


def imports_of(path: Path) -> list[Import]:
    return imports_in(path.read_text(encoding="utf-8"), path.relative_to(ROOT).as_posix())


@cache
def rule_text(folder: str) -> str | None:
    """The "May import: ..." sentence of qwen_np/FOLDER/__init__.py's docstring, or None."""
    docstring = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text(encoding="utf-8"))) or ""
    found = RULE.search(docstring)
    return " ".join(found.group(0).split()).rstrip() if found else None


def named_parts(text: str) -> frozenset[str]:
    """The parts a rule names: folders as `core/`, top-level modules as `qwen_np.errors`."""
    body = text.split(":", 1)[1]
    return frozenset(re.findall(r"\b(\w+)/", body)) | frozenset(re.findall(r"\bqwen_np\.(\w+)", body))


def allowed(part_of_importer: str) -> frozenset[str]:
    """What a module of this part may import: its own folder and what the rule names."""
    if part_of_importer in TOP_RULES:
        return TOP_RULES[part_of_importer]
    text = rule_text(part_of_importer)
    assert text is not None, f"qwen_np/{part_of_importer}/__init__.py states no 'May import:' rule"
    return named_parts(text) | {part_of_importer}


def importer_part(relative: str) -> str:
    """qwen_np/core/config.py -> "core"; qwen_np/cli.py -> "cli"."""
    names = relative.split("/")
    return names[1] if len(names) > 2 else Path(names[1]).stem


def every_import() -> list[Import]:
    return [found for path in sorted(PACKAGE.rglob("*.py")) for found in imports_of(path)]


def breaches() -> list[Import]:
    return [found for found in every_import() if found.part not in allowed(importer_part(found.module))]


def describe(found: Import) -> str:
    part = importer_part(found.module)
    rule = (f"its folder's rule (qwen_np/{part}/__init__.py): {rule_text(part)!r}" if part in FOLDERS
            else f"the top-level rule for {part}: {', '.join(sorted(TOP_RULES[part])) or 'nothing of qwen_np'}")
    return f"{found.module}:{found.line} imports {found.target} ({found.written!r}), which {rule} does not allow"


def test_every_folder_of_the_package_states_what_it_may_import() -> None:
    assert [folder for folder in FOLDERS if rule_text(folder) is None] == []


def test_each_rule_names_only_folders_and_modules_the_package_has() -> None:
    unknown = {folder: sorted(named_parts(text) - EVERYTHING) for folder in FOLDERS
               if (text := rule_text(folder)) and named_parts(text) - EVERYTHING}
    assert unknown == {}


def test_no_two_folders_may_import_each_other_even_by_way_of_others() -> None:
    """The rules make floors: following "may import" from any folder never comes back to it."""
    may = {folder: allowed(folder) - {folder} for folder in FOLDERS}

    def reachable(start: str) -> set[str]:
        seen: set[str] = set()
        todo = [start]
        while todo:
            for part in may.get(todo.pop(), frozenset()):
                if part not in seen:
                    seen.add(part)
                    todo.append(part)
        return seen

    assert {folder: "imports itself by way of others" for folder in FOLDERS if folder in reachable(folder)} == {}


def test_every_module_imports_only_what_its_folder_may_import() -> None:
    found = [describe(breach) for breach in breaches()]
    assert not found, "imports that break their folder's rule:\n" + "\n".join(found)


@pytest.mark.parametrize("source, expected", [
    ("from ..core import config\n", "qwen_np.core.config"),
    ("from ..core.defaults import FORMATS\n", "qwen_np.core.defaults"),
    ("from .. import errors\n", "qwen_np.errors"),
    ("from .numerics import widen\n", "qwen_np.numbers.numerics"),
    ("from . import formats\n", "qwen_np.numbers.formats"),
    ("import qwen_np.engine.runtime as runtime\n", "qwen_np.engine.runtime"),
    ("def lazily():\n    from qwen_np.files import checkpoint\n", "qwen_np.files.checkpoint"),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..serving.app import app\n", "qwen_np.serving.app"),
    ("TABLE = {'Tracer': 'qwen_np.inspection.trace'}\n", "qwen_np.inspection.trace"),
    ("from qwen_np import __version__\n", "qwen_np"),
])
def test_an_import_counts_however_and_wherever_it_is_written(source: str, expected: str | None) -> None:
    """Each as if written in qwen_np/numbers/probe.py: resolved to the module it imports, at its line."""
    found = imports_in(source, "qwen_np/numbers/probe.py")
    assert [(i.target, i.line) for i in found] == ([(expected, source.count("\n"))] if expected else [])


def test_a_forbidden_import_is_named_with_its_file_line_and_folder_rule() -> None:
    (found,) = imports_in("import numpy\n\n\ndef lazily():\n    from ..engine import runtime\n", "qwen_np/core/probe.py")
    assert found.part not in allowed("core")
    assert describe(found) == ("qwen_np/core/probe.py:5 imports qwen_np.engine.runtime ('from ..engine import runtime'), "
                               f"which its folder's rule (qwen_np/core/__init__.py): {rule_text('core')!r} does not allow")
