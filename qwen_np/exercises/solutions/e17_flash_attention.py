"""Exercise 17 (section 10): FlashAttention's online softmax.

Write `flash_attention(q, k, v, q_positions, block)`: exercise 7's causal GQA attention, but reading the keys
`block` at a time and never holding more than one block of scores. Keep, per query row, the running max m,
the running sum l of exp(score - m) and the running sum acc of exp(score - m) * value; when a block brings a
larger max m', scale l and acc by exp(m - m') first. At the end, acc / l. Graded against
qwen_np.core.layers.attention at block sizes 1, 5 (not dividing S) and S, with GQA.
"""

from __future__ import annotations

import numpy as np


def flash_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_positions: np.ndarray,
                    block: int) -> np.ndarray:
    """q [T, H, Dh], k/v [S, KVH, Dh], q_positions [T] -> [T, H * Dh], one block of keys at a time."""
    T, H, Dh = q.shape
    group = H // k.shape[1]
    m = np.full((H, T, 1), -np.inf)
    total = np.zeros((H, T, 1))
    acc = np.zeros((H, T, Dh))
    for start in range(0, k.shape[0], block):
        stop = min(start + block, k.shape[0])
        kb, vb = np.repeat(k[start:stop], group, axis=1), np.repeat(v[start:stop], group, axis=1)   # [b, H, Dh]
        scores = np.einsum("thd,bhd->htb", q, kb) / np.sqrt(Dh)                                    # [H, T, b]
        scores = np.where(np.arange(start, stop)[None, :] > q_positions[:, None], -np.inf, scores)
        new_m = np.maximum(m, scores.max(axis=-1, keepdims=True))
        shift = np.where(np.isfinite(new_m), new_m, 0.0)           # a row with no key yet: nothing to rescale
        p = np.exp(scores - shift)
        rescale = np.exp(m - shift)
        total = total * rescale + p.sum(axis=-1, keepdims=True)
        acc = acc * rescale + np.einsum("htb,bhd->htd", p, vb)
        m = new_m
    return np.swapaxes(acc / total, 0, 1).reshape(T, H * Dh).astype(np.float32)
