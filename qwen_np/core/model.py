"""Qwen3ForCausalLM in NumPy: the weights, the KV cache, and one forward pass top to bottom.

    token ids [T]
      -> embed_tokens                                   [T, D]
      -> L x decoder layer:
           x = x + attention(input_layernorm(x))       q/k/v proj, per-head q/k RMSNorm, RoPE, GQA
           x = x + swiglu(post_attention_layernorm(x))
                   (a Qwen3-MoE's sparse layer: moe, the top k of E expert SwiGLUs its router picks)
      -> norm                                           [T, D] hidden states (an embedding model's output)
      -> lm_head                                        [T, V] logits at every position

The KV cache (kv_cache.py) keeps the post-RoPE keys and the values of every position seen so far, so
a decode step only computes the new token's q/k/v and attends over the cache instead of re-running
the prompt.

Several sequences run as one batch (`forward_batch`), packed one after another into one [T, D] matrix
(batch.py: the packing, the input checks, each row's adapter; attention runs per sequence).

This is Qwen3 and nothing else; ablations.py holds the model whose layer takes pieces away (the lesson
of config.ABLATION_CHOICES), and `ablations.model_class(config)` picks the one a config asks for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence, cast

import numpy as np

from ..errors import QwenNPError
from ..numbers.numerics import Weight
from . import layers
from .adapters import Adapter
from .batch import Batch, advance, output_rows, pack
from .config import DENSE_MLP, LAYER_MATRICES, LAYER_TENSORS, Qwen3Config
from .kv_cache import KVCache, SequenceCache

# trace(name, value) is called with every intermediate of the forward pass when given (see inspection),
# each under one of these names, in this order (a decoder layer's prefixed "model.layers.{i}."). An ablation's
# layer (ablations.py) notes fewer (no q_norm, k_norm, or gate_proj) or two more (post-norm: post_norm_attn,
# post_norm_mlp).
Trace = layers.Note
LAYER_STEPS = ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.q_norm",
               "self_attn.k_norm", "self_attn.rope_q", "self_attn.rope_k", "self_attn.scores", "self_attn.softmax",
               "self_attn.weighted_sum", "self_attn.o_proj", "residual_attn", "post_attention_layernorm",
               "mlp.gate_proj", "mlp.up_proj", "mlp.act_fn", "mlp.down_proj", "residual_mlp")
TRACE_STEPS = ("model.embed_tokens", *(f"model.layers.{{i}}.{step}" for step in LAYER_STEPS), "model.norm", "lm_head")


@dataclass(kw_only=True)
class LayerWeights:
    """One decoder layer's tensors, named as in the checkpoint (model.layers.{i}.<...>.weight).

    config.LAYER_TENSORS gives each one's checkpoint name and shape ([out, in] for projections;
    q_norm and k_norm are one [Dh] weight shared by every head). In "bf16" memory mode the
    projections are the checkpoint's stored values, memory-mapped (numerics.StoredRows); in "int8"
    mode they are numerics.Int8Rows. The norm weights are always FP32. An ablation's layer lacks what
    it takes away (config.layer_tensors): None for q_norm and k_norm without QK-norm, gate_proj in a GELU MLP.
    """

    input_layernorm: np.ndarray
    q_proj: Weight
    k_proj: Weight
    v_proj: Weight
    q_norm: np.ndarray | None = None
    k_norm: np.ndarray | None = None
    o_proj: Weight
    post_attention_layernorm: np.ndarray
    gate_proj: Weight | None = None
    up_proj: Weight | None = None
    down_proj: Weight | None = None
    # A sparse layer (Qwen3-MoE, config.sparse_layer) has these in the dense MLP's place: the router [E, D]
    # and each expert's (gate_proj, up_proj, down_proj).
    router: Weight | None = None
    experts: list[layers.Expert] | None = None

    def tensor(self, key: str) -> Weight | None:
        """The tensor config.layer_tensors keys as `key` (layer_weights' inverse): an attribute, or a sparse layer's
        "experts.{e}.gate_proj" (up_proj, down_proj); None for one the layer lacks."""
        if not key.startswith("experts."):
            return cast(Weight | None, getattr(self, key))
        _, e, kind = key.split(".")
        return self.experts[int(e)][DENSE_MLP.index(kind)] if self.experts is not None else None

    def matrices(self) -> list[Weight]:
        """Every matrix the layer holds: q, k, v, o, then the MLP's (a sparse one's router and experts)."""
        held = [getattr(self, key) for key in LAYER_MATRICES if getattr(self, key) is not None]
        return held + ([self.router] if self.router is not None else []) + [m for e in self.experts or [] for m in e]


def layer_weights(tensors: dict[str, Weight]) -> LayerWeights:
    """A layer's LayerWeights from its tensors keyed as config.layer_tensors keys them (a sparse layer's experts
    as "experts.{e}.gate_proj", ...: gathered into the list of experts, in order)."""
    own: dict[str, Any] = {key: value for key, value in tensors.items() if not key.startswith("experts.")}
    count = sum(key.endswith(".gate_proj") for key in tensors if key.startswith("experts."))
    experts = [cast(layers.Expert, tuple(tensors[f"experts.{e}.{key}"] for key in DENSE_MLP)) for e in range(count)]
    return LayerWeights(**own, experts=experts or None)


class Qwen3LayerWeights(LayerWeights):
    """LayerWeights as Qwen3's layer reads them (the type alone: Qwen3Model checks that its layers hold every
    tensor of config.LAYER_TENSORS when it is built; only an ablation's layer lacks some)."""

    q_norm: np.ndarray
    k_norm: np.ndarray
    gate_proj: Weight
    up_proj: Weight
    down_proj: Weight


