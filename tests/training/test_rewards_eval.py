"""`eval --prompts FILE --reward F:FN --samples K` (qwen_np/training/rollouts.py): the user's function called on
each sampled completion with the line's other fields, its mean, unbiased pass@k; a reward that raises or is NaN
is one error naming the prompt's line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from qwen_np.cli import main
from qwen_np.training import rollouts
from tests.training.test_dpo_training import tiny  # noqa: F401  (the module's tiny model fixture)

REWARDS = '''
import json, math

def logged(prompt, completion, word, log):
    value = float(word in completion) + 0.25 * (len(completion) % 2)
    with open(log, "a") as f:
        f.write(json.dumps({"prompt": prompt, "completion": completion, "value": value}) + "\\n")
    return value

def fails(prompt, completion, **row):
    raise ZeroDivisionError("on purpose")

def not_a_number(prompt, completion, **row):
    return math.nan
'''


@pytest.mark.parametrize("n, c, k", [(5, 0, 1), (5, 2, 1), (5, 2, 2), (8, 3, 4), (10, 9, 3), (4, 4, 4), (20, 1, 20)])
def test_pass_at_k_is_the_unbiased_estimator(n: int, c: int, k: int) -> None:
    """1 - C(n - c, k) / C(n, k) (Chen et al.): the chance that k of the n samples drawn without replacement
    hold a correct one."""
    assert rollouts.pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), rel=1e-12, abs=1e-15)


def write_inputs(folder: Path) -> tuple[Path, Path, Path]:
    rewards, log = folder / "rewards.py", folder / "log.jsonl"
    rewards.write_text(REWARDS)
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": text, "word": word, "log": str(log)}) + "\n"
                               for text, word in (("The king", "queen"), ("Good night", "prince"))))
    return prompts, rewards, log


def test_eval_prompts_reports_the_mean_reward_and_pass_at_k_of_the_functions_values(
        tiny: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    model = tiny[0]
    prompts, rewards, log = write_inputs(tmp_path)
    command = ["eval", "--model", str(model), "--prompts", str(prompts), "--reward", f"{rewards}:logged",
               "--samples", "4", "--completion-tokens", "12", "--seed", "3", "--json"]
    assert main(command) == 0
    result = json.loads(capsys.readouterr().out)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert [call["prompt"] for call in calls] == ["The king"] * 4 + ["Good night"] * 4
    values = [call["value"] for call in calls]
    assert result["reward_mean"] == pytest.approx(sum(values) / 8)
    for k in (1, 2, 4):
        expected = sum(rollouts.pass_at_k(4, sum(v > 0 for v in values[i:i + 4]), k) for i in (0, 4)) / 2
        assert result[f"pass@{k}"] == pytest.approx(expected)
    assert len({call["completion"] for call in calls}) > 1, "samples differ"
    assert main(command) == 0
    assert json.loads(capsys.readouterr().out) == result, "seeded: the same samples again"


@pytest.mark.parametrize("function, wording", [
    ("fails", "the reward function raised ZeroDivisionError (on purpose) on this prompt"),
    ("not_a_number", "the reward function returned nan on this prompt, not a finite number"),
])
def test_a_reward_that_raises_or_is_nan_is_one_error_naming_the_prompt(
        tiny: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],  # noqa: F811
        function: str, wording: str) -> None:
    prompts, rewards, _ = write_inputs(tmp_path)
    assert main(["eval", "--model", str(tiny[0]), "--prompts", str(prompts), "--reward", f"{rewards}:{function}",
                 "--samples", "2", "--completion-tokens", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --reward: {prompts}:1: {wording}"]


def test_bad_prompt_lines_and_reward_specs_are_one_error(tiny: tuple[Path, Path, Path], tmp_path: Path,  # noqa: F811
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    prompts, rewards, _ = write_inputs(tmp_path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    for reward, lines, wording in ((f"{rewards}:logged", bad, f"error: {bad}:2: expected {{\"messages\""),
                                   (f"{rewards}:missing", prompts, f"error: --reward: {rewards} defines no function missing"),
                                   ("rewards", prompts, "error: --reward: expected FILE.py:FUNCTION, got 'rewards'")):
        assert main(["eval", "--model", str(tiny[0]), "--prompts", str(lines), "--reward", reward]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(wording), err
