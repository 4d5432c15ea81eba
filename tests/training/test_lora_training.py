"""`train --model BASE --data chats.jsonl [--lora R]` (issue 33): a checkpoint fine-tuned on chats, its LoRA run
resumed bit for bit, its adapter read by peft, its merged model by qwen_np, and the bad input it refuses. Every
run is a few steps of a tiny random Qwen3 with the real tokenizer and chat template."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import QWEN3_RANDOM
from tests.training.test_training import assert_same_run
from qwen_np.cli import main
from qwen_np.engine.loading import load_model
from qwen_np.files.checkpoint import save_checkpoint
from qwen_np.files.tokenizer import Tokenizer
from qwen_np.training import chats, evaluation
from qwen_np.training.run_state import BEST, LAST, load_state

# The rule to learn: the assistant answers with the colour of the thing the user names, nothing else.
COLOURS = {"apple": "red", "banana": "yellow", "grass": "green", "sky": "blue", "snow": "white", "coal": "black"}
QUESTIONS = ("What colour is {}?", "Tell me the colour of {}.", "{}: which colour?")


def write_chats(path: Path, count: int, seed: int) -> Path:
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as f:
        for _ in range(count):
            thing = rng.choice(sorted(COLOURS))
            messages = [{"role": "user", "content": rng.choice(QUESTIONS).format(thing)},
                        {"role": "assistant", "content": COLOURS[thing]}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(a base model folder, training chats, held-out chats).

    The base is the random fixture with its embedding (tied: also the LM head) twice as large. Why: with
    the fixture's own (std 1/8 over D = 64), a frozen head cannot make any token much likelier than the
    152k others (the logit of a final state aligned with a token's row is about 8, the others' log-sum-exp
    about 12.4), so even a perfect adapter stays above ~4.4 nats a token: a floor of the random weights,
    not of training, and too close to half the base's loss for a short run to show the rule being learned."""
    from safetensors.numpy import load_file

    folder = tmp_path_factory.mktemp("lora")
    base = folder / "base"
    tensors = {name: array.astype(np.float32) for name, array in load_file(QWEN3_RANDOM / "model.safetensors").items()}
    tensors["model.embed_tokens.weight"] *= 2
    save_checkpoint(base, json.loads((QWEN3_RANDOM / "config.json").read_text()), [tensors], dtype="BF16")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(QWEN3_RANDOM / name, base / name)
    return base, write_chats(folder / "train.jsonl", 48, seed=0), write_chats(folder / "val.jsonl", 6, seed=1)


def train(out: Path, base: Path, data: Path, *flags: str) -> int:
    return main(["train", "--model", str(base), "--data", str(data), "--out", str(out), "--batch-size", "8",
                 "--context", "48", "--warmup", "2", "--seed", "3", *flags])


def held_out_loss(model_folder: Path, val: Path) -> float:
    """`eval --text val.jsonl`'s figure: the mean loss over the held-out assistant tokens."""
    model = load_model(model_folder, memory="fp32")
    conversations = chats.encoded_chats(Tokenizer.from_folder(model_folder), val)
    return evaluation.score_text(model.forward, [c.ids for c in conversations], 1, 48,
                                 learned=[c.learned for c in conversations]).summary()["loss_per_token"]


