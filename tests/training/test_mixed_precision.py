"""Mixed precision (qwen_np/training/mixed.py): the operand rounding, FP16's loss scaling, FP32 master weights."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from qwen_np.training import gradients, mixed, step as training
from qwen_np.core import layers
from qwen_np.errors import QwenNPError
from qwen_np.numbers.formats import round_trip
from qwen_np.engine.loading import load_model

FIXTURES = Path(__file__).parents[1] / "fixtures" / "gradients"
BUNDLED = Path(__file__).parents[2] / "weights"


def values(*shape: int, seed: int = 0) -> np.ndarray:
    """FP32 values spread over many binades (so tiles have different scales), with exact zeros."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-30, 12, size=shape))
    x[rng.random(shape) < 0.05] = 0.0
    return x.astype(np.float32)


def bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("precision, dtype", [("bf16", ml_dtypes.bfloat16), ("fp16", np.float16)])
def test_plain_casts_round_as_ml_dtypes_and_formats_bit_for_bit(precision: str, dtype: type) -> None:
    x = values(37, 53)
    rounding = mixed.operands(precision)
    assert rounding is not None
    with np.errstate(over="ignore"):
        expected = x.astype(dtype).astype(np.float32)            # overflow to inf, as the hardware cast
    for kind, axis in (("activation", -1), ("weight", -1), ("gradient", 0)):
        ours = rounding(x, kind, axis)
        assert np.array_equal(bits(ours), bits(expected)) and np.array_equal(bits(ours), bits(round_trip(x, precision)))


def test_fp32_touches_nothing() -> None:
    assert mixed.operands("fp32") is None


