"""The walkthrough's chapter "Teach it to reason" (tools/walkthrough/walkthrough_chapter_reason.py): its task files
keep the held-out questions out of every stage's data, its checker scores replies as the page says, its
commands are the CLI's, and its recorded runs still come out of the code."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from qwen_np.cli import build_parser
from qwen_np.training import rollouts

sys.path.insert(0, str(ROOT / "tools" / "walkthrough"))

import walkthrough_chapter_reason as chapter  # noqa: E402


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_no_stage_trains_on_a_held_out_question(tmp_path):
    """The held-out questions appear in no file SFT, GRPO or DPO reads; each file's answers are the counts."""
    chapter.task_files(tmp_path)
    held = {row["messages"][0]["content"] for row in lines(tmp_path / "held_out.jsonl")}
    assert len(held) == chapter.HELD_OUT
    assert (tmp_path / "held_out.txt").read_text(encoding="utf-8").split() == [
        row["messages"][0]["content"] for row in lines(tmp_path / "held_out.jsonl")]
    trained = {row["messages"][0]["content"] for name in ("sft.jsonl", "sft_val.jsonl", "prompts.jsonl")
               for row in lines(tmp_path / name)}
    trained |= {row["prompt"][0]["content"] for row in lines(tmp_path / "prefs.jsonl")}
    assert not held & trained
    for row in lines(tmp_path / "sft.jsonl"):
        question, reply = (m["content"] for m in row["messages"])
        assert reply == str(question.count("1")) and len(question) == chapter.DIGITS
    for row in lines(tmp_path / "prefs.jsonl"):
        right = row["prompt"][0]["content"].count("1")
        assert row["chosen"][0]["content"] == str(right)
        assert abs(int(row["rejected"][0]["content"]) - right) == 1
        assert 0 <= int(row["rejected"][0]["content"]) <= chapter.DIGITS


def test_the_checker_rewards_exactly_the_count_and_extracts_only_a_bare_number():
    """The shipped reward is 1 for the count (whitespace aside), 0 for a wrong or padded answer; the extractor
    --vote uses abstains where the reply is not just a number, as reward_of and answer_of call them."""
    reward = rollouts.load_function(f"{chapter.REWARD_FILE}:reward")
    extract = rollouts.load_function(f"{chapter.REWARD_FILE}:extract", "extract")
    prompt = rollouts.Prompt("prompts.jsonl:1", [{"role": "user", "content": "011010010111"}], {"answer": 7})
    assert [rollouts.reward_of(reward, prompt, reply) for reply in ("7", " 7\n", "6", "77", "7 7", "", "seven")] == [
        1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert [rollouts.answer_of(extract, reply, "here") for reply in ("12", " 3 ", "3 4", "x3", "")] == [
        "12", "3", None, None, None]


def test_every_command_the_chapter_prints_is_the_clis():
    """Each command parses with qwen_np's own parser (a renamed or dropped flag fails here, not on the page)."""
    commands = [chapter.sft_command(), chapter.dpo_command(), *(chapter.grpo_command(b) for b in chapter.BETAS),
                chapter.eval_command("base"), chapter.prefs_command("base"), chapter.vote_command("sft/model")]
    for command in commands:
        argv = shlex.split(command)
        assert argv[:3] == ["python", "-m", "qwen_np"]
        build_parser(flags_of=[argv[3]]).parse_args(argv[3:])


@pytest.mark.slow
def test_recorded_reasoning_runs_repeat_their_first_steps():
    """The chapter's runs are recorded (tens of minutes): the base's held-out preference margin and the SFT run's
    first steps must still come out of `eval --prefs` and `train` within rtol 1e-3 (the record's 4 digits)."""
    chapter.check_first_steps(chapter.load_record())          # raises naming the figure that moved
