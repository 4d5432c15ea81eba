"""The graded exercises (`python -m qwen_np exercises`, qwen_np/exercises/): a check the learner can fail.

Every stub as `start` writes it fails its check, every reference solution passes, and for each exercise a
plausible wrong answer (an off-by-one, the wrong axis, a missing scale or mask, a count that forgets a
factor) fails: each is the solution with one slip planted (WRONG). The build-it-yourself track's last
exercise is graded on the learner's own files beside it. The CLI's list, start and check round trip runs in a
temporary folder, with its exit codes: 0 right, 1 wrong, 2 bad input.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import QWEN3_RANDOM, ROOT
from qwen_np.cli import main
from qwen_np.exercises import catalog
from qwen_np.exercises.checks import Setting
from qwen_np.exercises.grading import Report

SETTING = Setting(tokenizer=str(QWEN3_RANDOM))      # exercise 1's Qwen3 chat template, offline
NUMBERS = [entry.number for entry in catalog.EXERCISES]
# Checks that load the bundled model, a tokenizer, or train twelve runs: over a second.
SLOW = {"e01_chat_tokens", "e09_logit_lens", "e10_minus_log_p", "e18_divergence"}
PAGE = (ROOT / "docs" / "walkthrough.md").read_text(encoding="utf-8")

# For each exercise, slips a learner plausibly makes: (the solution's text, what the slip writes instead).
WRONG: dict[str, list[tuple[str, str]]] = {
    "e01_chat_tokens": [("tokenizer.encode(text)", "tokenizer.encode(message)")],                 # the frame left out
    "e02_bpe_merges": [("+= word_counts[word]", "+= 1"),                                          # counts ignored
                       ("-order[p[0]], -order[p[1]]", "order[p[0]], order[p[1]]")],                # ties the other way
    "e03_embedding_backward": [("np.add.at(d_table, ids, d_out)", "d_table[ids] += d_out")],      # repeats lost
    "e04_rms_norm": [("axis=-1", "axis=0"), (" + np.float32(eps)", "")],                         # wrong axis, no eps
    "e05_gqa_heads": [("np.repeat(k, heads // k.shape[-2], axis=-2)", "np.tile(k, (1, heads // k.shape[-2], 1))")],
    "e06_rope": [("positions.astype(np.float64)[:, None]", "(positions.astype(np.float64) + 1)[:, None]"),  # off by one
                 ("* 2 / x.shape[-1]", "/ x.shape[-1]")],                                     # frequencies of Dh, not Dh/2
    "e07_attention": [(" / np.sqrt(np.float32(Dh))", ""), ("[None, :] > q_positions", "[None, :] >= q_positions"),
                      ("scores = np.where(future, -np.inf, scores)", "scores = scores")],      # no scale, mask, no mask
    "e08_swiglu": [("(gate / (1 + np.exp(-gate)) * up)", "(up / (1 + np.exp(-up)) * gate)")],   # silu on the wrong half
    "e09_logit_lens": [("return normed @ lm_head.T", "return stream @ lm_head.T")],             # the final norm skipped
    "e10_minus_log_p": [(" - logits.max()", "")],                                                # exp(900) overflows
    "e11_cross_entropy": [("d_logits / targets.size", "d_logits")],                               # the mean's 1/N left out
    "e12_kv_cache_bytes": [("num_key_value_heads", "num_attention_heads"), ("return 2 * ", "return ")],   # H; K or V only
    "e13_bf16_rounding": [("(bits + 0x7FFF + kept_lowest)", "bits"), ("+ kept_lowest", "+ 1")],  # truncation; ties up
    "e14_decode_bound": [("unread = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size",
                          "unread = 0")],                                                         # the table counted
    "e15_rms_norm_backward": [("dx = r * g - x_hat * r * np.mean(g * x_hat, axis=-1, keepdims=True)", "dx = r * g")],
    "e16_memory_remedy": [('"grad_accum_4"', '"bf16_activations"'), ('"grad_accum_4"', '"quarter_batch"'),
                          ('"grad_accum_4"', '"all_three"')],
    "e17_flash_attention": [("rescale = np.exp(m - shift)", "rescale = 1.0")],                   # old sums not rescaled
    "e18_divergence": [("ANSWER = 1.0", "ANSWER = 0.3")],
    "e19_layer_parameters": [("(2 * Dh if config.use_qk_norm else 0)", "2 * Dh"), ("2 * KVH * Dh * D", "2 * H * Dh * D")],
    "e20_lora": [("(alpha / a.shape[0]) * ((x", "alpha * ((x")],                                 # alpha, not alpha / r
    "e21_speculative": [("return rest / total if total > 0 else p", "return rest if total > 0 else p"),
                        ("min(1.0, p[x] / q[x])", "p[x] / q[x]")],                              # unnormalised; unclipped
    "e22_pass_at_k": [("if n - c < k:", "if n - c <= k:"),                                     # exactly k wrong: 1
                      ("1.0 - k / i", "1.0 - 1 / i")],                                       # k left out of the ratio
    "e23_decoder_layer": [("q = rms_norm((h @ layer.q_proj.T).reshape(-1, H, Dh), layer.q_norm, eps)",
                           "q = (h @ layer.q_proj.T).reshape(-1, H, Dh)"),                       # q_norm left out
                          ("return x + swiglu(", "return swiglu(")],                              # no second residual
}


def marked(numbers: list[int]) -> list[object]:
    return [pytest.param(n, id=catalog.exercise(n).module,
                         marks=[pytest.mark.slow] if catalog.exercise(n).module in SLOW else []) for n in numbers]


def grade(number: int, source: str, folder: Path) -> Report:
    """The check of `number` on `source` written into `folder` under the name `start` gives it; the build track's
    pieces that the last exercise imports are the reference solutions, as learner's files beside it."""
    entry = catalog.exercise(number)
    for piece in ("e04_rms_norm", "e06_rope", "e07_attention", "e08_swiglu"):
        if not (folder / f"{piece}.py").exists():
            (folder / f"{piece}.py").write_text((catalog.EXERCISES[int(piece[1:3]) - 1]).solution_source())
    path = folder / entry.file_name
    path.write_text(source.replace(f"from {catalog.SOLUTIONS}.", "from "), encoding="utf-8")
    return catalog.grade(number, path, SETTING)


