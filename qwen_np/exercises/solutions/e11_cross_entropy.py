"""Exercise 11 (section 5, section 9): softmax cross-entropy and its gradient.

Write `cross_entropy(logits, targets)`: the mean over the B * T positions of -ln softmax(logits)[target],
and its gradient with respect to the logits, (softmax(logits) - onehot(target)) / (B * T). logits [B, T, V],
targets [B, T]. Logits far apart are part of it (a probability too small for FP32 must not become
log(0)). Graded against qwen_np.training.gradients.cross_entropy.
"""

from __future__ import annotations

import numpy as np


def cross_entropy(logits: np.ndarray, targets: np.ndarray) -> tuple[float, np.ndarray]:
    """logits [B, T, V], targets [B, T] -> (mean loss, d_logits [B, T, V])."""
    shifted = logits - logits.max(axis=-1, keepdims=True)                               # [B, T, V], max 0
    exp = np.exp(shifted)
    total = exp.sum(axis=-1, keepdims=True)                                              # [B, T, 1]
    b, t = np.indices(targets.shape)
    # log p = shifted - log(total), never log(p): a p below 1e-38 is 0 in FP32, and its log -inf.
    loss = (np.log(total[..., 0].astype(np.float64)) - shifted[b, t, targets]).mean()
    d_logits = exp / total
    d_logits[b, t, targets] -= 1
    return float(loss), d_logits / targets.size