@pytest.mark.parametrize("shape, axis", [((3, 300), -1), ((300, 5), 0), ((2, 7, 130), -1), ((128, 256), 0)])
def test_fp8_tiles_are_formats_e4m3_with_one_scale_per_128_values_along_the_summed_axis(
        shape: tuple[int, ...], axis: int) -> None:
    """Each 1x128 tile (the last one shorter) is formats' per-tensor E4M3 round trip of that tile alone,
    i.e. ml_dtypes' float8_e4m3fn of tile / (amax / 448), times the scale."""
    x = values(*shape, seed=1)
    ours = mixed.round_fp8(x, "activation", axis)
    moved, rounded = np.moveaxis(x, axis, -1), np.moveaxis(ours, axis, -1)
    for row, got in zip(moved.reshape(-1, moved.shape[-1]), rounded.reshape(-1, moved.shape[-1])):
        for start in range(0, len(row), mixed.TILE):
            tile = row[start:start + mixed.TILE]
            expected = round_trip(tile, "fp8_e4m3")
            scale = np.float32(np.abs(tile).max() / np.float32(448)) if np.abs(tile).max() else np.float32(1)
            by_hand = (tile / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale
            assert np.array_equal(bits(got[start:start + mixed.TILE]), bits(expected))
            assert np.array_equal(bits(expected), bits(by_hand))


def test_fp8_weights_have_one_scale_per_128x128_block() -> None:
    w = values(300, 200, seed=2)
    ours = mixed.round_fp8(w, "weight", 0)
    for r in range(0, 300, 128):
        for c in range(0, 200, 128):
            block = w[r:r + 128, c:c + 128]
            assert np.array_equal(bits(ours[r:r + 128, c:c + 128]), bits(round_trip(block, "fp8_e4m3")))


def test_an_unknown_precision_names_the_parameter() -> None:
    with pytest.raises(QwenNPError, match="^precision: expected one of fp32, bf16, fp16, fp8"):
        mixed.operands("fp4")


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp8"])
def test_the_backward_multiplies_the_rounded_gradient_weight_and_input(precision: str) -> None:
    """dx = round(dy) round(W), dW = round(dy)^T round(x): the linear layers' products and nothing else."""
    rng = np.random.default_rng(4)
    d_out, x, w = (rng.standard_normal(s).astype(np.float32) for s in ((2, 5, 6), (2, 5, 4), (6, 4)))
    rounding = mixed.operands(precision)
    assert rounding is not None
    hook = layers.MATMUL_INPUTS.set(rounding)
    try:
        dx, dw = gradients.linear_backward(d_out, x, w)
        y = layers.linear(x, w)
    finally:
        layers.MATMUL_INPUTS.reset(hook)
    rows, x_rows = d_out.reshape(-1, 6), x.reshape(-1, 4)
    assert np.array_equal(dx, rounding(d_out, "gradient", -1) @ rounding(w, "weight", 0))
    assert np.array_equal(dw, rounding(rows, "gradient", 0).T @ rounding(x_rows, "activation", 0))
    assert np.array_equal(y, rounding(x, "activation", -1) @ rounding(w, "weight", -1).T)
    assert np.array_equal(layers.linear(x, w), x @ w.T)          # outside training nothing is rounded


def test_precision_fp32_is_the_fp32_step_bit_for_bit_and_others_stay_close() -> None:
    model = load_model(FIXTURES / "tied_mha", memory="fp32")
    batch = np.random.default_rng(3).integers(0, model.config.vocab_size, size=(4, 33))
    loss, grads = training.loss_and_gradients(model, batch)
    same_loss, same = training.loss_and_gradients(model, batch, precision="fp32")
    assert loss == same_loss and all(np.array_equal(grads[n], same[n]) for n in grads)
    for precision, tolerance in (("bf16", 0.05), ("fp16", 0.01), ("fp8", 0.2)):
        rounded_loss, rounded = training.loss_and_gradients(model, batch, precision=precision)
        assert rounded_loss != loss and abs(rounded_loss - loss) < tolerance
        assert rounded.keys() == grads.keys() and not any(np.array_equal(grads[n], rounded[n]) for n in grads
                                                          if n.endswith("proj.weight"))


# --- loss scaling -------------------------------------------------------------------------------------


def test_loss_scaling_halves_and_skips_on_overflow_and_doubles_after_n_clean_steps() -> None:
    scaler = mixed.LossScaler(scale=1024.0, growth_interval=3)
    assert [scaler.update(True) for _ in range(2)] == ["", ""] and scaler.scale == 1024.0
    assert scaler.update(True) == "grow" and (scaler.scale, scaler.clean_steps) == (2048.0, 0)
    assert scaler.update(True) == ""
    assert scaler.update(False) == "overflow" and (scaler.scale, scaler.clean_steps) == (1024.0, 0)
    assert [scaler.update(True) for _ in range(3)] == ["", "", "grow"]       # the count restarted at the overflow


def test_unscaling_divides_exactly_and_reports_an_overflow() -> None:
    scaler = mixed.LossScaler(scale=2.0 ** 16)
    g = values(8, 8)
    grads = {"a": g * np.float32(2.0 ** 16), "b": np.ones(3, dtype=np.float32)}
    assert scaler.unscale(grads) and np.array_equal(grads["a"], g)
    grads["b"][1] = np.inf
    assert not scaler.unscale(grads)


def test_an_fp16_step_with_too_large_a_scale_overflows_and_a_scaled_one_unscales_to_the_fp32_gradient() -> None:
    model = load_model(FIXTURES / "tied_mha", memory="fp32")
    batch = np.random.default_rng(5).integers(0, model.config.vocab_size, size=(2, 17))
    _, reference = training.loss_and_gradients(model, batch)
    _, huge = training.loss_and_gradients(model, batch, precision="fp16", loss_scale=2.0 ** 40)
    assert not mixed.LossScaler(scale=2.0 ** 40).unscale(huge)
    _, scaled = training.loss_and_gradients(model, batch, precision="fp16", loss_scale=2.0 ** 8)
    assert mixed.LossScaler(scale=2.0 ** 8).unscale(scaled)
    for name, g in reference.items():       # FP16's 11 significant bits: about 1e-3 of the gradient's norm
        assert 0 < np.linalg.norm(scaled[name] - g) < 0.005 * np.linalg.norm(g), name


@pytest.mark.slow
def test_without_loss_scaling_fp16_flushes_gradients_to_zero_and_scaling_keeps_them() -> None:
    model = load_model(BUNDLED, memory="fp32")
    batch = np.random.default_rng(0).integers(0, model.config.vocab_size, size=(2, 65))
    plain, scaled = training.fp16_underflow(model, batch), training.fp16_underflow(model, batch, 2.0 ** 16)
    assert plain > 0.01 and scaled < plain / 10


# --- why FP32 master weights ----------------------------------------------------------------------------


def test_an_update_below_half_a_bf16_ulp_cannot_move_a_bf16_weight() -> None:
    """BF16 keeps 8 significant bits: half an ulp of 1.0 is 2^-8 ~ 0.004, of 0.01 2^-15 ~ 3e-5."""
    assert mixed.stalled_by_update(np.ones(100, dtype=np.float32), 2e-4) == 1.0
    assert mixed.stalled_by_update(np.full(100, 0.01, dtype=np.float32), 2e-4) == 0.0
    assert mixed.stalled_by_update(np.array([1.0, 0.01], dtype=np.float32), 2e-4) == 0.5
    assert mixed.stalled_by_update(np.ones(100, dtype=np.float32), 2e-4, "fp32") == 0.0


def test_a_sixth_of_the_bundled_models_weights_would_not_move_under_a_2e4_update_in_bf16() -> None:
    params = training.named_parameters(load_model(BUNDLED, memory="fp32"))
    weights = np.concatenate([p.ravel() for p in params.values()])
    assert mixed.stalled_by_update(weights, 2e-4) == pytest.approx(0.176, abs=0.002)
    assert mixed.stalled_by_update(weights, 2e-4, "fp32") == 0.0
