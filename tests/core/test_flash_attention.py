"""FlashAttention's online softmax (core/flash.py) gives what layers.attention gives, without the [H, T, S] scores."""

from __future__ import annotations

import numpy as np
import pytest

from qwen_np.core import layers
from qwen_np.core.flash import flash_attention


def qkv(rng: np.random.Generator, batch: tuple[int, ...], T: int, S: int, H: int, KVH: int, Dh: int,
        scale: float = 1.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    q = (scale * rng.standard_normal((*batch, T, H, Dh))).astype(np.float32)
    k = (scale * rng.standard_normal((*batch, S, KVH, Dh))).astype(np.float32)
    v = rng.standard_normal((*batch, S, KVH, Dh)).astype(np.float32)
    return q, k, v


@pytest.mark.parametrize("batch, T, H, KVH, Dh, block", [
    ((), 1, 4, 4, 8, 64),         # one token: MHA, one block
    ((), 37, 4, 2, 16, 8),        # GQA 2 per key head, blocks not dividing T
    ((), 130, 8, 1, 32, 64),      # MQA, three blocks, the last short
    ((2,), 50, 6, 3, 8, 7),       # a training batch, GQA 2, odd block
    ((3,), 64, 16, 8, 128, 16),   # Qwen3's head_dim and group of 2
    ((), 33, 4, 2, 8, 1),         # one key per block: the online softmax at its most incremental
])
def test_flash_attention_equals_plain_attention_on_a_prefill(batch: tuple[int, ...], T: int, H: int, KVH: int, Dh: int,
                                                            block: int) -> None:
    q, k, v = qkv(np.random.default_rng(T * H + block), batch, T, T, H, KVH, Dh)
    positions = np.arange(T)
    expected = layers.attention(q, k, v, positions)
    got = flash_attention(q, k, v, positions, block=block)
    assert got.shape == expected.shape == (*batch, T, H * Dh)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("cached, new", [(99, 1), (40, 5)])
def test_flash_attention_equals_plain_attention_on_a_step_after_cached_keys(cached: int, new: int) -> None:
    """A decode step (or a chunk) whose queries sit at positions cached.. and see every cached key."""
    q, k, v = qkv(np.random.default_rng(cached), (), new, cached + new, 8, 2, 16)
    positions = np.arange(cached, cached + new)
    np.testing.assert_allclose(flash_attention(q, k, v, positions, block=32),
                               layers.attention(q, k, v, positions), rtol=1e-5, atol=2e-6)


def test_the_running_max_keeps_large_scores_from_overflowing() -> None:
    """Scores near 400 (exp overflows FP32 past 88): a block with a larger max rescales the old sums."""
    q, k, v = qkv(np.random.default_rng(7), (), 20, 20, 2, 1, 16, scale=7.0)
    scores = layers.attention_scores(q, k)
    assert scores.max() > 88.0                                   # exp(scores) alone would be inf
    got = flash_attention(q, k, v, np.arange(20), block=3)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, layers.attention(q, k, v, np.arange(20)), rtol=1e-4, atol=1e-5)

