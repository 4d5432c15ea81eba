"""Training runs as a hostile user meets them: damaged checkpoints, two trainers in one folder, flags changed on
--resume, a data file edited between a run and its resume, a trainer killed before its first checkpoint, and the
typed run state a checkpoint holds. Every run here is a few steps of a tiny model."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROOT
from tests.training.test_training import SMALL, assert_same_run, train, write_text
from qwen_np import QwenNPError
from qwen_np.cli import main
from qwen_np.training import run_folder
from qwen_np.training.run_state import BEST, LAST, RunState, load_state
from qwen_np.training.text_data import corpus_sha256
from qwen_np.training.parameters import hf_config


def resume(out: Path, *flags: str) -> int:
    return main(["train", "--out", str(out), "--resume", *flags])


def error_line(capsys: pytest.CaptureFixture[str]) -> str:
    """stderr's one line (a refusal prints nothing else)."""
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: ") and "Traceback" not in lines[0]
    return lines[0]


def write_inputs(folder: Path) -> tuple[Path, Path]:
    """test_training's: a text file and a small model's config.json."""
    config = folder / "config.json"
    config.write_text(json.dumps(hf_config(SMALL)))
    return write_text(folder / "text.txt"), config


@pytest.fixture
def inputs(tmp_path: Path) -> tuple[Path, Path]:
    return write_inputs(tmp_path)


@pytest.fixture
def without_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run as where the `plot` extra is not installed: `import matplotlib` fails (a None in sys.modules)."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def notes_of_the_run(err: str) -> list[str]:
    """stderr's notes, but the one the missing `plot` extra adds at the end (no loss.png): what the run itself noted."""
    return [line for line in err.splitlines() if line.startswith("note:") and not line.startswith("note: no loss.png")]


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(a 6-step run's --out folder, its data, its config): evaluations at 3 and 6; copy it before changing it."""
    folder = tmp_path_factory.mktemp("finished")
    data, config = write_inputs(folder)
    assert train(folder / "run", data, config, "--steps", "6") == 0
    return folder / "run", data, config


@pytest.fixture
def run_copy(finished: tuple[Path, Path, Path], tmp_path: Path) -> Path:
    shutil.copytree(finished[0], tmp_path / "run")
    return tmp_path / "run"


# --- A damaged last.safetensors ----------------------------------------------------------------------


def flip_bit(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 1]) + data[at + 1:]