class Qwen3Model:
    """A loaded Qwen3 checkpoint. `forward` maps token ids to logits, optionally through a KVCache.

    This is the readable path: every step a plain call into layers.py. fast.FastQwen3Model is the
    same network with a forward arranged for speed (load_model's default; `fast` tells them apart).
    """

    fast = False
    ablated = False       # whether the class computes config.ablations (ablations.AblatedModel's does)

    def __init__(self, config: Qwen3Config, embed_tokens: Weight, decoder_layers: list[LayerWeights],
                 norm: np.ndarray, lm_head: Weight | None, plan: Any = None) -> None:
        if config.ablations and not self.ablated:       # else it would run Qwen3's layer on an ablation's weights
            raise QwenNPError(f"{type(self).__name__} computes Qwen3 only, not the ablation {config.ablations}: "
                              "build it with core.ablations.model_class(config)")
        lacking = [f"layer {i}'s {key}" for i, layer in enumerate(decoder_layers) for key in LAYER_TENSORS
                   if not self.ablated and getattr(layer, key) is None
                   and not (config.sparse_layer(i) and key in DENSE_MLP)]
        if lacking:                                      # what Qwen3LayerWeights promises Qwen3's layer
            raise QwenNPError(f"a Qwen3 layer holds every tensor of config.LAYER_TENSORS; missing {lacking[0]}")
        misplaced = [i for i, layer in enumerate(decoder_layers)
                     if config.sparse_layer(i) != (layer.router is not None and len(layer.experts or []) == config.num_experts)]
        if misplaced:
            raise QwenNPError(f"layer {misplaced[0]}: config.sparse_layer says {config.sparse_layer(misplaced[0])}; a sparse "
                              f"layer holds a router and {config.num_experts} experts, a dense one neither")
        self.config = config
        self.embed_tokens = embed_tokens      # [V, D]
        self.layers = decoder_layers          # L x LayerWeights
        self.norm = norm                      # [D]
        # [V, D]; the same array as embed_tokens when tied; None for a checkpoint without one (an embedding
        # model such as Qwen3-Embedding: a bare Qwen3Model), which only runs with head=False.
        self._lm_head = lm_head
        # How load_model holds the weights (memory.MemoryPlan; None for a model built by hand). The network never
        # reads it, so it is typed loosely: the network does not import the planner above it.
        self.plan = plan
        self.inv_freq, self.rope_scale = rope_frequencies(config)        # [Dh/2], and cos/sin's factor

    @property
    def lm_head(self) -> Weight:
        """The LM head [V, D]; raises for a checkpoint without one (has_head)."""
        if self._lm_head is None:
            raise QwenNPError("forward: this checkpoint has no LM head (lm_head.weight; an embedding model such as "
                              "Qwen3-Embedding): it gives embeddings (qwen_np.embed), not next-token logits")
        return self._lm_head

    @property
    def has_head(self) -> bool:
        return self._lm_head is not None

    def new_cache(self, max_tokens: int, dtype: str = "fp32") -> SequenceCache:
        """An empty KV cache for up to `max_tokens` positions, stored as `dtype` (kv_cache.KV_DTYPES)."""
        return KVCache(self.config, max_tokens, dtype)

    def forward(self, token_ids: Sequence[int] | np.ndarray, cache: SequenceCache | None = None,
                trace: Trace | None = None, last_only: bool = False) -> np.ndarray:
        """Logits [T, V] (FP32) for every position of `token_ids`; [1, V] for the last one if `last_only`.

        Without a cache the tokens are a whole sequence starting at position 0. With a cache they
        continue after the cache's `length` positions, and their keys/values are appended to it.
        last_only: generation needs only the next token's logits; the LM head ([V, D], a quarter of
        Qwen3-0.6B's weights) then multiplies one row instead of T.
        """
        return self.forward_batch([token_ids], [cache], trace, last_only)

    def forward_batch(self, token_ids: Sequence[Sequence[int] | np.ndarray], caches: Sequence[SequenceCache | None],
                      trace: Trace | None = None, last_only: bool = False,
                      tails: Sequence[int] | None = None, head: bool = True,
                      adapters: Sequence[Adapter | None] | None = None) -> np.ndarray:
        """`forward` for B sequences at once: sequence b's tokens continue caches[b] (or start at
        position 0 when it is None). Logits [T, V] for the T tokens of all sequences, one sequence
        after another; with `last_only`, [B, V]: each sequence's last position; with `tails`, the last
        tails[b] positions of each sequence b, one after another (a speculative row verifies several).
        head=False: the final norm's output [..., D] at those positions instead of logits, the LM head
        left out (what an embedding model such as Qwen3-Embedding gives). adapters: sequence b's LoRA
        adapter (None: the base model), each sequence's own in the same pass (Batch.layer_weights).

        Each sequence gets the logits it would get alone (up to the rounding of BLAS sums).
        """
        head_weight = self.lm_head if head else None       # raises now, before any work, if there is none
        batch = self.pack(token_ids, caches, adapters)
        t = Notes(trace or layers.ignore, "")

        x = t("model.embed_tokens", layers.embed(batch.ids, self.embed_tokens))         # [T, D]
        for i in range(len(self.layers)):
            x = self.decoder_layer(i, x, batch, trace or layers.ignore)                  # [T, D]
        x = t("model.norm", layers.rms_norm(x, self.norm, self.config.rms_norm_eps))    # [T, D]
        picked = output_rows(batch.rows, last_only, tails)  # the rows whose logits are asked for (None: all)
        if picked is not None:
            x = x[picked]                                                              # [B, D] or [sum(tails), D]
        advance(caches, batch.ids, batch.rows)
        if head_weight is None:                             # head=False: the final norm's output [T, D]
            return x
        logits = t("lm_head", layers.linear(x, head_weight))                           # [T, V]
        return logits

    def decoder_layer(self, i: int, x: np.ndarray, batch: Batch, note: Trace) -> np.ndarray:
        """Layer i: x + attention(input_layernorm(x)), then + mlp(post_attention_layernorm(x)).

        [T, D] -> [T, D]. x holds the packed tokens of `batch` (positions, RoPE tables, caches);
        `note` sees every step, named as LAYER_STEPS. The one place Qwen3's layer is written: the
        precision lab rounds its input, training recomputes it in the backward, the inspection
        steps point at its lines. (ablations.AblatedModel's layer takes pieces of it away.)"""
        c, eps, t = self.config, self.config.rms_norm_eps, Notes(note, f"model.layers.{i}.")
        w = self.weights(i, batch)                  # with each row's own adapter, if any
        H, KVH, Dh = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        # --- self-attention block ---
        h = t("input_layernorm", layers.rms_norm(x, w.input_layernorm, eps))          # [T, D]
        q = t("self_attn.q_proj", layers.linear(h, w.q_proj).reshape(-1, H, Dh))     # [T, H, Dh]
        k = t("self_attn.k_proj", layers.linear(h, w.k_proj).reshape(-1, KVH, Dh))   # [T, KVH, Dh]
        v = t("self_attn.v_proj", layers.linear(h, w.v_proj).reshape(-1, KVH, Dh))   # [T, KVH, Dh]
        q = t("self_attn.q_norm", layers.rms_norm(q, w.q_norm, eps))   # per head, BEFORE RoPE
        k = t("self_attn.k_norm", layers.rms_norm(k, w.k_norm, eps))   # v gets no norm
        q = t("self_attn.rope_q", layers.rope(q, batch.cos, batch.sin))             # [T, H, Dh]
        k = t("self_attn.rope_k", layers.rope(k, batch.cos, batch.sin))             # [T, KVH, Dh]
        mixed = t("self_attn.weighted_sum", batch.attention(i, q, k, v, t.inside("self_attn.")))
        x = t("residual_attn", x + t("self_attn.o_proj", layers.linear(mixed, w.o_proj)))  # [T, D]
        # --- MLP block ---
        h = t("post_attention_layernorm", layers.rms_norm(x, w.post_attention_layernorm, eps))
        x = t("residual_mlp", x + t("mlp.down_proj", self.mlp(h, w, t.inside("mlp."))))   # [T, D]
        return x

    def weights(self, i: int, batch: Batch) -> Qwen3LayerWeights:
        """Layer i's weights as the batch's rows see them (Batch.layer_weights): every tensor of
        config.LAYER_TENSORS, as __init__ checked."""
        return cast(Qwen3LayerWeights, batch.layer_weights(i, self.layers[i]))

    def mlp(self, h: np.ndarray, w: Qwen3LayerWeights, note: Trace) -> np.ndarray:
        """The layer's MLP: SwiGLU, down(silu(gate(h)) * up(h)), or in a sparse layer of Qwen3-MoE the mixture of
        experts (each token through the few experts its router picks).  [T, D] -> [T, D]. `note` sees gate_proj,
        up_proj and act_fn (a sparse layer: the router's logits, "gate")."""
        if w.router is not None and w.experts is not None:
            return layers.moe(h, w.router, w.experts, self.config.num_experts_per_tok, self.config.norm_topk_prob, note)
        return layers.swiglu(h, w.gate_proj, w.up_proj, w.down_proj, note)

    def pack(self, token_ids: Sequence[Sequence[int] | np.ndarray], caches: Sequence[SequenceCache | None],
             adapters: Sequence[Adapter | None] | None = None) -> Batch:
        """The sequences as one Batch for this model's vocabulary and RoPE frequencies (batch.pack)."""
        return pack(token_ids, caches, adapters, self.config.vocab_size, self.inv_freq, self.rope_scale)


