"""docs/walkthrough.md, its notebook, glossary and figures are exactly what tools/walkthrough/make_walkthrough.py writes
today from weights/: their code, numbers and command outputs have not drifted."""

from __future__ import annotations

import difflib
import json
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import HANG_SECONDS, ROOT

sys.path.insert(0, str(ROOT / "tools" / "walkthrough"))

import make_walkthrough  # noqa: E402
import walkthrough_chapter_finetune  # noqa: E402
import walkthrough_chapter_measured  # noqa: E402
import walkthrough_chapter_train  # noqa: E402
import walkthrough_files  # noqa: E402

pytestmark = pytest.mark.slow      # a fresh run of the walkthrough, its notebook and its recorded training runs

REGENERATE = "python tools/walkthrough/make_walkthrough.py"
DOCS = make_walkthrough.DOCS


@pytest.fixture(scope="module")
def page():
    weights = make_walkthrough.BUNDLED_MODEL / "model.safetensors"
    assert weights.exists(), f"{weights} is missing"
    return make_walkthrough.render_page()


def _same(committed_path, fresh: str) -> None:
    committed = committed_path.read_text(encoding="utf-8")
    if fresh != committed:
        name = committed_path.relative_to(ROOT)
        diff = difflib.unified_diff(committed.splitlines(keepends=True), fresh.splitlines(keepends=True),
                                    f"{name} (committed)", f"{name} (fresh run)", n=1)
        pytest.fail(f"{name} has drifted from the code and weights it shows; regenerate it with `{REGENERATE}` "
                    "and commit the result. First differences:\n" + "".join(list(diff)[:60]))


def test_walkthrough_matches_a_fresh_run_on_the_bundled_model(page):
    _same(make_walkthrough.WALKTHROUGH, page.markdown)


def test_notebook_and_its_outputs_and_the_glossary_match_a_fresh_run(page):
    pytest.importorskip("nbformat", reason="the docs extra (nbformat) is not installed")
    committed = (DOCS / "walkthrough.ipynb").read_text(encoding="utf-8")
    problems = walkthrough_files.notebook_drift(committed, walkthrough_files.notebook_json(page))
    assert not problems, f"docs/walkthrough.ipynb has drifted; regenerate it with `{REGENERATE}`: " + "; ".join(problems)
    _same(DOCS / "glossary.md", walkthrough_files.glossary_markdown(page))


def test_notebook_code_reproduces_the_numbers_on_the_page(page):
    walkthrough_files.check_notebook(page)          # raises naming the expression that differs


def test_figure_data_matches_a_fresh_run_within_rounding(page):
    for name, fresh in walkthrough_files.figure_data(page).items():
        committed = json.loads((DOCS / "figures" / f"{name}.json").read_text(encoding="utf-8"))
        assert (DOCS / "figures" / f"{name}.png").is_file(), f"docs/figures/{name}.png is missing: run {REGENERATE}"
        _assert_close(committed, fresh, f"docs/figures/{name}.json")


def _assert_close(committed, fresh, where: str) -> None:
    if isinstance(fresh, dict):
        assert isinstance(committed, dict) and committed.keys() == fresh.keys(), where
        for key in fresh:
            _assert_close(committed[key], fresh[key], f"{where}[{key!r}]")
    elif isinstance(fresh, list):
        assert isinstance(committed, list) and len(committed) == len(fresh), where
        for i, (a, b) in enumerate(zip(committed, fresh)):
            _assert_close(a, b, f"{where}[{i}]")
    elif isinstance(fresh, float):
        assert np.isclose(committed, fresh, rtol=2e-3, atol=1e-4), f"{where}: {committed} committed, {fresh} now"
    else:
        assert committed == fresh, f"{where}: {committed!r} committed, {fresh!r} now; run {REGENERATE}"


def test_recorded_training_run_repeats_its_first_steps():
    """The chapter's run is recorded (too slow to repeat here): its first steps must still come out of the code."""
    walkthrough_chapter_train.check_first_steps(walkthrough_chapter_train.load_record())   # raises naming the step


