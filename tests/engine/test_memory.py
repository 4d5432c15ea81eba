"""The memory plan: chosen from the config alone, and a clear error instead of an out-of-memory kill."""

from __future__ import annotations

import dataclasses
import re
import tracemalloc
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from qwen_np import QwenNPError, preset
from qwen_np.core.config import LAYER_MATRICES, Qwen3Config
from qwen_np.core.kv_cache import kv_position_bytes
from qwen_np.engine.sizes import GiB
from qwen_np.engine.memory import kv_cache_bytes_per_token, plan_memory
from qwen_np.engine.step_memory import training_memory, training_moments, training_peak, training_total
from qwen_np.numbers.numerics import held
from qwen_np.training import lora, mixed
from qwen_np.engine.runtime import allocate

QWEN3_8B = preset("qwen3-8b")


def test_auto_keeps_8b_as_bf16_on_a_24_gib_machine():
    plan = plan_memory(QWEN3_8B, 4096, "auto", available=22 * GiB)
    assert plan.mode == "bf16"
    assert plan.fp32_weight_bytes == 4 * 8_190_735_360 and plan.stored_weight_bytes == 2 * 8_190_735_360
    assert plan.kv_cache_bytes == 4096 * kv_cache_bytes_per_token(QWEN3_8B) == 4096 * 2 * 36 * 8 * 128 * 4


def test_the_plan_counts_the_kv_cache_in_its_dtype_and_int8_fits_qwen3_0_6b_at_131072_tokens_in_24_gib():
    """The issue's figure: Qwen3-0.6B's cache at 131,072 tokens is 30 GB in FP32 (no plan fits), 7.5 GB in int8."""
    config = preset("qwen3-0.6b")
    with pytest.raises(QwenNPError, match="^memory: the bf16 plan needs"):
        plan_memory(config, 131_072, "auto", available=24 * GiB)
    plan = plan_memory(config, 131_072, "auto", available=24 * GiB, kv_dtype="int8")
    assert plan.kv_cache_bytes == 131_072 * kv_position_bytes(config, "int8") == 131_072 * 2 * 28 * 8 * (128 + 4)
    assert "KV cache (131072 tokens, INT8)" in plan.describe()


def test_auto_upcasts_when_fp32_fits():
    assert plan_memory(preset("qwen3-0.6b"), 4096, "auto", available=22 * GiB).mode == "fp32"


def test_explicit_fp32_that_cannot_fit_fails_before_loading_and_suggests_bf16():
    with pytest.raises(QwenNPError, match=r"^memory: the fp32 plan needs .* use bf16"):
        plan_memory(QWEN3_8B, 4096, "fp32", available=22 * GiB)


@pytest.mark.parametrize("requested", ["auto", "bf16"])
def test_nothing_fits_is_one_clear_error(requested):
    with pytest.raises(QwenNPError, match=r"the bf16 plan needs .* only 8.0 GiB is available; try a smaller model"):
        plan_memory(QWEN3_8B, 4096, requested, available=8 * GiB)


def test_unknown_mode_names_the_flag():
    with pytest.raises(QwenNPError, match="^memory: expected one of auto, fp32, bf16"):
        plan_memory(QWEN3_8B, 4096, "int4")


def test_plan_describes_every_part():
    text = plan_memory(QWEN3_8B, 4096, "auto", available=22 * GiB).describe()
    for part in ("weights FP32", "weights as stored", "KV cache (4096 tokens, FP32)", "working buffers", "available RAM"):
        assert part in text


@pytest.mark.parametrize("shape, dtype", [((3, 5), np.float32), ((70 * 1024 ** 2,), np.uint8), ((0, 4), np.float32)])
def test_allocate_gives_a_writable_array_of_that_shape_and_dtype(shape, dtype):
    array = allocate(shape, dtype)
    assert array.shape == shape and array.dtype == dtype and array.flags.writeable and array.flags.c_contiguous
    array[...] = 7
    assert (array == 7).all()


# --- A training step's estimate against what the step allocates ---------------------------------------

# Two small Qwen3s: a tied one whose embedding is half its weights (as Qwen3-0.6B's is a quarter), and a
# deeper one with a small vocabulary whose tape and attention probabilities weigh more.
WIDE_VOCAB = Qwen3Config(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, vocab_size=16384, tie_word_embeddings=True)
DEEP = Qwen3Config(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, vocab_size=2048, tie_word_embeddings=True)
STEPS = {  # name: (config, rows, context, training_memory's settings)
    "wide vocab, full": (WIDE_VOCAB, 2, 64, {}),
    "wide vocab, LoRA": (WIDE_VOCAB, 2, 64, {"lora_rank": 8}),
    "wide vocab, full, bf16 products": (WIDE_VOCAB, 2, 64, {"precision": "bf16"}),
    "wide vocab, LoRA, fp8 products": (WIDE_VOCAB, 2, 64, {"lora_rank": 8, "precision": "fp8"}),
    "wide vocab, LoRA on a BF16 base, 1 x 32 tokens": (WIDE_VOCAB, 1, 32, {"lora_rank": 8, "frozen": "bf16"}),
    "deep, full": (DEEP, 2, 128, {}),
    "deep, LoRA": (DEEP, 2, 128, {"lora_rank": 8}),
    "deep, full, recomputed, 2 micro-batches": (DEEP, 2, 128, {"recompute": True, "micro_batches": 2}),
    "deep, full, untied, fp16 with loss scaling": (dataclasses.replace(DEEP, tie_word_embeddings=False), 2, 128,
                                                   {"precision": "fp16", "loss_scaling": True}),
}


