"""docs/walkthrough.md is exactly what tools/make_walkthrough.py writes today: its code and numbers have not drifted."""

from __future__ import annotations

import difflib
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))

import make_walkthrough  # noqa: E402

REGENERATE = "python tools/make_walkthrough.py"


def test_walkthrough_matches_a_fresh_run_on_the_bundled_model():
    weights = make_walkthrough.BUNDLED_MODEL / "model.safetensors"
    assert weights.exists(), f"{weights} is missing: run python tools/make_bundled_model.py"
    fresh = make_walkthrough.render()
    committed = make_walkthrough.WALKTHROUGH.read_text(encoding="utf-8")
    if fresh != committed:
        diff = difflib.unified_diff(committed.splitlines(keepends=True), fresh.splitlines(keepends=True),
                                    "docs/walkthrough.md (committed)", "docs/walkthrough.md (fresh run)", n=1)
        pytest.fail(f"docs/walkthrough.md has drifted from the code it shows; regenerate it with `{REGENERATE}` "
                    "and commit the result. First differences:\n" + "".join(list(diff)[:60]))


def test_walkthrough_shows_the_code_of_every_step():
    """Every traced step's lines were found in model.py (so no section silently shows nothing)."""
    missing = [step.name for step in make_walkthrough.STEPS if not make_walkthrough.MODEL_CODE.get(step.name)]
    assert not missing