DAMAGE = {
    "a flipped bit in the header's JSON": lambda data: flip_bit(data, 8),
    "a flipped bit in a loss of the history": lambda data: flip_bit(data, re.search(rb'loss\\": \d\.(\d)', data).start(1)),
    "a flipped bit in a weight": lambda data: flip_bit(data, len(data) - 3),
    "truncated": lambda data: data[:len(data) // 2],
    "zeros": lambda data: bytes(len(data)),
    "empty": lambda data: b"",
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_last_checkpoint_is_one_line_saying_best_is_intact_and_its_advice_resumes(
        run_copy: Path, capsys: pytest.CaptureFixture[str], damage: str) -> None:
    last, best = run_copy / LAST, run_copy / BEST
    last.write_bytes(DAMAGE[damage](last.read_bytes()))
    assert resume(run_copy, "--steps", "8") == 2
    line = error_line(capsys)
    best_step = RunState.from_json(load_state(best)[3]).step
    assert line.startswith(f"error: --resume: {last}: damaged") and "not a qwen_np" not in line
    assert f"{best} is intact (step {best_step}," in line and f"to resume from step {best_step}" in line
    shutil.copy(best, last)                                       # what the line advises
    assert resume(run_copy, "--steps", "8") == 0


def test_a_damaged_last_with_a_damaged_or_missing_best_says_so(run_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    last, best = run_copy / LAST, run_copy / BEST
    last.write_bytes(b"")
    best.write_bytes(DAMAGE["a flipped bit in a weight"](best.read_bytes()))
    assert resume(run_copy) == 2
    assert f"{BEST} cannot take its place ({best}: damaged" in error_line(capsys)
    best.unlink()
    assert resume(run_copy) == 2
    assert f"there is no {BEST} to fall back on" in error_line(capsys)


def test_a_checkpoint_is_refused_unless_every_byte_is_the_one_written(run_copy: Path) -> None:
    """The SHA-256 in the header covers the state and every tensor: any one flipped bit of the file is refused."""
    data = (run_copy / LAST).read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")
    rng = np.random.default_rng(0)
    for at in [*rng.integers(8, header, 20), *rng.integers(header, len(data), 20)]:
        (run_copy / LAST).write_bytes(flip_bit(data, int(at)))
        with pytest.raises(QwenNPError, match="damaged"):
            load_state(run_copy / LAST)


def test_a_checkpoint_of_an_earlier_qwen_np_without_hashes_still_resumes_with_a_note(
        run_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Written as before checkpoints kept their SHA-256 and the text's: no digest, no data_sha256."""
    from safetensors.numpy import save_file

    params, adam_m, adam_v, meta = load_state(run_copy / LAST)
    del meta["data_sha256"]
    tensors = {f"{group}/{name}": tensor for group, tensors in (("param", params), ("adam_m", adam_m), ("adam_v", adam_v))
               for name, tensor in tensors.items()}
    save_file(tensors, str(run_copy / LAST), metadata={"qwen_np_training": json.dumps(meta)})
    capsys.readouterr()
    assert resume(run_copy, "--steps", "7") == 0
    assert "keeps no hash of its text (written before checkpoints did)" in capsys.readouterr().err
    assert load_state(run_copy / LAST)[3]["data_sha256"] == hash_of(Path(meta["data"]))


# --- Two trainers, one folder ------------------------------------------------------------------------

HOLD_THE_LOCK = ("import sys; from pathlib import Path; from qwen_np.training.run_folder import locked\n"
                 "with locked(Path(sys.argv[1])):\n    print('held', flush=True); sys.stdin.read()")


def holder(out: Path) -> subprocess.Popen[str]:
    """A process holding out's lock (as a trainer does) until its stdin closes."""
    out.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen([sys.executable, "-c", HOLD_THE_LOCK, str(out)], cwd=ROOT, text=True,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert process.stdout is not None and process.stdout.readline() == "held\n"
    return process


def test_a_second_trainer_in_a_folder_in_use_is_refused_naming_the_first(
        tmp_path: Path, inputs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    data, config = inputs
    first = holder(tmp_path / "run")
    try:
        assert train(tmp_path / "run", data, config, "--steps", "1") == 2
        line = error_line(capsys)
        assert f"--out: {tmp_path / 'run'} is in use by another train run (PID {first.pid}," in line
        assert resume(tmp_path / "run") == 2 and "in use by another train run" in error_line(capsys)
    finally:
        first.communicate("")                                     # the first trainer ends
    assert train(tmp_path / "run", data, config, "--steps", "1") == 0
    assert not (tmp_path / "run" / run_folder.LOCK).exists()      # given back at the end


def test_the_lock_of_a_trainer_killed_by_sigkill_is_taken_over(tmp_path: Path, inputs: tuple[Path, Path],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    data, config = inputs
    dead = holder(tmp_path / "run")
    dead.kill()                                                   # SIGKILL: no chance to remove its lock
    dead.wait()
    assert (tmp_path / "run" / run_folder.LOCK).read_text() == f"{dead.pid}\n"
    assert train(tmp_path / "run", data, config, "--steps", "1") == 0
    err = capsys.readouterr().err
    assert f"was left by a train run that no longer runs (PID {dead.pid}" in err and "taken over" in err


@pytest.mark.slow
def test_two_trainers_started_at_once_on_one_folder_never_both_succeed(tmp_path: Path,
                                                                       inputs: tuple[Path, Path]) -> None:
    """The probe's reproduction: both exited 0 with different losses, and the folder held one of the runs."""
    data, config = inputs
    command = [sys.executable, "-m", "qwen_np", "train", "--out", str(tmp_path / "run"), "--data", str(data),
               "--config", str(config), "--batch-size", "4", "--context", "16", "--steps", "3"]
    runs = [subprocess.Popen([*command, "--seed", str(seed)], cwd=ROOT, text=True, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE) for seed in (1, 2)]
    results = [(process.communicate()[1], process.returncode)[::-1] for process in runs]
    assert sorted(code for code, _ in results) == [0, 2]
    (won, _), = [(i, err) for i, (code, err) in enumerate(results) if code == 0]
    refused = results[1 - won][1].strip().splitlines()
    assert len(refused) == 1 and refused[0].startswith("error: --out:")
    assert load_state(tmp_path / "run" / LAST)[3]["settings"]["seed"] == (1, 2)[won]   # the folder holds the winner


# --- Flags given again on --resume -------------------------------------------------------------------


@pytest.mark.parametrize("flags, message", [
    (["--seed", "7"], "--seed: the run in {out} has --seed 0, which a resumed run keeps (it orders the data"),
    (["--context", "8"], "--ctx-size: the run in {out} has --ctx-size 16, which a resumed run keeps"),
    (["--preset", "tiny"], "--preset: not the model of the run in {out} (head_dim 8, the run's 4); a resumed run keeps "
                           "its model: drop --preset"),
])
def test_resuming_with_a_flag_that_would_break_the_continuation_is_refused_by_name(
        run_copy: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str) -> None:
    before = (run_copy / LAST).read_bytes()
    assert resume(run_copy, "--steps", "8", *flags) == 2
    assert message.format(out=run_copy) in error_line(capsys)
    assert (run_copy / LAST).read_bytes() == before


def test_resuming_with_the_same_config_seed_and_data_given_again_is_the_same_run(
        tmp_path: Path, inputs: tuple[Path, Path], capsys: pytest.CaptureFixture[str], without_matplotlib: None) -> None:
    data, config = inputs
    assert train(tmp_path / "straight", data, config, "--steps", "6") == 0
    assert train(tmp_path / "split", data, config, "--steps", "3", "--decay-steps", "6") == 0
    capsys.readouterr()
    assert train(tmp_path / "split", data, config, "--steps", "6", "--seed", "0", "--resume") == 0
    assert notes_of_the_run(capsys.readouterr().err) == []
    assert_same_run(tmp_path / "split", tmp_path / "straight")


@pytest.mark.parametrize("first, flags, note", [
    (["--decay-steps", "5"], ["--lr", "0.005"], "note: --lr 0.005 (was 0.01): applied; the run goes on from step 3, "
                                                "but is no longer bit for bit the run it was"),
    (["--decay-steps", "5"], ["--batch-size", "2"], "note: --batch-size 2 (was 4)"),
    ([], [], "note: --steps 5 (was 3): applied"),                 # no --decay-steps: the schedule stretches
])
def test_resuming_with_a_flag_that_changes_the_updates_applies_it_with_a_one_line_note(
        tmp_path: Path, inputs: tuple[Path, Path], capsys: pytest.CaptureFixture[str], first: list[str],
        flags: list[str], note: str) -> None:
    data, config = inputs
    assert train(tmp_path / "run", data, config, "--steps", "3", *first) == 0
    capsys.readouterr()
    assert resume(tmp_path / "run", "--steps", "5", *flags) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and notes[0].startswith(note), notes
    settings = load_state(tmp_path / "run" / LAST)[3]["settings"]
    assert settings["steps"] == 5 and all(str(settings[flag[2:].replace("-", "_")]) == value
                                          for flag, value in zip(flags[::2], flags[1::2]))


def test_resuming_with_only_flags_that_keep_it_exact_prints_no_note(
        tmp_path: Path, inputs: tuple[Path, Path], capsys: pytest.CaptureFixture[str], without_matplotlib: None) -> None:
    data, config = inputs
    assert train(tmp_path / "straight", data, config, "--steps", "6", "--eval-every", "2") == 0
    assert train(tmp_path / "split", data, config, "--steps", "3", "--decay-steps", "6") == 0
    capsys.readouterr()
    assert resume(tmp_path / "split", "--steps", "6", "--threads", "1", "--eval-every", "2", "--patience", "9",
                  "--recompute") == 0
    assert notes_of_the_run(capsys.readouterr().err) == []
    straight, split = (load_state(tmp_path / name / LAST)[0] for name in ("straight", "split"))
    assert all(np.array_equal(straight[name], split[name]) for name in straight)


def test_train_help_says_what_resuming_does_with_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """Each Settings flag is kept bit-exact, applied with a note, or refused on --resume: exactly one, and --help says which."""
    from dataclasses import fields

    from qwen_np.training import settings

    groups = [set(settings.BIT_EXACT), set(settings.NOT_BIT_EXACT), set(settings.KEPT_ON_RESUME)]
    assert sorted(name for group in groups for name in group) == sorted(f.name for f in fields(settings.Settings))
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    epilog = " ".join(capsys.readouterr().out.split("--resume continues", 1)[1].split())
    assert all(f"--{name.replace('_', '-')}" in epilog for group in groups for name in group)
    assert "a --preset or --config of another model and a --data of another text are refused" in epilog


# --- The training data -------------------------------------------------------------------------------


def test_a_data_file_edited_between_the_run_and_its_resume_is_noticed(
        tmp_path: Path, inputs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    data, config = inputs
    assert train(tmp_path / "run", data, config, "--steps", "3", "--decay-steps", "5") == 0
    assert load_state(tmp_path / "run" / LAST)[3]["data_sha256"] == hash_of(data)
    original = data.read_text()
    data.write_text(original.replace("king", "kings", 1))         # one letter more
    capsys.readouterr()
    assert resume(tmp_path / "run", "--steps", "5") == 2
    line = error_line(capsys)
    assert line.startswith(f"error: --data: {data} is not the text the run in {tmp_path / 'run'} began on")
    assert "edited or replaced since" in line
    other = tmp_path / "other.txt"
    other.write_text(original[:-100])
    assert resume(tmp_path / "run", "--steps", "5", "--data", str(other)) == 2
    assert error_line(capsys).startswith(f"error: --data: {other} is not the text")
    data.write_text(original)
    assert resume(tmp_path / "run", "--steps", "5") == 0


def hash_of(path: Path) -> str:
    """corpus_sha256 of a text file as train splits it (the last 5% of its lines validate)."""
    from qwen_np.training.data import read_text

    lines = read_text(path).splitlines(keepends=True)
    cut = len(lines) - max(1, len(lines) // 20)
    return corpus_sha256("".join(lines[:cut]), "".join(lines[cut:]))


@pytest.mark.slow
def test_a_moved_data_file_named_again_resumes_the_same_run(tmp_path: Path, inputs: tuple[Path, Path],
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    data, config = inputs
    assert train(tmp_path / "straight", data, config, "--steps", "6") == 0
    assert train(tmp_path / "split", data, config, "--steps", "3", "--decay-steps", "6") == 0
    moved = data.rename(tmp_path / "moved.txt")
    capsys.readouterr()
    assert resume(tmp_path / "split", "--steps", "6") == 2
    assert error_line(capsys) == f"error: --data: {data}, the run's text, is not there (moved? name its new place with --data)"
    assert resume(tmp_path / "split", "--steps", "6", "--data", str(moved)) == 0
    assert f"note: --data {moved}: the run's text, read from there (it began on {data})" in capsys.readouterr().err
    assert_same_run(tmp_path / "split", tmp_path / "straight")


# --- A trainer killed before its first checkpoint ----------------------------------------------------


@pytest.mark.slow
def test_resuming_a_run_killed_before_its_first_checkpoint_says_what_the_folder_holds(
        tmp_path: Path, inputs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    data, config = inputs
    out = tmp_path / "run"
    trainer = subprocess.Popen([sys.executable, "-m", "qwen_np", "train", "--out", str(out), "--data", str(data),
                                "--config", str(config), "--batch-size", "4", "--context", "16", "--steps", "100000",
                                "--eval-every", "100000"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (out / "config.json").exists() and trainer.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(trainer.pid, signal.SIGKILL)
    trainer.wait()
    assert (out / "config.json").exists() and not (out / LAST).exists()
    assert resume(out) == 2
    line = error_line(capsys)
    assert f"--resume: {out} holds no {LAST} to resume: the run there (PID {trainer.pid}) was killed before its first " \
           "checkpoint" in line
    assert "config.json, tokenizer.json, tokenizer_config.json; start it again without --resume" in line
    assert train(out, data, config, "--steps", "1") == 0             # and so it can be


def test_resuming_a_folder_that_holds_no_run_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert resume(tmp_path / "nothing") == 2
    assert "does not exist: there is no earlier run to continue" in error_line(capsys)
    (tmp_path / "empty").mkdir()
    assert resume(tmp_path / "empty") == 2
    assert "holds no earlier run (it is empty)" in error_line(capsys)
    assert (tmp_path / "empty").is_dir() and not list((tmp_path / "empty").iterdir())


# --- The run's state ---------------------------------------------------------------------------------


def test_the_run_state_is_what_a_checkpoint_holds_and_reads_back_equal(tmp_path: Path, inputs: tuple[Path, Path]) -> None:
    data, config = inputs
    assert train(tmp_path / "run", data, config, "--steps", "3", "--precision", "fp16") == 0
    meta = load_state(tmp_path / "run" / LAST)[3]
    assert sorted(meta) == ["bad_evals", "best_loss", "config", "data", "data_sha256", "evals", "history",
                            "loss_scaler", "optimizer_step", "order", "settings"]
    state = RunState.from_json(meta)
    assert json.loads(json.dumps(state.to_json())) == {k: v for k, v in meta.items() if k != "optimizer_step"}
    assert RunState.from_json(state.to_json()) == state
    assert (state.step, state.epoch, state.position) == (3, meta["order"]["epoch"], meta["order"]["position"])
    assert state.loss_scaler is not None and state.loss_scaler.clean_steps == 3
