"""Exercise 6 (section 3.7): rotary position embedding.

Write `rope(x, positions, theta)`: rotate each head's vector by its position. The pair of dimensions
(i, i + Dh/2) turns by the angle position * inv_freq[i], inv_freq[i] = theta^(-2i/Dh) for i < Dh/2 (Qwen3's
half-split layout; not the interleaved pairs (2i, 2i+1)). x is [T, heads, Dh], positions [T] (any
positions: a decode step starts far from 0). Graded against qwen_np.core.layers.rope with
rope_inverse_frequencies and rope_angles, at odd positions and two thetas.
"""

from __future__ import annotations

import numpy as np


def rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """x [T, heads, Dh], positions [T] -> [T, heads, Dh], each pair (i, i + Dh/2) rotated."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (np.arange(half, dtype=np.float64) * 2 / x.shape[-1])       # [Dh/2]
    angles = positions.astype(np.float64)[:, None] * inv_freq                               # [T, Dh/2]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]                       # [T, 1, Dh/2]
    first, second = x[..., :half], x[..., half:]
    return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1).astype(np.float32)