def rope_frequencies(config: Qwen3Config) -> tuple[np.ndarray, float]:
    """RoPE's inverse frequencies [Dh/2] and the factor its cos and sin tables are multiplied by: Qwen3's own
    RoPE (factor 1), or YaRN's when config.json asks for it (config.Yarn)."""
    yarn = config.rope_scaling
    if yarn is None:
        return layers.rope_inverse_frequencies(config.head_dim, config.rope_theta), 1.0
    return layers.yarn_inverse_frequencies(config.head_dim, config.rope_theta, yarn.factor,
                                           yarn.original_max_position_embeddings, yarn.beta_fast, yarn.beta_slow,
                                           yarn.truncate), yarn.attention_factor


class Notes:
    """A trace's note under a name prefix that hands the value back, so that a step and its report are
    one line: `h = t("input_layernorm", layers.rms_norm(x, ...))`. Untraced, note is layers.ignore."""

    def __init__(self, note: Trace, prefix: str) -> None:
        self.note, self.prefix = note, prefix

    def __call__(self, step: str, value: np.ndarray) -> np.ndarray:
        self.note(self.prefix + step, value)
        return value

    def inside(self, scope: str) -> Trace:
        """The note for a function of layers.py that reports its own steps ("scores" in "self_attn.")."""
        if self.note is layers.ignore:
            return layers.ignore
        prefix = self.prefix + scope
        return lambda step, value: self.note(prefix + step, value)
