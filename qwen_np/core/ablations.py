"""The ablations (config.ABLATION_CHOICES): Qwen3's layer with a piece taken away, to measure what it is for.

A lesson, not Qwen3: model.Qwen3Model.decoder_layer is Qwen3's layer alone, and AblatedModel's layer is the
same steps with each piece an ablation changes made a one-line choice beside it: `pre` (norm_position),
`c.use_rope`, `c.use_residual`, and the weights an ablated layer lacks (q_norm and k_norm without QK-norm,
gate_proj in a GELU MLP). Its notes are Qwen3's (model.LAYER_STEPS), so the trace, the training tape and the
hand-written backward (training/gradients.py, which reverses each choice) read it unchanged; with every
choice at Qwen3's value it computes Qwen3's layer (tests/core/test_ablations.py).

`model_class(config)` is the one place that picks the readable class a config asks for.
"""

from __future__ import annotations

from typing import cast

import numpy as np

from ..numbers.numerics import Weight
from . import layers
from .batch import Batch
from .config import Qwen3Config
from .model import LayerWeights, Notes, Qwen3Model, Trace


class AblatedModel(Qwen3Model):
    """A Qwen3Model whose decoder layer takes away what config.ablations name (any of them, or none)."""

    ablated = True

    def decoder_layer(self, i: int, x: np.ndarray, batch: Batch, note: Trace) -> np.ndarray:
        """Qwen3Model.decoder_layer with the ablations' choices.  [T, D] -> [T, D]. A step taken away notes
        its input unchanged (QK-norm's and the gate's are not noted); post-norm notes post_norm_attn and
        post_norm_mlp, each block's norm after its residual sum."""
        c, eps, t = self.config, self.config.rms_norm_eps, Notes(note, f"model.layers.{i}.")
        w = batch.layer_weights(i, self.layers[i])
        H, KVH, Dh = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        pre = c.norm_position == "pre"                  # "post" normalizes after each residual sum instead
        # --- self-attention block ---
        h = t("input_layernorm", layers.rms_norm(x, w.input_layernorm, eps) if pre else x)     # [T, D]
        q = t("self_attn.q_proj", layers.linear(h, w.q_proj).reshape(-1, H, Dh))              # [T, H, Dh]
        k = t("self_attn.k_proj", layers.linear(h, w.k_proj).reshape(-1, KVH, Dh))            # [T, KVH, Dh]
        v = t("self_attn.v_proj", layers.linear(h, w.v_proj).reshape(-1, KVH, Dh))            # [T, KVH, Dh]
        if w.q_norm is not None and w.k_norm is not None:              # use_qk_norm=false has neither
            q = t("self_attn.q_norm", layers.rms_norm(q, w.q_norm, eps))
            k = t("self_attn.k_norm", layers.rms_norm(k, w.k_norm, eps))
        q = t("self_attn.rope_q", layers.rope(q, batch.cos, batch.sin) if c.use_rope else q)
        k = t("self_attn.rope_k", layers.rope(k, batch.cos, batch.sin) if c.use_rope else k)
        mixed = t("self_attn.weighted_sum", batch.attention(i, q, k, v, t.inside("self_attn.")))
        attn_out = t("self_attn.o_proj", layers.linear(mixed, w.o_proj))                      # [T, D]
        x = t("residual_attn", x + attn_out if c.use_residual else attn_out)  # no residual: replaced
        x = x if pre else t("post_norm_attn", layers.rms_norm(x, w.input_layernorm, eps))
        # --- MLP block ---
        h = t("post_attention_layernorm", layers.rms_norm(x, w.post_attention_layernorm, eps) if pre else x)
        mlp_out = t("mlp.down_proj", self.mlp(h, w, t.inside("mlp.")))                        # [T, D]
        x = t("residual_mlp", x + mlp_out if c.use_residual else mlp_out)
        return x if pre else t("post_norm_mlp", layers.rms_norm(x, w.post_attention_layernorm, eps))

    def mlp(self, h: np.ndarray, w: LayerWeights, note: Trace) -> np.ndarray:
        """Qwen3's SwiGLU, or in a GELU MLP (mlp_type "gelu", no gate_proj) down(gelu(up(h))).  [T, D] -> [T, D]."""
        up, down = cast(Weight, w.up_proj), cast(Weight, w.down_proj)     # an ablation's layer is dense (config)
        if w.gate_proj is None:
            return layers.gelu_mlp(h, up, down, note)
        return layers.swiglu(h, w.gate_proj, up, down, note)


def model_class(config: Qwen3Config) -> type[Qwen3Model]:
    """The readable model that computes `config`: Qwen3Model, or AblatedModel when it asks for an ablation."""
    return AblatedModel if config.ablations else Qwen3Model
