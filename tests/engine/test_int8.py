"""`--memory int8`: every matrix quantized once at load to int8 codes with an FP32 scale per row.

The int8 model must compute what an FP32 model computes whose matrices are formats.round_trip(W,
"int8"): the same function, so only FP32 rounding (scaling outputs instead of weights, BLAS order)
may tell them apart.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

import qwen_np
from qwen_np import QwenNPError, preset
from qwen_np.engine import fast, loading
from qwen_np.core.config import LAYER_MATRICES, expected_tensors
from qwen_np.numbers.formats import quantize_int8_rows, round_trip
from qwen_np.engine.sizes import GiB
from qwen_np.engine.memory import plan_memory
from qwen_np.core.model import Qwen3Model
from qwen_np.numbers.numerics import Int8Rows
from tests.reference.logit_match import assert_logits_match, max_relative_error

PROMPT = np.array([5, 17, 3, 88, 42, 9, 61, 0, 95, 33, 7, 70])


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.conftest import write_random_checkpoint

    return write_random_checkpoint(tmp_path_factory.mktemp("int8"), seed=3, num_hidden_layers=3,
                                   num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=request.param)


def round_tripped(model: Qwen3Model) -> Qwen3Model:
    """The FP32 model with every matrix replaced by round_trip(matrix, "int8"), norms left alone."""
    layers = []
    for w in model.layers:
        rounded = {name: round_trip(getattr(w, name), "int8") for name in LAYER_MATRICES}
        layers.append(type(w)(**{**vars(w), **rounded}))
    embed = round_trip(model.embed_tokens, "int8")
    lm_head = embed if model.config.tie_word_embeddings else round_trip(model.lm_head, "int8")
    return Qwen3Model(model.config, embed, layers, model.norm, lm_head)


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast", "readable"])
def test_int8_model_computes_the_round_tripped_fp32_model(checkpoint: Path, fast_path: bool) -> None:
    reference = round_tripped(qwen_np.load_model(checkpoint, memory="fp32", max_tokens=32, fast=False))
    model = qwen_np.load_model(checkpoint, memory="int8", max_tokens=32, fast=fast_path)
    want = reference.forward(PROMPT)
    assert_logits_match(model.forward(PROMPT), want, "int8 vs round-tripped fp32")
    cache = model.new_cache(32)                                   # prefill, then decode token by token
    model.forward(PROMPT[:-3], cache)
    for i in range(len(PROMPT) - 3, len(PROMPT)):
        assert_logits_match(model.forward(PROMPT[i:i + 1], cache)[0], want[i], f"decode step at {i}")


def test_int8_differs_from_fp32_by_quantization_error_only(checkpoint: Path) -> None:
    """Not a no-op (the logits move), and not broken (they move by about int8's step, 1/254 of a row's range)."""
    fp32 = qwen_np.load_model(checkpoint, memory="fp32", max_tokens=32).forward(PROMPT)
    int8 = qwen_np.load_model(checkpoint, memory="int8", max_tokens=32).forward(PROMPT)
    assert 1e-4 < max_relative_error(int8, fp32) < 0.05


def test_int8_model_holds_codes_and_row_scales_and_fp32_norms(checkpoint: Path) -> None:
    model = qwen_np.load_model(checkpoint, memory="int8", max_tokens=32)
    assert model.plan is not None and model.plan.mode == "int8"
    for w in model.layers:
        for name in LAYER_MATRICES:
            m = getattr(w, name)
            assert isinstance(m, Int8Rows) and m.codes.dtype == np.int8 and m.scale.dtype == np.float32
            assert m.scale.shape == m.shape[:1] and np.abs(m.codes).max() <= 127
        assert w.q_norm.dtype == np.float32 and w.input_layernorm.dtype == np.float32
    assert isinstance(model.embed_tokens, Int8Rows) and isinstance(model.lm_head, Int8Rows)
    assert (model.lm_head is model.embed_tokens) == model.config.tie_word_embeddings


def test_int8_load_fuses_projections_without_copying(checkpoint: Path) -> None:
    model = qwen_np.load_model(checkpoint, memory="int8", max_tokens=16)
    for i, w in enumerate(model.layers):
        qkv, gate_up = model.fused_weights(i)
        assert isinstance(qkv, Int8Rows) and isinstance(gate_up, Int8Rows)
        assert qkv.codes.base is w.q_proj.codes.base and qkv.scale.base is w.q_proj.scale.base
        np.testing.assert_array_equal(qkv.codes, np.concatenate([w.q_proj.codes, w.k_proj.codes, w.v_proj.codes]))
        np.testing.assert_array_equal(gate_up.scale, np.concatenate([w.gate_proj.scale, w.up_proj.scale]))


@pytest.mark.parametrize("threads", [1, 3])
def test_quantizing_blocks_of_rows_on_threads_equals_the_whole(threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loading, "QUANTIZE_BLOCK_ROWS", 7)        # 40 rows over 3 threads: parts of 13-14 rows
    w = np.random.default_rng(0).standard_normal((40, 64)).astype(np.float32)
    codes, scale = np.empty((40, 64), np.int8), np.empty(40, np.float32)
    qwen_np.engine.runtime.set_threads(threads)
    try:
        loading.quantize_int8_into(w, codes, scale)
    finally:
        qwen_np.engine.runtime.set_threads(None)
    want_codes, want_scale = quantize_int8_rows(w)
    np.testing.assert_array_equal(codes, want_codes)
    np.testing.assert_array_equal(scale, want_scale)


@pytest.mark.parametrize("threads", [1, 3])
def test_fast_int8_product_splits_rows_and_scales_outputs(threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fast, "BLOCK_BYTES", 64 * 4 * 5)          # blocks of 5 rows: several per thread
    rng = np.random.default_rng(1)
    weight = Int8Rows(*quantize_int8_rows(rng.standard_normal((37, 64)).astype(np.float32)))
    x = rng.standard_normal((3, 64)).astype(np.float32)
    out = np.empty((3, 37), np.float32)
    qwen_np.engine.runtime.set_threads(threads)
    try:
        with qwen_np.engine.runtime.single_threaded_blas():
            fast.linear(x, weight, out)
    finally:
        qwen_np.engine.runtime.set_threads(None)
    want = x.astype(np.float64) @ (weight.codes * weight.scale[:, None].astype(np.float64)).T
    assert np.abs(out - want).max() < 1e-5 * np.abs(want).max()


def test_int8_plan_counts_codes_row_scales_and_fp32_norms() -> None:
    config = preset("qwen3-8b")
    shapes = expected_tensors(config).values()
    matrices = [s for s in shapes if len(s) == 2]
    norms = sum(s[0] for s in shapes if len(s) == 1)
    want = sum(math.prod(s) for s in matrices) + 4 * sum(s[0] for s in matrices) + 4 * norms
    plan = plan_memory(config, 4096, "int8", available=22 * GiB)
    assert plan.mode == "int8" and plan.int8_weight_bytes == want
    assert plan.total_bytes == want + plan.kv_cache_bytes + plan.working_bytes
    assert 8.19e9 < want < 8.2e9 and "weights int8" in plan.describe()


def test_auto_never_picks_int8_but_suggests_it_when_only_int8_fits() -> None:
    assert plan_memory(preset("qwen3-8b"), 4096, "auto", available=22 * GiB).mode == "bf16"
    with pytest.raises(QwenNPError, match=r"^memory: the bf16 plan needs .* use int8"):
        plan_memory(preset("qwen3-8b"), 4096, "auto", available=14 * GiB)
    assert plan_memory(preset("qwen3-8b"), 4096, "int8", available=14 * GiB).fits


def test_inspect_reports_the_int8_plan() -> None:
    from qwen_np.inspection import inspect_report

    plans = inspect_report(preset("qwen3-8b"), 7, "qwen3-8b", bandwidth=50e9)["this_machine"]["plans"]
    assert plans["int8"]["weight_bytes_read_per_token"] * 2 == plans["bf16"]["weight_bytes_read_per_token"]


def test_cli_memory_int8_generates_and_shows_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    from qwen_np.cli import main

    code = main(["generate", "--no-chat", "--temperature", "0", "-n", "3", "--memory", "int8", "--verbose", "hi"])
    err = capsys.readouterr().err
    assert code == 0 and "memory plan: int8" in err and "new_tokens=3" in err
