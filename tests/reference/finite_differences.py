"""The one numerical derivative the backward tests compare with: central differences, entry by entry."""

from __future__ import annotations

from typing import Callable

import numpy as np


def central_difference(f: Callable[[], float], p: np.ndarray, h: float = 1e-6) -> np.ndarray:
    """d f / d p for every entry of p (changed in place and restored): (f(p + h) - f(p - h)) / 2h."""
    numeric = np.empty_like(p)
    for index in np.ndindex(p.shape):
        saved = p[index]
        p[index] = saved + h
        up = f()
        p[index] = saved - h
        down = f()
        p[index] = saved
        numeric[index] = (up - down) / (2 * h)
    return numeric
