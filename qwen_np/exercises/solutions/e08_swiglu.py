"""Exercise 8 (section 3.15-3.18): the SwiGLU MLP.

Write `swiglu(x, gate_proj, up_proj, down_proj)`: down(silu(gate(x)) * up(x)), where each projection is
a weight [out, in] applied as x @ W.T, and silu(z) = z * sigmoid(z). Graded against
qwen_np.core.layers.swiglu on random weights.
"""

from __future__ import annotations

import numpy as np


def swiglu(x: np.ndarray, gate_proj: np.ndarray, up_proj: np.ndarray, down_proj: np.ndarray) -> np.ndarray:
    """x [T, D], gate_proj and up_proj [F, D], down_proj [D, F] -> [T, D]."""
    gate, up = x @ gate_proj.T, x @ up_proj.T                                            # [T, F]
    return (gate / (1 + np.exp(-gate)) * up) @ down_proj.T
