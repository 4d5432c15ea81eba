"""Exercise 5 (section 3.3): which key head each query head reads (grouped-query attention).

With H query heads and KVH < H key/value heads, each key head serves H / KVH query heads, next to each
other: query head h reads key head h // (H / KVH). Write `expand_kv(k, H)`: the keys [S, KVH, Dh] made
into [S, H, Dh], query head h's keys at head h. (np.tile gives head h the key head h % KVH instead: the
same shapes, another model.) Graded by the scores your keys give, against
qwen_np.core.layers.attention_scores, at H / KVH = 1, 2, 4 and H (one key head: MQA).
"""

from __future__ import annotations

import numpy as np


def expand_kv(k: np.ndarray, heads: int) -> np.ndarray:
    """k [S, KVH, Dh] -> [S, H, Dh]: query head h gets key head h // (H / KVH)."""
    return np.repeat(k, heads // k.shape[-2], axis=-2)
