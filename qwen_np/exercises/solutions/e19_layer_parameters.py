"""Exercise 19 (section 12): what an ablation changes in a layer's parameters.

Write `layer_parameters(config)`: the parameters of one decoder layer of a qwen_np.Qwen3Config: two D-wide
norms; q_proj [H * Dh, D], k_proj and v_proj [KVH * Dh, D], o_proj [D, H * Dh]; q_norm and k_norm, one [Dh]
weight each, unless config.use_qk_norm is false; the MLP's gate_proj, up_proj [F, D] and down_proj [D, F]
(config.mlp_type "gelu": no gate_proj). Section 12's table counts these: graded against
qwen_np.parameter_count on Qwen3's configs and the ablations' (no QK-norm, GELU, MQA, MHA).
"""

from __future__ import annotations

from typing import Any


def layer_parameters(config: Any) -> int:
    """One decoder layer's parameters."""
    D, H, KVH, Dh, F = (config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                        config.head_dim, config.intermediate_size)
    attention = 2 * H * Dh * D + 2 * KVH * Dh * D + (2 * Dh if config.use_qk_norm else 0)
    mlp = (2 if config.mlp_type == "gelu" else 3) * D * F
    return 2 * D + attention + mlp
