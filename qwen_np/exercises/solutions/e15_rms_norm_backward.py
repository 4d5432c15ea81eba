"""Exercise 15 (section 9): RMSNorm's backward pass.

y = w * x * r with r = 1 / sqrt(mean(x^2) + eps) over the last axis. Given dL/dy (d_out), write
`rms_norm_backward(d_out, x, weight, eps)` -> (dL/dx, dL/dw). Careful: r depends on every entry of x, so
dx is not just d_out * w * r. dw sums over every row. Graded with finite differences (in float64) and
against qwen_np.training.gradients.rms_norm_backward.
"""

from __future__ import annotations

import numpy as np


def rms_norm_backward(d_out: np.ndarray, x: np.ndarray, weight: np.ndarray,
                      eps: float) -> tuple[np.ndarray, np.ndarray]:
    """d_out, x [..., n], weight [n] -> (dx [..., n], dw [n])."""
    r = 1 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)                        # [..., 1]
    x_hat = x * r
    g = d_out * weight
    dx = r * g - x_hat * r * np.mean(g * x_hat, axis=-1, keepdims=True)
    return dx, (d_out * x_hat).reshape(-1, x.shape[-1]).sum(axis=0)
