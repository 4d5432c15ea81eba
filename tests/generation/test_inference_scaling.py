"""Inference-time scaling (issue 47): `generate --samples K --vote [--extract F.py:FN]` prints the majority of the
answers taken out of K sampled replies (self-consistency), `--best-of F.py:FN` the reply of highest reward; the
samples are one batch, sample j seeded --seed + j; bad flags and functions that raise are one line naming the flag.
On the bundled model, in process."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from qwen_np.cli import main
from qwen_np.engine.paged import BLOCK_SIZE
from qwen_np.training import rollouts

FUNCTIONS = '''
def first_word(completion):
    words = completion.split()
    return words[0].strip(",.;:!?") if words else None

def length(prompt, completion):
    return float(len(completion))

def raises(*args):
    raise ValueError("on purpose")

def a_number(completion):
    return 7
'''
GENERATE = ["generate", "--quiet", "ROMEO:", "-n", "6"]
SAMPLES = 8


@pytest.fixture
def functions(tmp_path: Path) -> Path:
    path = tmp_path / "functions.py"
    path.write_text(FUNCTIONS)
    return path


def run_json(capsys: pytest.CaptureFixture[str], *flags: str) -> list[dict]:
    capsys.readouterr()
    assert main([*GENERATE, "--json", *flags]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def first_word(completion: str) -> str | None:        # FUNCTIONS' extractor, to compute the expected vote
    words = completion.split()
    return words[0].strip(",.;:!?") if words else None


def test_majority_is_the_most_common_answer_a_tie_going_to_the_first_seen_and_none_abstaining() -> None:
    assert rollouts.majority(["7", None, "3", "7", "3", "3"]) == ("3", {"7": 2, "3": 3})
    assert rollouts.majority(["3", None, "7", "7", "3"]) == ("3", {"3": 2, "7": 2})
    assert rollouts.majority(["7", "3", "3", "7"]) == ("7", {"7": 2, "3": 2})
    assert rollouts.majority([None, None]) == (None, {})


@pytest.mark.parametrize("reply, answer", [
    ("<think>\nmaybe 12\n</think>\n\nIt is 41, not -42.5.", "-42.5"),
    ("<think>\n1 or 2\n</think>\n\n  no numbers here \n", "no numbers here"),
    ("<think>\nstill thinking about 3", None),
    ("  \n", None),
])
def test_the_default_answer_is_the_last_number_after_the_think_block_else_the_answer_stripped(
        reply: str, answer: str | None) -> None:
    assert rollouts.last_number(reply) == answer


def test_vote_prints_the_majority_of_the_extracted_answers_of_samples_seeded_seed_plus_j(
        functions: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plain = run_json(capsys, "--seed", "5", "--samples", str(SAMPLES))
    assert [reply["seed"] for reply in plain] == list(range(5, 5 + SAMPLES))
    alone, = run_json(capsys, "--seed", str(5 + 3))
    assert alone["text"] == plain[3]["text"], "sample j is the reply of --seed + j"
    answers = [first_word(reply["text"]) for reply in plain]
    votes = Counter(answers)
    expected = max(votes, key=votes.__getitem__)
    assert votes[expected] > 1 and answers[0] != expected, "the vote must differ from taking the first sample"

    voted, = run_json(capsys, "--seed", "5", "--samples", str(SAMPLES), "--vote", "--extract", f"{functions}:first_word")
    assert [sample["text"] for sample in voted["samples"]] == [reply["text"] for reply in plain], "seeded: reproduced"
    assert [sample["answer"] for sample in voted["samples"]] == answers
    assert (voted["answer"], voted["votes"]) == (expected, dict(votes))
    assert main([*GENERATE, "--seed", "5", "--samples", str(SAMPLES), "--vote", "--extract",
                 f"{functions}:first_word"]) == 0
    out, err = capsys.readouterr()
    assert out == expected + "\n"
    assert f"vote: {votes[expected]} of {SAMPLES} samples answer {expected!r} (" in err



def test_best_of_prints_the_sample_of_highest_reward(functions: Path, capsys: pytest.CaptureFixture[str]) -> None:
    chosen, = run_json(capsys, "--seed", "2", "--samples", str(SAMPLES), "--best-of", f"{functions}:length")
    rewards = [float(len(sample["text"])) for sample in chosen["samples"]]
    best = rewards.index(max(rewards))
    assert len(set(rewards)) > 1 and best > 0, "the best must differ from taking the first sample"
    assert [sample["reward"] for sample in chosen["samples"]] == rewards
    assert (chosen["best"], chosen["reward"], chosen["text"]) == (best, rewards[best], chosen["samples"][best]["text"])
    assert main([*GENERATE, "--seed", "2", "--samples", str(SAMPLES), "--best-of", f"{functions}:length"]) == 0
    out, err = capsys.readouterr()
    assert out == chosen["text"] + "\n" and f"best of {SAMPLES}: sample {best + 1} (seed {2 + best})" in err


def test_the_samples_read_the_prompt_once_and_share_its_full_blocks(capsys: pytest.CaptureFixture[str]) -> None:
    prompt = "ROMEO: What light through yonder window breaks? It is the east, and Juliet is the sun."
    capsys.readouterr()
    assert main(["generate", "--quiet", "--no-chat", prompt, "-n", "2", "--samples", "4", "--verbose"]) == 0
    err = capsys.readouterr().err
    ids = json.loads(err.split("prompt ids: ", 1)[1].splitlines()[0])
    shared = len(ids) // BLOCK_SIZE * BLOCK_SIZE
    assert shared > 0
    stats = err.splitlines()[-1]
    assert f"prompt_tokens={4 * len(ids) - 3 * shared} cached_tokens={3 * shared} " in stats, stats


@pytest.mark.parametrize("flags, line", [
    (["--vote"], "error: --vote: chooses among several replies: give --samples K"),
    (["--best-of", "{f}:length"], "error: --best-of: chooses among several replies: give --samples K"),
    (["--samples", "2", "--extract", "{f}:first_word"], "error: --extract: takes each reply's answer for --vote: "
                                                        "give --vote too"),
    (["--samples", "0", "--vote"], "error: argument --samples: must be >= 1, got 0"),
    (["--samples", "2", "--vote", "--best-of", "{f}:length"], "error: argument --best-of: not allowed with argument "
                                                              "--vote"),
    (["--samples", "2", "--best-of", "missing.py:length"], "error: --best-of: missing.py: not found"),
    (["--samples", "2", "--best-of", "{f}"], "error: --best-of: expected FILE.py:FUNCTION, got '{f}'"),
    (["--samples", "2", "--vote", "--extract", "{f}:nothing"], "error: --extract: {f} defines no function nothing"),
    (["--samples", "2", "--vote", "--extract", "{f}:raises"], "error: --extract: prompt 1, sample 1: the extractor "
                                                              "raised ValueError (on purpose)"),
    (["--samples", "2", "--vote", "--extract", "{f}:a_number"], "error: --extract: prompt 1, sample 1: the extractor "
                                                                "returned 7, not a string or None"),
    (["--samples", "2", "--best-of", "{f}:raises"], "error: --best-of: prompt 1: the reward function raised "
                                                    "ValueError (on purpose) on this prompt"),
    (["--samples", "2", "--lens"], "error: --trace/--lens/--attention: look at one reply at a time (got --samples 2)"),
])
def test_bad_flags_and_functions_that_fail_are_one_line_naming_the_flag(
        functions: Path, capsys: pytest.CaptureFixture[str], flags: list[str], line: str) -> None:
    argv = [*GENERATE, *(flag.replace("{f}", str(functions)) for flag in flags)]
    try:
        code = main(argv)
    except SystemExit as usage:                 # argparse's own errors exit from the parser
        code = usage.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(line.replace("{f}", str(functions))), err
