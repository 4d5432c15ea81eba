"""`train --grpo` (the trainer's GRPO step over qwen_np/training/rollouts.py): a tiny model learns to please a
user's reward function on held-out prompts, with and without the KL term, whole or through LoRA; its progress
records the rewards, completion length and KL; it resumes bit for bit; a reward that raises is one line."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from qwen_np.cli import main
from qwen_np.training.run_state import LAST, load_state
from tests.training.test_dpo_training import WORDS, tiny  # noqa: F401  (the module's tiny model fixture)
from tests.training.test_training import assert_same_run

REWARDS = '''
def count(prompt, completion, word):
    return float(completion.count(word))

def fails(prompt, completion, word):
    raise KeyError(word)
'''


def write_prompts(path: Path, count: int, seed: int) -> Path:
    rng = random.Random(seed)
    path.write_text("".join(json.dumps({"prompt": " ".join(rng.choices(WORDS, k=3)).capitalize(), "word": "king"}) + "\n"
                            for _ in range(count)))
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(training prompts, held-out prompts, the reward file): the reward counts "king" in the completion."""
    folder = tmp_path_factory.mktemp("grpo")
    (folder / "rewards.py").write_text(REWARDS)
    return write_prompts(folder / "train.jsonl", 24, 0), write_prompts(folder / "val.jsonl", 4, 1), folder / "rewards.py"


def grpo(model: Path, inputs: tuple[Path, Path, Path], out: Path, *flags: str, function: str = "count") -> int:
    data, val, rewards = inputs
    return main(["train", "--model", str(model), "--grpo", "--prompts", str(data), "--val", str(val), "--reward",
                 f"{rewards}:{function}", "--group", "4", "--completion-tokens", "12", "--out", str(out),
                 "--batch-size", "4", "--eval-every", "5", "--lr", "1e-2", "--warmup", "1", "--context", "32", *flags])


def held_out_reward(model: Path, inputs: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]) -> float:
    _, val, rewards = inputs
    capsys.readouterr()
    assert main(["eval", "--model", str(model), "--prompts", str(val), "--reward", f"{rewards}:count", "--samples", "8",
                 "--completion-tokens", "12", "--json"]) == 0
    return float(json.loads(capsys.readouterr().out)["reward_mean"])


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--steps", "20"], ["--steps", "20", "--beta", "0.04", "--loss", "grpo"],
                                   ["--steps", "20", "--loss", "dr_grpo"]], ids=["dapo", "grpo+kl", "dr_grpo"])
def test_train_grpo_raises_the_held_out_mean_reward(tiny: tuple[Path, Path, Path],  # noqa: F811
                                                   inputs: tuple[Path, Path, Path], tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str], flags: list[str]) -> None:
    model = tiny[0]
    before = held_out_reward(model, inputs, capsys)
    assert grpo(model, inputs, tmp_path / "run", *flags) == 0
    after = held_out_reward(tmp_path / "run" / "model", inputs, capsys)
    assert after >= before + 0.5, (before, after)
    history = load_state(tmp_path / "run" / LAST)[3]["history"]
    assert all({"reward_mean", "reward_std", "completion_length", "kl"} <= set(record) for record in history)
    assert history[0]["kl"] == 0.0, "the first step's policy is its reference"
    if "--beta" in flags:
        assert history[-1]["kl"] > 0


@pytest.mark.slow
def test_a_lora_grpo_runs_kl_is_to_the_base_with_its_adapters_off(tiny: tuple[Path, Path, Path],  # noqa: F811
                                                                  inputs: tuple[Path, Path, Path],
                                                                  tmp_path: Path) -> None:
    """The first step's KL is 0 (the adapters start at zero: the policy is the base), later ones are not; only
    the adapters are trained. (Rank-4 adapters on this tiny model learn the reward too slowly for a test.)"""
    assert grpo(tiny[0], inputs, tmp_path / "run", "--steps", "4", "--lora", "4", "--lr", "5e-2", "--beta", "0.04") == 0
    state = load_state(tmp_path / "run" / LAST)
    history = state[3]["history"]
    assert history[0]["kl"] == 0.0 and history[-1]["kl"] > 0
    assert all(".lora_A." in name or ".lora_B." in name for name in state[0])


@pytest.mark.slow
def test_a_resumed_grpo_run_is_bit_for_bit_the_run_never_stopped(tiny: tuple[Path, Path, Path],  # noqa: F811
                                                                inputs: tuple[Path, Path, Path], tmp_path: Path) -> None:
    model = tiny[0]
    assert grpo(model, inputs, tmp_path / "whole", "--steps", "6", "--beta", "0.04", "--eval-every", "3") == 0
    assert grpo(model, inputs, tmp_path / "part", "--steps", "3", "--decay-steps", "6", "--beta", "0.04",
                "--eval-every", "3") == 0
    assert main(["train", "--out", str(tmp_path / "part"), "--resume", "--steps", "6"]) == 0
    assert_same_run(tmp_path / "part", tmp_path / "whole")


def test_a_reward_that_raises_is_one_line_naming_the_prompt(tiny: tuple[Path, Path, Path],  # noqa: F811
                                                           inputs: tuple[Path, Path, Path], tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert grpo(tiny[0], inputs, tmp_path / "run", "--steps", "2", function="fails") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) >= 1 and err[-1].startswith(f"error: --reward: {inputs[0]}:") and \
        err[-1].endswith(": the reward function raised KeyError ('king') on this prompt"), err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flags, wording", [
    (["--group", "1"], "error: --group: must be at least 2, got 1"),
    (["--dpo"], "error: --grpo: a run is DPO or GRPO, not both"),
])
def test_bad_grpo_flags_are_one_line(tiny: tuple[Path, Path, Path], inputs: tuple[Path, Path, Path],  # noqa: F811
                                     tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str],
                                     wording: str) -> None:
    assert grpo(tiny[0], inputs, tmp_path / "run", *flags) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(wording)


def test_grpo_flags_without_grpo_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--preset", "tiny", "--prompts", "p.jsonl", "--out", str(tmp_path / "run")]) == 2
    assert "error: --prompts: sets GRPO's rollouts: give --grpo too" in capsys.readouterr().err
