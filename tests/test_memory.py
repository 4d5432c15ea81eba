"""The memory plan: chosen from the config alone, and a clear error instead of an out-of-memory kill."""

from __future__ import annotations

import numpy as np
import pytest

from qwen_np import QwenNPError, preset
from qwen_np.engine.memory import GiB, kv_cache_bytes_per_token, plan_memory
from qwen_np.engine.runtime import allocate

QWEN3_8B = preset("qwen3-8b")


def test_auto_keeps_8b_as_bf16_on_a_24_gib_machine():
    plan = plan_memory(QWEN3_8B, 4096, "auto", available=22 * GiB)
    assert plan.mode == "bf16"
    assert plan.fp32_weight_bytes == 4 * 8_190_735_360 and plan.stored_weight_bytes == 2 * 8_190_735_360
    assert plan.kv_cache_bytes == 4096 * kv_cache_bytes_per_token(QWEN3_8B) == 4096 * 2 * 36 * 8 * 128 * 4


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
