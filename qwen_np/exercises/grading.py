"""Grading a learner's file: load it as a module, call its functions, compare what they return with what
qwen_np computes, and say for each input what was right or what was wrong (expected vs got).

Why a module loaded from its path and not an import by name: the learner's file lies in any folder, under the
name `exercises start` gave it; its folder goes on sys.path while it loads, so the last exercise's file can
import the learner's earlier ones (`from e04_rms_norm import rms_norm`).
"""

from __future__ import annotations

import importlib.util
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import numpy as np

from ..errors import QwenNPError

# Relative and absolute tolerance of a float comparison: FP32 sums in another order differ by ~1e-7
# relative; a wrong formula differs by far more (a missing eps by 1e-3 at least on the inputs drawn here).
RTOL, ATOL = 2e-5, 2e-6


class Wrong(Exception):
    """One input's answer is wrong: the message says which input, what was expected and what came back."""


@dataclass
class Report:
    """What a check found: one line per input that was right, one per input that was wrong."""

    right: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)

    def case(self, what: str, run: Callable[[], str | None]) -> None:
        """Run one graded input: `run` raises Wrong (or anything the learner's code raises) or passes, and may
        return a note on what it found (shown after the input)."""
        try:
            note = run()
        except Wrong as problem:
            self.wrong.append(f"{what}: {problem}")
        except NotImplementedError as problem:
            self.wrong.append(f"{what}: not written yet (NotImplementedError{': ' + str(problem) if str(problem) else ''})")
        except Exception as problem:                   # the learner's code failing is an answer too: a wrong one
            self.wrong.append(f"{what}: raised {type(problem).__name__}: {problem} ({where(problem)})")
        else:
            self.right.append(what + (f": {note}" if note else ""))

    def compare(self, what: str, function: Callable[..., Any], args: tuple[Any, ...], expected: Any,
                note: str | None = None, **tolerance: float) -> None:
        """One input graded: function(*args) (the learner's) must give `expected`: an array (to `tolerance`,
        same_array's), a float (same_number's) or anything else compared exactly."""
        def run() -> str | None:
            got = function(*args)
            if isinstance(expected, np.ndarray):
                same_array(np.asarray(got) if isinstance(got, (list, tuple, np.generic)) else got, expected, **tolerance)
            elif isinstance(expected, float):
                same_number(got, expected, **tolerance)
            else:
                same_value(got, expected)
            return note
        self.case(what, run)

    @property
    def passed(self) -> bool:
        return bool(self.right) and not self.wrong

    def text(self) -> str:
        lines = [f"ok     {line}" for line in self.right] + [f"WRONG  {line}" for line in self.wrong]
        verdict = (f"all {len(self.right)} right" if self.passed
                   else f"{len(self.wrong)} wrong, {len(self.right)} right")
        return "\n".join([*lines, verdict])


def where(problem: BaseException) -> str:
    """The last line of the traceback that is the learner's (or the last line at all): file and line."""
    frames = traceback.extract_tb(problem.__traceback__)
    frame = frames[-1] if frames else None
    return f"{Path(frame.filename).name}:{frame.lineno}" if frame else "?"


def load(path: Path, name: str) -> ModuleType:
    """The learner's file as a module named `name`, its folder on sys.path while it loads (see above)."""
    if not path.is_file():
        raise QwenNPError(f"no such file {str(path)!r}", param="file")
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise QwenNPError(f"{str(path)!r} is not a Python file", param="file")
    module = importlib.util.module_from_spec(spec)
    folder = str(path.resolve().parent)
    before = set(sys.modules)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(folder)
        # The learner's other files it imported are forgotten again: the next check (in one process: a test,
        # a notebook) must read them as they are then, from its own folder, not as cached here.
        for name in set(sys.modules) - before:
            if str(getattr(sys.modules[name], "__file__", "") or "").startswith(folder):
                del sys.modules[name]
    return module


def describe(value: Any) -> str:
    """A value as a line can show it: an array by its shape and first entries, anything else by repr."""
    if isinstance(value, np.ndarray):
        flat = value.reshape(-1)
        head = np.array2string(flat[:4], precision=5, separator=", ")
        return f"array{list(value.shape)} {value.dtype} starting {head}"
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def same_array(got: Any, expected: np.ndarray, rtol: float = RTOL, atol: float = ATOL) -> None:
    """Raise Wrong unless `got` is an array of `expected`'s shape and values (to FP32 rounding)."""
    if not isinstance(got, np.ndarray):
        raise Wrong(f"expected {describe(expected)}, got {describe(got)}")
    if got.shape != expected.shape:
        raise Wrong(f"expected shape {list(expected.shape)}, got shape {list(got.shape)}")
    scale = float(np.abs(expected).max()) if expected.size else 0.0
    error = np.abs(got.astype(np.float64) - expected.astype(np.float64))
    bad = ~(error <= atol * max(scale, 1.0) + rtol * np.abs(expected))       # NaN counts as wrong
    if bad.any():
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        raise Wrong(f"at index {list(index)} expected {float(expected[index]):.6g}, got {float(got[index]):.6g} "
                    f"({int(bad.sum())} of {bad.size} entries differ; largest difference {float(np.nanmax(error)):.3g})")


def same_number(got: Any, expected: float, rtol: float = RTOL) -> None:
    """Raise Wrong unless `got` is a real number equal to `expected` to `rtol`."""
    if isinstance(got, np.ndarray) and got.size == 1:
        got = got.item()
    if isinstance(got, bool) or not isinstance(got, (int, float, np.integer, np.floating)):
        raise Wrong(f"expected the number {expected:.6g}, got {describe(got)}")
    if not abs(float(got) - expected) <= rtol * abs(expected) + 1e-12:
        raise Wrong(f"expected {expected:.6g}, got {float(got):.6g}")


def same_value(got: Any, expected: Any) -> None:
    """Raise Wrong unless `got == expected` (ids, names, merges: things compared exactly)."""
    if got != expected:
        raise Wrong(f"expected {describe(expected)}, got {describe(got)}")


def answer(module: ModuleType) -> Any:
    """The learner's ANSWER; a stub's None (or none at all) is not answered yet, graded as a NotImplementedError."""
    value = getattr(module, "ANSWER", None)
    if value is None:
        raise NotImplementedError("set ANSWER")
    return value
