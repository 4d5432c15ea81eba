"""Exercise 22 (section 15): pass@k, without bias.

`eval --prompts --samples n` draws n replies to each prompt; c of them are right. pass@k is the chance that
at least one of k replies is right: drawing k of the n without replacement, 1 - C(n - c, k) / C(n, k) (Chen et
al. 2021), which is 1 when fewer than k are wrong. Write `pass_at_k(n, c, k)`; n may be in the thousands, where
the binomials overflow a float: write their ratio as a product. Graded against
qwen_np.training.rollouts.pass_at_k.
"""

from __future__ import annotations

import math


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k): the ratio is the product over i from n - c + 1 to n of (1 - k / i)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))