def measured_step_peak(config: Qwen3Config, rows: int, context: int, lora_rank: int = 0, frozen: str = "fp32",
                       precision: str = "fp32", recompute: bool = False, micro_batches: int = 1,
                       loss_scaling: bool = False) -> int:
    """The most bytes NumPy held (tracemalloc) during two trainer steps (the second with AdamW's moments),
    above what was held before the weights were made: the step as trainer._train_step runs it, one thread."""
    from qwen_np.training import step as training
    from qwen_np.training.parameters import init_parameters, model_from_parameters

    batch = np.random.default_rng(0).integers(0, config.vocab_size, size=(rows * micro_batches, context + 1))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        params: dict[str, Any] = init_parameters(config, seed=0)
        if frozen == "bf16":                                  # the base as a bf16 checkpoint loads: StoredRows
            params = {name: held(p.astype(ml_dtypes.bfloat16)) if p.ndim == 2 else p for name, p in params.items()}
        model = model_from_parameters(config, params)
        if lora_rank:
            lora.add_adapters(model, lora_rank)
            params = lora.adapter_parameters(model)
        optimizer = training.adamw_for(params)
        peak = 0
        for _ in range(2):
            tracemalloc.reset_peak()                          # the weights' initialisation is not the step
            _, grads = training.loss_and_accumulated_gradients(model, batch, micro_batches, threads=1,
                                                               recompute=recompute, precision=precision,
                                                               loss_scale=1024.0 if loss_scaling else 1.0)
            if loss_scaling:
                mixed.LossScaler(1024.0).unscale(grads)
            training.clip_gradients(grads, 1.0)
            optimizer.update(params, grads, 1e-4)
            del grads
            peak = max(peak, tracemalloc.get_traced_memory()[1] - before)
        return peak
    finally:
        tracemalloc.stop()


@pytest.mark.slow
@pytest.mark.parametrize("name", STEPS)
def test_training_estimate_is_within_a_tenth_of_the_steps_measured_peak(name):
    config, rows, context, settings = STEPS[name]
    targets = LAYER_MATRICES if settings.get("lora_rank") else ()       # add_adapters' default: all seven
    estimate = training_total(training_memory(config, rows, context, lora_targets=targets, **settings))
    measured = measured_step_peak(config, rows, context, **settings)
    assert abs(estimate / measured - 1) < 0.10, f"estimate {estimate / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB"


def test_a_tied_full_steps_peak_is_its_backwards_end_with_the_two_embedding_gradients():
    estimate = training_memory(WIDE_VOCAB, 2, 64)
    assert training_peak(estimate) == "backward"
    assert estimate["tied_embedding_gradients"] == 2 * 4 * WIDE_VOCAB.vocab_size * WIDE_VOCAB.hidden_size
    assert "tied_embedding_gradients" not in training_memory(WIDE_VOCAB, 2, 64, lora_rank=8, lora_targets=LAYER_MATRICES)


def test_the_total_is_the_largest_moment_not_every_transient_added():
    estimate = training_memory(WIDE_VOCAB, 2, 64, lora_rank=8, lora_targets=LAYER_MATRICES)
    moments = training_moments(estimate)
    assert training_total(estimate) == moments[training_peak(estimate)] == max(moments.values())
    assert training_total(estimate) < sum(v for k, v in estimate.items() if k != "activations_per_token")


def test_pieces_computed_at_once_each_hold_their_gradients_and_tape():
    one, two = training_memory(DEEP, 4, 128, shards=2, threads=1), training_memory(DEEP, 4, 128, shards=2, threads=2)
    assert two["activations"] == 2 * one["activations"]          # a piece is 2 rows; two pieces alive at once
    assert two["piece_gradients"] == one["piece_gradients"] == one["gradients"]
    assert two["tied_embedding_gradients"] == one["tied_embedding_gradients"]   # the pieces end one after another


# --- A run's plan against the peak it measured -------------------------------------------------------

CHAT_RUNS = {"LoRA rank 8": ["--lora", "8"], "every weight": []}


@pytest.mark.slow
@pytest.mark.parametrize("kind", CHAT_RUNS)
def test_a_chat_fine_tunes_printed_plan_is_within_15_percent_of_its_measured_peak(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str) -> None:
    """README's command on 40 short chats (16 a step, --context 256), the 20 MB random Qwen3 with the real
    152k vocabulary: the plan sizes the step by the rows the batches have (a batch is padded to its longest
    conversation, about 27 tokens here), not by --context's 256 (4.7x over before), and the peak it is held
    to is the training's (from the model's load through the last step)."""
    from tests.conftest import QWEN3_RANDOM
    from tests.training.test_lora_training import write_chats
    from qwen_np.cli import main

    data = write_chats(tmp_path / "chats.jsonl", 40, seed=0)
    assert main(["train", "--model", str(QWEN3_RANDOM), "--data", str(data), "--out", str(tmp_path / "run"),
                 "--steps", "2", *CHAT_RUNS[kind]]) == 0
    report = re.search(r"predicted peak RSS (\d+) MiB .* measured peak RSS (\d+) MiB", capsys.readouterr().err)
    assert report is not None
    predicted, measured = (int(figure) for figure in report.groups())
    assert abs(predicted / measured - 1) < 0.15, f"predicted {predicted} MiB, measured {measured} MiB"