@pytest.fixture(scope="module")
def tuned(inputs: tuple[Path, Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 16-step LoRA run of rank 8 on all seven projections (its --out folder)."""
    base, data, val = inputs
    out = tmp_path_factory.mktemp("tuned") / "run"
    assert train(out, base, data, "--val", str(val), "--lora", "8", "--steps", "16", "--eval-every", "8",
                 "--lr", "2e-2") == 0
    return out


@pytest.mark.slow
def test_lora_halves_the_held_out_loss_and_trains_only_the_adapters(inputs: tuple[Path, Path, Path],
                                                                    tuned: Path) -> None:
    """The held-out assistant tokens' loss at most half the base's; the merged OUT/model scores what the run's
    last validation did; the checkpoint holds the adapters and their moments alone, not the frozen base."""
    base, _, val = inputs
    before = held_out_loss(base, val)
    state = load_state(tuned / LAST)
    after = state[3]["evals"][-1]["loss_per_token"]
    assert after <= 0.5 * before, (before, after)
    assert abs(held_out_loss(tuned / "model", val) - after) <= 1e-4 * after
    for group in state[:3]:
        assert group and all(".lora_A." in name or ".lora_B." in name for name in group)
    assert state[3]["lora"]["rank"] == 8


@pytest.mark.slow
def test_the_adapter_loads_in_peft_and_gives_the_merged_models_greedy_text(inputs: tuple[Path, Path, Path],
                                                                           tuned: Path) -> None:
    """OUT/adapter in peft.PeftModel.from_pretrained on the base: the same greedy tokens as qwen_np on OUT/model."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    base = inputs[0]
    tokenizer = Tokenizer.from_folder(base)
    prompt = tokenizer.encode_chat([{"role": "user", "content": "What colour is snow?"}], enable_thinking=False)
    hf = transformers.Qwen3ForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    peft_model = peft.PeftModel.from_pretrained(hf, tuned / "adapter").eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = peft_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                                  pad_token_id=151643, eos_token_id=None)
    theirs = out[0, len(prompt):].tolist()
    assert greedy(tuned / "model", prompt) == theirs
    assert greedy(base, prompt) != theirs, "the adapter must change the text for this test to mean anything"


def greedy(folder: Path, prompt: list[int], tokens: int = 8) -> list[int]:
    """qwen_np's greedy continuation of `prompt` by the model in `folder`."""
    model = load_model(folder, memory="fp32")
    cache = model.new_cache(64)
    logits, ids = model.forward(np.asarray(prompt), cache, last_only=True), []
    for _ in range(tokens):
        ids.append(int(np.argmax(logits[-1])))
        logits = model.forward([ids[-1]], cache)
    return ids


@pytest.mark.slow
def test_a_resumed_lora_run_is_bit_for_bit_the_run_never_stopped(inputs: tuple[Path, Path, Path],
                                                                 tmp_path: Path) -> None:
    """6 steps straight == 3 steps, stop, --resume, 3 more, with dropout (its masks drawn again), two micro-batches
    and the validation cut from --data: adapters, moments, history, order, adapter and merged model alike."""
    base, data, _ = inputs
    flags = ("--lora", "4", "--lora-targets", "q_proj,v_proj,down_proj", "--lora-dropout", "0.2", "--grad-accum", "2",
             "--eval-every", "3", "--lr", "1e-2")
    assert train(tmp_path / "straight", base, data, *flags, "--steps", "6") == 0
    assert train(tmp_path / "halves", base, data, *flags, "--steps", "3") == 0
    assert main(["train", "--out", str(tmp_path / "halves"), "--resume", "--steps", "6"]) == 0
    assert_same_run(tmp_path / "halves", tmp_path / "straight")
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (tmp_path / "halves" / "adapter" / name).read_bytes() == \
               (tmp_path / "straight" / "adapter" / name).read_bytes()
    assert load_state(tmp_path / "halves" / BEST)[3]["lora"]["dropout"] == 0.2


@pytest.mark.slow
def test_a_resumed_lora_run_refuses_another_base(inputs: tuple[Path, Path, Path], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    base, data, _ = inputs
    assert train(tmp_path / "run", base, data, "--lora", "2", "--steps", "1", "--eval-every", "1") == 0
    other = tmp_path / "other"
    shutil.copytree(base, other)
    weights = bytearray((other / "model.safetensors").read_bytes())
    weights[-1] ^= 1
    (other / "model.safetensors").write_bytes(bytes(weights))
    capsys.readouterr()
    assert main(["train", "--out", str(tmp_path / "run"), "--resume", "--model", str(other), "--steps", "2"]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"error: --model: {other} is not the model the run") and "\n" not in line


@pytest.mark.slow
def test_full_fine_tuning_from_a_checkpoint_lowers_the_loss(inputs: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """No --lora: every weight trained from the base's; OUT/model is the tuned checkpoint, with the base's tokenizer."""
    base, data, val = inputs
    assert train(tmp_path / "run", base, data, "--val", str(val), "--steps", "6", "--eval-every", "6",
                 "--lr", "3e-3") == 0
    params = load_state(tmp_path / "run" / LAST)[0]
    assert "model.embed_tokens.weight" in params and not any("lora" in name for name in params)
    assert held_out_loss(tmp_path / "run" / "model", val) < 0.7 * held_out_loss(base, val)
    assert not (tmp_path / "run" / "adapter").exists()
    assert Tokenizer.from_folder(tmp_path / "run" / "model").has_chat_template


@pytest.mark.parametrize("flags, expected", [
    (["--preset", "tiny", "--lora", "4"], "error: --lora: adapters train on a checkpoint's frozen weights"),
    (["--lora", "0"], "error: --lora: must be at least 1, got 0"),
    (["--lora", "4", "--lora-targets", "q_proj,qkv"], "error: --lora-targets: expected some of q_proj"),
    (["--lora", "4", "--lora-dropout", "1"], "error: --lora-dropout: must be in [0, 1)"),
    (["--lora-alpha", "8"], "error: --lora-alpha: sets LoRA's adapters: give --lora RANK too"),
    (["--memory", "int8"], "error: --memory: int8: full fine-tuning updates every weight"),
])
def test_bad_lora_flags_are_one_line_naming_the_flag(inputs: tuple[Path, Path, Path], tmp_path: Path, flags: list[str],
                                                     expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    base, data, _ = inputs
    source = [] if "--preset" in flags else ["--model", str(base)]
    assert main(["train", *source, "--data", str(data), "--out", str(tmp_path / "run"), *flags]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), lines
    assert not (tmp_path / "run").exists()


def test_a_chat_line_without_messages_is_named_by_its_line(inputs: tuple[Path, Path, Path], tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    base, data, _ = inputs
    bad = tmp_path / "bad.jsonl"
    bad.write_text(data.read_text().splitlines()[0] + "\n" + json.dumps({"prompt": "hi"}) + "\n")
    assert train(tmp_path / "run", base, bad, "--lora", "4") == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f'error: {bad}:2: expected {{"messages": [{{"role": ..., "content": ...}}, ...]}}'], lines


def test_inspect_lora_counts_the_adapters_and_holds_the_base_frozen() -> None:
    """inspect --lora 16 on Qwen3-0.6B's shapes: r (in + out) a projection, 7 a layer, 28 layers = 10,092,544 trained
    values (the issue's 10M), FP32 weights + gradients + two moments of them, and the frozen base alone per mode."""
    from qwen_np.core.config import preset
    from qwen_np.engine.memory import held_weight_bytes
    from qwen_np.inspection.report import inspect_report

    config = preset("qwen3-0.6b")
    lora = inspect_report(config, 7, "qwen3-0.6b", 1.0, 512, 8, lora_rank=16)["memory"]["lora"]
    D, F, q, kv = 1024, 3072, 2048, 1024              # q_proj's out: 16 heads x 128, k/v: 8 x 128
    per_layer = (D + q) + 2 * (D + kv) + (q + D) + 3 * (D + F)
    assert lora["trainable"] == 16 * 28 * per_layer == 10_092_544
    assert (lora["weights"], lora["gradients"], lora["adamw"]) == (4 * lora["trainable"],) * 2 + (8 * lora["trainable"],)
    for mode, plan in lora["by_frozen_base"].items():
        assert plan["frozen_base"] == held_weight_bytes(config, mode)
        assert plan["total"] >= plan["frozen_base"] + 16 * lora["trainable"] + lora["activations"]    # and transients
