"""Exercise 20 (section 13): a LoRA adapter.

LoRA leaves W [out, in] frozen and learns A [r, in] and B [out, r]: the layer computes
x W^T + (alpha / r) (x A^T) B^T, never forming B A. Write `lora_linear(x, w, a, b, alpha)` and
`merged(w, a, b, alpha)`: the weight that computes the same with no adapter (what merging writes into the
checkpoint). Graded against qwen_np.core.layers.linear with the adapted weight (numerics.Adapted) at
ranks 1, 2 and 8.
"""

from __future__ import annotations

import numpy as np


def lora_linear(x: np.ndarray, w: np.ndarray, a: np.ndarray, b: np.ndarray, alpha: float) -> np.ndarray:
    """x [T, in], w [out, in], a [r, in], b [out, r] -> [T, out]."""
    return x @ w.T + (alpha / a.shape[0]) * ((x @ a.T) @ b.T)


def merged(w: np.ndarray, a: np.ndarray, b: np.ndarray, alpha: float) -> np.ndarray:
    """The [out, in] weight W + (alpha / r) B A."""
    return w + (alpha / a.shape[0]) * (b @ a)