def test_at_least_twenty_exercises_cover_every_section_of_the_walkthrough() -> None:
    sections = {m[1] for m in re.finditer(r"^## (\d+)\. ", PAGE, re.MULTILINE)}
    assert len(catalog.EXERCISES) >= 20 and NUMBERS == list(range(1, len(NUMBERS) + 1))
    assert sections and sections <= {entry.section.split(".")[0] for entry in catalog.EXERCISES}
    assert set(WRONG) == {entry.module for entry in catalog.EXERCISES}


@pytest.mark.parametrize("number", marked(NUMBERS))
def test_the_reference_solution_passes_and_the_unmodified_stub_fails(number: int, tmp_path: Path) -> None:
    assert catalog.grade(number, None, SETTING).passed, catalog.grade(number, None, SETTING).text()
    report = grade(number, catalog.stub(number), tmp_path)
    assert not report.passed and "not written yet" in report.text()


@pytest.mark.parametrize("number", marked(NUMBERS))
def test_each_plausible_wrong_answer_fails_naming_its_input(number: int, tmp_path: Path) -> None:
    entry = catalog.exercise(number)
    source = entry.solution_source()
    for right, wrong in WRONG[entry.module]:
        assert right in source, f"{entry.module}: the plant {right!r} is not in the solution"
        report = grade(number, source.replace(right, wrong), tmp_path)
        assert not report.passed, f"{entry.module} with {wrong!r} for {right!r} passed:\n{report.text()}"
        assert "WRONG" in report.text()