def test_recorded_fine_tuning_runs_repeat_the_base_loss_and_their_first_steps():
    """The fine-tuning chapter's runs are recorded (tens of minutes): the base's held-out loss and the first steps of
    the rank-2 LoRA run and the full fine-tune must still come out of their recorded `python -m qwen_np train`
    commands within rtol 1e-3 (the record's 4 digits)."""
    walkthrough_chapter_finetune.check_first_steps(walkthrough_chapter_finetune.load_record())   # raises naming it


def test_fine_tuning_chapter_prints_the_records_figures(page):
    """Every loss, count, time and size the chapter's tables show is the record's, as the page rounds it, and each
    adapter's size is labelled with its rank."""
    chapter = walkthrough_chapter_finetune
    rec = chapter.load_record()
    section = next(s for s in page.sections if s.startswith("## 13. Fine-tune one yourself"))
    held, unread = rec["held_out_chats"], rec["unread_chats"]
    n = len(held)
    for run in (rec["base"], *rec["runs"]):
        assert (f"| {chapter.two(run['held_out']['loss'])} | {chapter.right(run['answers'], held)} of {n} | "
                f"{chapter.right(run['unread_answers'], unread)} of {len(unread)} |") in section
    for run in rec["runs"]:
        assert f"| {run['name']} | {run['trainable']:,} | {run['cpu_s']:,.0f} s | {run['wall_s']:,.0f} s |" in section
        assert run["command"] in section
        if run["rank"] is not None:
            assert f"{sum(run['adapter_bytes'].values()):,} bytes at rank {run['rank']}" in section
    assert f"{rec['seconds']:,.0f} s on {rec['cores']} shared" in section
    assert "![each run's training and held-out loss](figures/finetune_run.png)" in section


def test_recorded_mixed_precision_runs_repeat_their_first_steps():
    """The precision curves are recorded (minutes of training): the first steps of the FP8 run must still come out
    of `train --precision fp8`."""
    walkthrough_chapter_measured.check_precision_steps()          # raises naming the run and its losses


def test_every_figure_draws_from_its_committed_data(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is not installed")
    import matplotlib.pyplot as plt

    for name in walkthrough_files.FIGURES:
        data = json.loads((DOCS / "figures" / f"{name}.json").read_text(encoding="utf-8"))
        fig = walkthrough_files.draw(name, data)
        fig.savefig(tmp_path / f"{name}.png")
        plt.close(fig)
        assert (tmp_path / f"{name}.png").stat().st_size > 10_000


def test_notebook_runs_top_to_bottom_on_the_bundled_model():
    nbformat = pytest.importorskip("nbformat", reason="the docs extra (nbformat, nbclient) is not installed")
    nbclient = pytest.importorskip("nbclient", reason="the docs extra (nbformat, nbclient) is not installed")
    notebook = nbformat.read(DOCS / "walkthrough.ipynb", as_version=4)
    nbclient.NotebookClient(notebook, timeout=HANG_SECONDS, kernel_name="python3",
                            resources={"metadata": {"path": str(DOCS)}}).execute()
    outputs = [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    assert len(outputs) >= len(walkthrough_files.NOTEBOOK_CODE)


def test_walkthrough_shows_the_code_of_every_step():
    """Every traced step's lines were found in model.py (so no section silently shows nothing)."""
    missing = [step.name for step in make_walkthrough.STEPS if not make_walkthrough.MODEL_CODE.get(step.name)]
    assert not missing


@pytest.mark.parametrize("text", ["plain words", "HAMLET:\nTo be, or not to", "it's a \\ back'slash"])
def test_documented_prompts_are_quoted_so_bash_passes_them_unchanged(text):
    quoted = make_walkthrough.shell_quote(text)
    assert subprocess.run(["bash", "-c", f"printf %s {quoted}"], capture_output=True, text=True).stdout == text
