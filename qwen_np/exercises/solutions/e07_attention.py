"""Exercise 7 (section 3.9-3.11): causal grouped-query attention.

Write `attention(q, k, v, q_positions)`: for every query head h, the scores q . k / sqrt(Dh) against every
key of its key head h // (H / KVH); the keys after the query's position masked out (a query at position p
sees keys 0..p); a softmax over the keys; the values mixed by those weights; the heads concatenated,
head-major, into [T, H * Dh]. q is [T, H, Dh], k and v [S, KVH, Dh] with S >= T: the queries are the last
T positions (q_positions, S - T .. S - 1, as a decode step with a KV cache). Graded against
qwen_np.core.layers.attention at GQA ratios 1, 2, 4 and MQA, for a whole prompt and for a few new tokens.
"""

from __future__ import annotations

import numpy as np


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_positions: np.ndarray) -> np.ndarray:
    """q [T, H, Dh], k/v [S, KVH, Dh], q_positions [T] -> [T, H * Dh]."""
    T, H, Dh = q.shape
    group = H // k.shape[1]
    keys, values = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)            # [S, H, Dh]
    scores = np.einsum("thd,shd->hts", q, keys) / np.sqrt(np.float32(Dh))                # [H, T, S]
    future = np.arange(k.shape[0])[None, :] > q_positions[:, None]                       # [T, S]
    scores = np.where(future, -np.inf, scores)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)                                       # [H, T, S]
    return np.einsum("hts,shd->thd", weights, values).reshape(T, H * Dh).astype(np.float32)
