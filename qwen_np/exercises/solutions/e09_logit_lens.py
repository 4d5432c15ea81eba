"""Exercise 9 (section 4): the logit lens.

The residual stream after any layer can be read as the model's guess so far: put it through the final
norm and the LM head, as the last layer's output is. Write `lens_logits(stream, norm, eps, lm_head)`: the
logits [N, V] of N residual vectors. Graded on the bundled model's own residual stream against what
`generate --lens` computes (qwen_np.inspection.lens.lens_rows).
"""

from __future__ import annotations

import numpy as np


def lens_logits(stream: np.ndarray, norm: np.ndarray, eps: float, lm_head: np.ndarray) -> np.ndarray:
    """stream [N, D], norm [D], lm_head [V, D] -> logits [N, V]."""
    normed = norm * stream / np.sqrt(np.mean(stream * stream, axis=-1, keepdims=True) + np.float32(eps))
    return normed @ lm_head.T
