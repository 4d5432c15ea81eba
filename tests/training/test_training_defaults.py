"""What `train` does with the flags a new user leaves out (issue 42): a run's length follows its data (--epochs
over it, the plan said before the first step), the warmup follows the run's length, and a warmup given longer
than the run is said, not silent."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import QWEN3_RANDOM
from tests.training.test_lora_training import write_chats
from tests.training.test_training import SMALL, write_text
from qwen_np.cli import main
from qwen_np.files.tokenizer import Tokenizer
from qwen_np.training import chats, trainer, run_spec
from qwen_np.training.settings import PRESET_SETTINGS, RunEvents, Settings
from qwen_np.core.config import LAYER_MATRICES
from qwen_np.training.lora import LoraSettings
from qwen_np.training.run_state import LAST, load_state
from qwen_np.training.parameters import hf_config


README_EPOCHS = 3          # README's training section: without --steps, a run is 3 epochs over its data


class Planned(Exception):
    """Raised by PlanOnly before the first step: the plan is all a test wants."""


class PlanOnly(RunEvents):
    """Keeps the settings and description a run starts with, then stops it (no step is taken)."""

    def started(self, settings: Settings, done: int, description: str) -> None:
        self.settings, self.description = settings, description
        raise Planned


def plan_of(out: Path, **spec: Any) -> PlanOnly:
    events = PlanOnly()
    with pytest.raises(Planned):
        trainer.run(run_spec.RunSpec(out, **spec), events)
    return events


@pytest.mark.slow
def test_a_lora_fine_tune_without_steps_takes_the_default_epochs_over_its_chats_and_says_so_first(
        tmp_path: Path) -> None:
    """README's command on 40 chats: --epochs' passes over them (3 x 38 training conversations, 16 a step: 8
    steps, not the 1,000 of a fixed default), the plan printed before the first step."""
    data = write_chats(tmp_path / "chats.jsonl", 40, seed=0)
    plan = plan_of(tmp_path / "run", model=str(QWEN3_RANDOM), data=str(data), lora=LoraSettings(8, None, LAYER_MATRICES))
    conversations = len(chats.held_out(Tokenizer.from_folder(QWEN3_RANDOM), data, None)[0])
    steps = math.ceil(README_EPOCHS * conversations / Settings.batch_size)
    assert plan.settings.steps == steps and steps < 20
    assert f"plan: {steps} steps of {Settings.batch_size} (" in plan.description
    assert f"epochs of {conversations} conversations" in plan.description
    assert not (tmp_path / "run").exists()                       # stopped before its first checkpoint


def test_epochs_over_a_text_are_its_windows_and_a_presets_steps_give_way_to_them(tmp_path: Path) -> None:
    data = write_text(tmp_path / "text.txt")
    one = plan_of(tmp_path / "one", preset="tiny", data=str(data), overrides={"epochs": 1})
    two = plan_of(tmp_path / "two", preset="tiny", data=str(data), overrides={"epochs": 2})
    assert two.settings.steps in (2 * one.settings.steps - 1, 2 * one.settings.steps)     # the last step whole
    assert one.settings.steps != PRESET_SETTINGS["tiny"]["steps"]
    assert " windows), warmup " in one.description


def test_the_default_warmup_follows_a_short_run_so_it_reaches_the_peak_lr(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(hf_config(SMALL)))
    assert main(["train", "--out", str(tmp_path / "run"), "--data", str(write_text(tmp_path / "text.txt")),
                 "--config", str(config), "--batch-size", "4", "--context", "16", "--steps", "6", "--lr", "1e-2"]) == 0
    assert max(h["lr"] for h in load_state(tmp_path / "run" / LAST)[3]["history"]) == pytest.approx(1e-2)


def test_a_warmup_given_longer_than_the_run_is_one_note_saying_the_lr_never_reaches_its_peak(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(hf_config(SMALL)))
    assert main(["train", "--out", str(tmp_path / "run"), "--data", str(write_text(tmp_path / "text.txt")),
                 "--config", str(config), "--batch-size", "4", "--context", "16", "--steps", "4", "--warmup", "10",
                 "--lr", "1e-2"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "--warmup" in line]
    assert notes == ["note: --warmup 10 is longer than the run's --steps 4: the learning rate rises to 40% of --lr "
                     "0.01 and never reaches it (a --warmup of at most 4 does)"]
    assert max(h["lr"] for h in load_state(tmp_path / "run" / LAST)[3]["history"]) == pytest.approx(4e-3)


def test_steps_and_epochs_both_given_is_one_error_naming_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--preset", "tiny", "--data", str(write_text(tmp_path / "text.txt")), "--out",
                 str(tmp_path / "run"), "--steps", "5", "--epochs", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --epochs: 2 and --steps 5 both say how long the run is")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_epochs_given_on_resuming_recount_the_runs_steps_with_a_note(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(hf_config(SMALL)))
    data = write_text(tmp_path / "text.txt")
    flags = ["--batch-size", "4", "--context", "16", "--lr", "1e-2"]
    assert main(["train", "--out", str(tmp_path / "run"), "--data", str(data), "--config", str(config), "--steps", "2",
                 *flags]) == 0
    one = plan_of(tmp_path / "one", config=config, data=str(data),
                  overrides={"epochs": 0.1, "batch_size": 4, "context": 16})
    capsys.readouterr()
    assert main(["train", "--out", str(tmp_path / "run"), "--resume", "--epochs", "0.1"]) == 0
    assert load_state(tmp_path / "run" / LAST)[3]["settings"]["steps"] == one.settings.steps > 2
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: --epochs")]
    assert len(notes) == 1 and "no longer bit for bit" in notes[0]
