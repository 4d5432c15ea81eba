"""Exercise 21 (section 14): speculative decoding's rule, which keeps the target's distribution.

A draft model proposes a token x drawn from its distribution q; the target model, with distribution p,
accepts it with probability min(1, p[x] / q[x]). On a rejection the token is drawn again from the
residual: max(p - q, 0), normalised to sum to 1. Write `acceptance(p, q, x)` and `residual(p, q)`. The
check adds up both paths, sum over x of q[x] * acceptance + P(reject) * residual, and requires exactly p
(what makes speculative decoding lossless: qwen_np.generation.speculative.accept), on random p and q
and where p equals q.
"""

from __future__ import annotations

import numpy as np


def acceptance(p: np.ndarray, q: np.ndarray, x: int) -> float:
    """The probability of keeping the drafted token x."""
    return float(min(1.0, p[x] / q[x]))


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """[V] -> [V]: the distribution a rejected draft's replacement is drawn from."""
    rest = np.maximum(p - q, 0)
    total = rest.sum()
    return rest / total if total > 0 else p      # p == q: nothing is ever rejected; any distribution will do
