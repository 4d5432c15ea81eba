"""The fast path's mixture-of-experts block (Qwen3-MoE's sparse layers): layers.moe with fast.linear's products.

A token runs through only the experts its router picks, so a decode step reads K of E experts' weights
(Qwen3-30B-A3B: 8 of 128 a layer), not all of them. The tokens of a call (a prompt, a batch's decode step,
a speculative verify) routed to one expert are gathered into one [n, D] matrix and share one product per
weight, as vLLM's fused MoE groups them; each expert's output is weighted and added back to its tokens' rows.
The same routing (layers.route) and the same order of sums (expert by expert) as the readable block.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..core import layers
from ..numbers.numerics import Weight

# fast.linear: out = x W^T into `out`, whatever kind holds W (passed in: fast.py imports this module).
Product = Callable[[np.ndarray, Weight, np.ndarray], np.ndarray]


def sparse_mlp(h: np.ndarray, router: Weight, experts: list[layers.Expert], top_k: int, normalize: bool,
               out: np.ndarray, linear: Product) -> None:
    """out = layers.moe(h, ...), each chosen expert's products over the rows of its tokens only.
    h [T, D], out [T, D]."""
    T, D = h.shape
    logits = linear(h, router, np.empty((T, router.shape[0]), np.float32))                 # [T, E]
    chosen, weights = layers.route(logits, top_k, normalize)                              # [T, K] each
    out[...] = 0
    for e in np.unique(chosen):
        tokens, slot = np.nonzero(chosen == e)            # the rows routed to expert e, and which of their k picks
        gate_proj, up_proj, down_proj = experts[e]
        x = h[tokens]                                                                     # [n, D] gathered
        gate = linear(x, gate_proj, np.empty((len(tokens), gate_proj.shape[0]), np.float32))   # [n, Fe]
        up = linear(x, up_proj, np.empty_like(gate))
        act = layers.silu(gate) * up                                                      # [n, Fe]
        y = linear(act, down_proj, np.empty((len(tokens), D), np.float32))                # [n, D]
        out[tokens] += weights[tokens, slot, None] * y
