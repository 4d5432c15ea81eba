"""FlashAttention's idea in NumPy: attention over key blocks with an online softmax.

layers.attention forms every score at once, [..., H, T, S], then its softmax, another [..., H, T, S]:
memory quadratic in the context (training keeps the probabilities for the backward pass, section 10
of the walkthrough). The softmax needs the row's max and sum over ALL keys before any weight is
known, which seems to force that. It does not: read the keys a block at a time and keep, per query
row, the running max m, the running sum l of exp(score - m) and the running weighted sum of values
acc. When a block brings a larger max m', everything gathered so far was scaled by exp(-m) and must
be scaled by exp(-m') instead: multiply l and acc by exp(m - m') (<= 1, so nothing overflows). After
the last block, acc / l is exactly softmax(scores) @ v, up to rounding (the sums are added in
another order). Only one block of scores, [..., H, T, block], ever exists.

On a GPU (Dao et al., 2022) the blocks live in on-chip SRAM and the saving is memory traffic as well
as memory; the backward pass recomputes each block's probabilities from q, k and the kept m and l
instead of storing them. qwen_np's inference and training use layers.attention; this module is
the same result computed the other way, tested equal to it (tests/core/test_flash_attention.py).
"""

from __future__ import annotations

import numpy as np

from .layers import heads_first

# Keys per block: any size gives the same result; a GPU picks what fits its on-chip memory.
KEY_BLOCK = 64


def flash_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_positions: np.ndarray,
                    block: int = KEY_BLOCK) -> np.ndarray:
    """Causal grouped-query attention as layers.attention computes it, one block of keys at a time.

    q [..., T, H, Dh], k/v [..., S, KVH, Dh] (all keys so far), q_positions [T] -> [..., T, H*Dh].
    """
    H, Dh = q.shape[-2:]
    group = H // k.shape[-2]                                            # query heads per key head (GQA)
    qh = heads_first(q)                                                 # [..., H, T, Dh]
    T, S = q.shape[-3], k.shape[-3]
    row_max = np.full((*qh.shape[:-1], 1), -np.inf, dtype=np.float32)   # [..., H, T, 1] running max
    row_sum = np.zeros_like(row_max)                                    # [..., H, T, 1] running sum
    acc = np.zeros(qh.shape, dtype=np.float32)                          # [..., H, T, Dh] running sum of p v
    for start in range(0, S, block):
        keys = slice(start, min(start + block, S))
        # GQA as in layers.attention_scores: query head h reads key head h // group (np.repeat).
        kb = heads_first(np.repeat(k[..., keys, :, :], group, axis=-2)) # [..., H, b, Dh]
        vb = heads_first(np.repeat(v[..., keys, :, :], group, axis=-2)) # [..., H, b, Dh]
        scores = (qh @ np.swapaxes(kb, -1, -2)) * np.float32(Dh ** -0.5)  # [..., H, T, b]
        future = np.arange(start, keys.stop)[None, :] > q_positions[:, None]   # [T, b]
        scores = np.where(future, -np.inf, scores).astype(np.float32, copy=False)
        new_max = np.maximum(row_max, scores.max(axis=-1, keepdims=True))    # [..., H, T, 1]
        # A row whose keys so far are all in its future has new_max = -inf: keep it at zero weight
        # (no -inf - -inf = NaN). Causal rows always see key 0, so by the end every row has a max.
        seen = np.isfinite(new_max)
        shift = np.where(seen, new_max, np.float32(0))
        p = np.exp(scores - shift)                                      # [..., H, T, b], exp(-inf) = 0
        rescale = np.exp(row_max - shift)                               # [..., H, T, 1], the old sums' new scale
        row_sum = row_sum * rescale + p.sum(axis=-1, keepdims=True)
        acc = acc * rescale + p @ vb
        row_max = new_max
    out = acc / row_sum                                                 # [..., H, T, Dh]
    return heads_first(out).reshape(*out.shape[:-3], T, -1)             # [..., T, H*Dh]
