"""Exercise 23 (section 16): your pieces assembled into Qwen3.

Write `decoder_layer(x, layer, config, positions)` out of your own functions of exercises 4, 6, 7 and 8
(run `exercises start` for each first; this file imports them from its folder): h = rms_norm(x); q, k, v
projected (q_proj [H * Dh, D] applied as h @ W.T, then reshaped to [T, H, Dh]); q_norm and k_norm per head;
RoPE on q and k; causal GQA attention; o_proj; the residual x + ...; then rms_norm, your SwiGLU and the
second residual. `layer` has the checkpoint's names: layer.input_layernorm, layer.q_proj, ..., layer.down_proj
(numpy arrays). The check runs a tiny random Qwen3 (GQA, 2 layers) with your layer in place of its own and
requires the same logits as qwen_np.Qwen3Model.forward.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from qwen_np.exercises.solutions.e04_rms_norm import rms_norm
from qwen_np.exercises.solutions.e06_rope import rope
from qwen_np.exercises.solutions.e07_attention import attention
from qwen_np.exercises.solutions.e08_swiglu import swiglu


def decoder_layer(x: np.ndarray, layer: Any, config: Any, positions: np.ndarray) -> np.ndarray:
    """x [T, D] at positions [T] -> [T, D]: one Qwen3 decoder layer."""
    eps, H, KVH, Dh = config.rms_norm_eps, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    h = rms_norm(x, layer.input_layernorm, eps)
    q = rms_norm((h @ layer.q_proj.T).reshape(-1, H, Dh), layer.q_norm, eps)
    k = rms_norm((h @ layer.k_proj.T).reshape(-1, KVH, Dh), layer.k_norm, eps)
    v = (h @ layer.v_proj.T).reshape(-1, KVH, Dh)
    q, k = rope(q, positions, config.rope_theta), rope(k, positions, config.rope_theta)
    x = x + attention(q, k, v, positions) @ layer.o_proj.T
    h = rms_norm(x, layer.post_attention_layernorm, eps)
    return x + swiglu(h, layer.gate_proj, layer.up_proj, layer.down_proj)
