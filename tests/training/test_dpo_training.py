"""`train --dpo` and `eval --prefs` (qwen_np/training/preferences.py, the trainer's DPO step): a tiny model learns
a trivially learnable preference and ranks held-out pairs by it; TRL's preference format read and tokenised as
DPOTrainer does; bad lines named by file, line and field."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from qwen_np.cli import main
from qwen_np.core.layers import log_softmax
from qwen_np.engine.loading import load_model
from qwen_np.files.tokenizer import Tokenizer
from qwen_np.training import preferences
from qwen_np.training.run_state import LAST, load_state
from tests.training.test_training import write_text

WORDS = "the king and queen of this fair land shall speak to thee my lord what news from rome".split()
CHOSEN, REJECTED = " good night sweet prince.", " now is the winter."


def write_pairs(path: Path, count: int, seed: int) -> Path:
    """Plain pairs: a random prompt, always the same chosen and rejected replies (learnable whatever the prompt)."""
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as f:
        for _ in range(count):
            prompt = " ".join(rng.choices(WORDS, k=rng.randint(2, 5))).capitalize()
            f.write(json.dumps({"prompt": prompt, "chosen": CHOSEN, "rejected": REJECTED}) + "\n")
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(a tiny model trained one step from random weights, with its BPE tokenizer; training pairs; held-out pairs)."""
    folder = tmp_path_factory.mktemp("dpo")
    assert main(["train", "--preset", "tiny", "--data", str(write_text(folder / "text.txt")), "--out",
                 str(folder / "start"), "--steps", "1"]) == 0
    return folder / "start" / "model", write_pairs(folder / "train.jsonl", 32, 0), write_pairs(folder / "val.jsonl", 8, 1)


