"""The fast path's mixture-of-experts block (Qwen3-MoE's sparse layers): layers.moe with fast.linear's products.

A token runs through only the experts its router picks, so a decode step reads K of E experts' weights
(Qwen3-30B-A3B: 8 of 128 a layer), not all of them. The tokens of a call (a prompt, a batch's decode step,
a speculative verify) routed to one expert are gathered into one [n, D] matrix and share one product per
weight, as vLLM's fused MoE groups them; each expert's output is weighted and added back to its tokens' rows.
The same routing (layers.route) and the same order of sums (expert by expert) as the readable block.

The threads share out whole experts, not the rows of each product: an expert's matrices are small
([768, 2048] in Qwen3-30B-A3B), and splitting each of a decode step's 1152 products between two threads cost
a hand-off per product (~0.1 ms each) on work of ~1 ms. Each thread takes the next expert as it finishes one
(a busy core then takes fewer), runs its SwiGLU on one core into that expert's rows of one output buffer, and
the weighted sum into `out` is done afterwards, in expert order, on the calling thread.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from . import runtime
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
    # The T*K (token, pick) pairs sorted by expert, stably: expert e's tokens are tokens[starts[e]:starts[e + 1]],
    # in token order. No np.unique / nonzero per expert: one argsort of T*K indices (8 at decode).
    by_expert = np.argsort(chosen, axis=None, kind="stable")                             # [T*K]
    tokens, picked = by_expert // top_k, weights.reshape(-1)[by_expert]                  # [T*K] each
    starts = np.searchsorted(chosen.reshape(-1)[by_expert], np.arange(len(experts) + 1))  # [E + 1]
    used = np.flatnonzero(np.diff(starts)).tolist()                                      # experts with tokens
    y = np.empty((T * top_k, D), np.float32)                          # each pair's expert output, by expert

    def run(e: int) -> None:
        rows = slice(starts[e], starts[e + 1])
        x = h[tokens[rows]]                                                               # [n, D] gathered
        gate_proj, up_proj, down_proj = experts[e]
        gate = linear(x, gate_proj, np.empty((len(x), gate_proj.shape[0]), np.float32))  # [n, Fe]
        up = linear(x, up_proj, np.empty_like(gate))
        linear(layers.silu(gate) * up, down_proj, y[rows])                                # [n, D]

    runtime.take_turns(run, used)
    out[...] = 0
    for e in used:                                                    # expert order, as layers.moe sums
        rows = slice(starts[e], starts[e + 1])
        out[tokens[rows]] += picked[rows, None] * y[rows]