def test_a_wrong_piece_of_the_learner_s_own_fails_the_assembled_layer(tmp_path: Path) -> None:
    rope = catalog.exercise(6).solution_source()
    (tmp_path / "e06_rope.py").write_text(rope.replace("* 2 / x.shape[-1]", "/ x.shape[-1]"))
    report = grade(23, catalog.exercise(23).solution_source(), tmp_path)
    assert not report.passed and "expected" in report.text()


def test_a_wrong_answer_is_reported_with_the_input_and_expected_against_got(tmp_path: Path) -> None:
    source = catalog.exercise(4).solution_source().replace(" + np.float32(eps)", "")
    text = grade(4, source, tmp_path).text()
    assert "WRONG  x [2, 6], eps 0.5: at index" in text and "expected" in text and ", got " in text


def test_a_stub_keeps_the_task_and_signatures_and_blanks_every_answer() -> None:
    for entry in catalog.EXERCISES:
        stub = catalog.stub(entry.number)
        assert entry.task() in stub and "qwen_np.exercises.solutions" not in stub
        assert "NotImplementedError" in stub or "ANSWER = None" in stub
    assert "from e04_rms_norm import rms_norm" in catalog.stub(23)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(["exercises", *argv])
    except SystemExit as exit:                # argparse's usage errors
        code = int(exit.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_the_cli_lists_starts_and_checks_from_any_folder_with_its_exit_codes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, _ = run_cli(capsys)
    assert code == 0 and len([line for line in out.splitlines() if re.match(r"\s*\d+\s+§", line)]) == len(NUMBERS)

    assert run_cli(capsys, "start", "4")[0] == 0 and (tmp_path / "e04_rms_norm.py").read_text() == catalog.stub(4)
    code, out, _ = run_cli(capsys, "check", "4")
    assert code == 1 and "not written yet" in out
    (tmp_path / "e04_rms_norm.py").write_text(catalog.exercise(4).solution_source())
    code, out, _ = run_cli(capsys, "check", "4")
    assert code == 0 and "all 3 right" in out
    code, out, _ = run_cli(capsys, "check", "4", "--solution")
    assert code == 0 and "the reference solution" in out

    code, _, err = run_cli(capsys, "start", "4")                 # the learner's work is not overwritten
    assert code == 2 and "--force" in err and len(err.splitlines()) == 1
    for argv in (["check", "99"], ["start", "0"], ["check", "5"], ["check", "4", str(tmp_path / "missing.py")],
                 ["check", "4", "e04_rms_norm.py", "--solution"]):
        code, _, err = run_cli(capsys, *argv)
        assert code == 2 and err.startswith("error: ") and len(err.splitlines()) == 1, (argv, err)
    assert run_cli(capsys, "check", "x")[0] == 2


def test_a_file_that_does_not_load_is_a_wrong_answer_and_a_missing_piece_names_the_exercise_that_writes_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "e04_rms_norm.py").write_text("def rms_norm(x, weight, eps:\n")
    code, out, _ = run_cli(capsys, "check", "4")
    assert code == 1 and "SyntaxError" in out
    (tmp_path / "e04_rms_norm.py").unlink()
    assert run_cli(capsys, "start", "23")[0] == 0
    code, out, _ = run_cli(capsys, "check", "23")
    assert code == 1 and "No module named 'e04_rms_norm' (`python -m qwen_np exercises start 4` writes it" in out


def test_every_exercise_on_the_walkthrough_names_its_commands() -> None:
    for entry in catalog.EXERCISES:
        heading = re.search(rf"^### Exercise {entry.number}: .*$", PAGE, re.MULTILINE)
        assert heading, f"exercise {entry.number} is not on the page"
        text = PAGE[heading.end():PAGE.find("</details>", heading.end())]
        assert f"python -m qwen_np exercises start {entry.number}`" in text
        assert f"python -m qwen_np exercises check {entry.number}`" in text