def eval_prefs(model: Path, prefs: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, float]:
    capsys.readouterr()
    assert main(["eval", "--model", str(model), "--prefs", str(prefs), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("flags", [[], ["--lora", "4", "--lr", "3e-2"]], ids=["full", "lora"])
def test_train_dpo_raises_held_out_preference_accuracy(tiny: tuple[Path, Path, Path], tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str], flags: list[str]) -> None:
    model, data, val = tiny
    before = eval_prefs(model, val, capsys)
    assert main(["train", "--model", str(model), "--data", str(data), "--val", str(val), "--dpo", "--out",
                 str(tmp_path / "run"), "--batch-size", "8", "--steps", "8", "--eval-every", "4", "--lr", "1e-2",
                 "--warmup", "1", "--context", "32", *flags]) == 0
    after = eval_prefs(tmp_path / "run" / "model", val, capsys)
    assert before["preference_accuracy"] < 0.75 and after["preference_accuracy"] == 1.0, (before, after)
    assert after["margin"] > before["margin"] + 2
    meta = load_state(tmp_path / "run" / LAST)[3]
    assert meta["dpo"] == 0.1
    assert meta["evals"][-1]["preference_accuracy"] == 1.0
    assert meta["evals"][-1]["dpo_loss"] < meta["evals"][0]["dpo_loss"] < np.log(2)
    assert meta["history"][0]["loss"] == pytest.approx(np.log(2), abs=1e-6), "the policy starts as its reference"


def test_eval_prefs_is_the_share_of_pairs_whose_chosen_reply_is_likelier(tiny: tuple[Path, Path, Path],
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Each reply's log-probability summed over its tokens, from the model's forward of prompt + reply alone."""
    model_folder, _, val = tiny
    result = eval_prefs(model_folder, val, capsys)
    model, tokenizer = load_model(model_folder, memory="fp32"), Tokenizer.from_folder(model_folder)

    def summed(prompt: str, reply: str) -> float:
        prompt_ids = tokenizer.encode(prompt)
        ids = tokenizer.encode(prompt + reply + tokenizer.eos_token)
        assert ids[:len(prompt_ids)] == prompt_ids
        log_probs = log_softmax(model.forward(ids[:-1]))
        return float(sum(log_probs[t - 1, ids[t]] for t in range(len(prompt_ids), len(ids))))

    rows = [json.loads(line) for line in val.read_text().splitlines()]
    margins = np.array([summed(row["prompt"], row["chosen"]) - summed(row["prompt"], row["rejected"]) for row in rows])
    assert result["pairs"] == len(rows)
    assert result["preference_accuracy"] == pytest.approx(np.mean(margins > 0))
    assert result["margin"] == pytest.approx(margins.mean(), rel=1e-5, abs=1e-5)


def test_a_conversational_pair_is_the_prompt_rendered_for_a_reply_and_the_reply_rendered_after_it(
        tok: Tokenizer) -> None:
    """TRL's tokenize_fn: the prompt with the generation prompt, the reply where prompt + reply parts from it
    (Qwen3's template writes the last turn's empty think block: the reply's)."""
    row = preferences.pair_line(json.dumps({
        "prompt": [{"role": "user", "content": "What colour is snow?"}],
        "chosen": [{"role": "assistant", "content": "white"}], "rejected": [{"role": "assistant", "content": "red"}]}),
        "f:1")
    pair = preferences.encoded_pair(tok, row)
    assert tok.decode(pair.prompt).endswith("<|im_start|>user\nWhat colour is snow?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(pair.chosen) == "<think>\n\n</think>\n\nwhite<|im_end|>\n"
    assert tok.decode(pair.rejected) == "<think>\n\n</think>\n\nred<|im_end|>\n"
    whole = tok.encode_chat(row["prompt"] + row["chosen"], add_generation_prompt=False)
    assert pair.prompt.tolist() + pair.chosen.tolist() == whole


def test_a_plain_pairs_replies_end_with_the_end_of_text_token(tok: Tokenizer) -> None:
    """TRL's add_eos for a plain (not conversational) pair."""
    pair = preferences.encoded_pair(tok, {"prompt": "Snow is", "chosen": " white", "rejected": " red"})
    assert pair.chosen[-1] == pair.rejected[-1] == tok.eos_token_id
    assert tok.decode(pair.prompt) == "Snow is" and tok.decode(pair.chosen[:-1]) == " white"


@pytest.mark.parametrize("line, wording", [
    ({"prompt": "a", "chosen": "b"}, "rejected: missing"),
    ({"prompt": "a", "chosen": "b", "rejected": "c", "score": 1}, "score: not a field of a preference line"),
    ({"prompt": "a", "chosen": [{"role": "assistant", "content": "b"}], "rejected": "c"}, "prompt: expected a list"),
    ({"prompt": [{"role": "user", "content": "a"}], "chosen": [{"role": "user", "content": "b"}],
      "rejected": [{"role": "assistant", "content": "c"}]}, "chosen: holds the reply, assistant messages only"),
    ({"prompt": [{"role": "user", "content": 3}], "chosen": [{"role": "assistant", "content": "b"}],
      "rejected": [{"role": "assistant", "content": "c"}]}, "prompt: messages[0].content: must be a string"),
])
def test_a_bad_preference_line_is_one_error_naming_the_file_line_and_field(
        tiny: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], line: dict,
        wording: str) -> None:
    model, _, _ = tiny
    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n" + json.dumps(line) + "\n")
    for command in (["eval", "--model", str(model), "--prefs", str(prefs)],
                    ["train", "--model", str(model), "--data", str(prefs), "--dpo", "--context", "32", "--out",
                     str(tmp_path / "run")]):
        capsys.readouterr()
        assert main(command) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {prefs}:2: {wording}"), err
    assert not (tmp_path / "run").exists()


def test_beta_without_dpo_and_dpo_without_a_model_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--preset", "tiny", "--beta", "0.2", "--out", str(tmp_path / "a")]) == 2
    assert "--beta: sets DPO's beta: give --dpo too" in capsys.readouterr().err
    assert main(["train", "--preset", "tiny", "--dpo", "--out", str(tmp_path / "b")]) == 2
    assert "error: --dpo: DPO tunes a checkpoint's replies: name it with --model" in capsys.readouterr().err


@pytest.mark.parametrize("flags, wording", [
    (["--precision", "bf16"], "error: --precision: bf16: a DPO or GRPO step runs in FP32"),
    (["--grad-accum", "2"], "error: --grad-accum: 2: a DPO or GRPO step is one piece"),
    (["--recompute"], "error: --recompute: a DPO or GRPO step keeps its tape"),
])
def test_what_a_dpo_step_does_not_do_is_refused_not_ignored(tiny: tuple[Path, Path, Path], tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str], flags: list[str],
                                                            wording: str) -> None:
    model, data, _ = tiny
    assert main(["train", "--model", str(model), "--data", str(data), "--dpo", "--context", "32", "--out",
                 str(tmp_path / "run"), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(wording), err
    assert not (tmp_path / "run").exists()
