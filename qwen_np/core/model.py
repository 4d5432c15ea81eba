"""Qwen3ForCausalLM in NumPy: the weights, the KV cache, and one forward pass top to bottom.

    token ids [T]
      -> embed_tokens                                   [T, D]
      -> L x decoder layer:
           x = x + attention(input_layernorm(x))       q/k/v proj, per-head q/k RMSNorm, RoPE, GQA
           x = x + swiglu(post_attention_layernorm(x))
      -> norm                                           [T, D] hidden states (an embedding model's output)
      -> lm_head                                        [T, V] logits at every position

The KV cache (kv_cache.py) keeps the post-RoPE keys and the values of every position seen so far, so
a decode step only computes the new token's q/k/v and attends over the cache instead of re-running
the prompt.

Several sequences run as one batch (`forward_batch`), each with its own cache, length and positions.
Every step but attention treats tokens one at a time, so the batch's tokens are packed one sequence
after another into one [T, D] matrix: each weight is read once for all of them, which is why a
memory-bound decode step for 8 sequences costs little more than one for a single sequence. Only
attention looks across tokens, and it runs per sequence, over that sequence's own keys: there is no
padding, so nothing can attend to another sequence's tokens or to padding.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import numpy as np

from ..errors import QwenNPError
from ..numbers.numerics import RowAdapters, Weight
from . import layers
from .adapters import Adapter
from .config import LAYER_MATRICES, Qwen3Config
from .kv_cache import KVCache, SequenceCache

# trace(name, value) is called with every intermediate of the forward pass when given (see inspection),
# each under one of these names, in this order (a decoder layer's prefixed "model.layers.{i}."). An ablation's
# layer notes fewer (no q_norm, k_norm, or gate_proj) or two more (post-norm: post_norm_attn, post_norm_mlp).
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
    up_proj: Weight
    down_proj: Weight


class Qwen3Model:
    """A loaded Qwen3 checkpoint. `forward` maps token ids to logits, optionally through a KVCache.

    This is the readable path: every step a plain call into layers.py. fast.FastQwen3Model is the
    same network with a forward arranged for speed (load_model's default; `fast` tells them apart).
    """

    fast = False

    def __init__(self, config: Qwen3Config, embed_tokens: Weight, decoder_layers: list[LayerWeights],
                 norm: np.ndarray, lm_head: Weight | None, plan: Any = None) -> None:
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
        self.inv_freq = layers.rope_inverse_frequencies(config.head_dim, config.rope_theta)   # [Dh/2]

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
        """Layer i: x + attention(input_layernorm(x)), then + mlp(post_attention_layernorm(x)).  [T, D] -> [T, D].

        x holds the packed tokens of `batch` (their positions, RoPE tables and caches); `note` sees every
        step, named as LAYER_STEPS. The one place a decoder layer is written: the precision lab rounds its
        input, training recomputes it in the backward, the inspection steps point at its lines.
        The ablations (config.ABLATION_CHOICES) are one-line choices beside the steps they change: `pre`,
        `c.use_rope`, `c.use_residual`, and the weights an ablated layer lacks (q_norm, gate_proj). A step taken
        away notes its input unchanged (QK-norm's and the gate's are not noted). Qwen3 runs every piece."""
        c, eps, t = self.config, self.config.rms_norm_eps, Notes(note, f"model.layers.{i}.")
        w = batch.layer_weights(i, self.layers[i])        # with each row's own adapter, if any asks for one
        H, KVH, Dh = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        pre = c.norm_position == "pre"               # ablation: "post" normalizes after each residual sum instead
        # --- self-attention block ---
        h = t("input_layernorm", layers.rms_norm(x, w.input_layernorm, eps) if pre else x)         # [T, D]
        q = t("self_attn.q_proj", layers.linear(h, w.q_proj).reshape(-1, H, Dh))                  # [T, H, Dh]
        k = t("self_attn.k_proj", layers.linear(h, w.k_proj).reshape(-1, KVH, Dh))                # [T, KVH, Dh]
        v = t("self_attn.v_proj", layers.linear(h, w.v_proj).reshape(-1, KVH, Dh))                # [T, KVH, Dh]
        if w.q_norm is not None and w.k_norm is not None:                 # ablation: use_qk_norm=false has neither
            q = t("self_attn.q_norm", layers.rms_norm(q, w.q_norm, eps))  # per head, over Dh, BEFORE RoPE
            k = t("self_attn.k_norm", layers.rms_norm(k, w.k_norm, eps))  # v gets no norm
        q = t("self_attn.rope_q", layers.rope(q, batch.cos, batch.sin) if c.use_rope else q)     # [T, H, Dh]
        k = t("self_attn.rope_k", layers.rope(k, batch.cos, batch.sin) if c.use_rope else k)     # [T, KVH, Dh]
        mixed = t("self_attn.weighted_sum", batch.attention(i, q, k, v, t.inside("self_attn.")))  # [T, H*Dh]
        attn_out = t("self_attn.o_proj", layers.linear(mixed, w.o_proj))                          # [T, D]
        x = t("residual_attn", x + attn_out if c.use_residual else attn_out)   # ablation: no residual, replaced
        x = x if pre else t("post_norm_attn", layers.rms_norm(x, w.input_layernorm, eps))        # ablation: post-norm
        # --- MLP block (SwiGLU) ---
        h = t("post_attention_layernorm", layers.rms_norm(x, w.post_attention_layernorm, eps) if pre else x)  # [T, D]
        if w.gate_proj is None:                                            # ablation: mlp_type "gelu"
            mlp_out = t("mlp.down_proj", layers.gelu_mlp(h, w.up_proj, w.down_proj, t.inside("mlp.")))          # [T, D]
        else:
            mlp_out = t("mlp.down_proj", layers.swiglu(h, w.gate_proj, w.up_proj, w.down_proj, t.inside("mlp.")))  # [T, D]
        x = t("residual_mlp", x + mlp_out if c.use_residual else mlp_out)
        return x if pre else t("post_norm_mlp", layers.rms_norm(x, w.post_attention_layernorm, eps))

    def pack(self, token_ids: Sequence[Sequence[int] | np.ndarray], caches: Sequence[SequenceCache | None],
             adapters: Sequence[Adapter | None] | None = None) -> Batch:
        """The sequences' checked ids, one sequence after another, as a Batch (with each one's adapter); their
        caches reserve room for them (every row checked first: nothing half-done)."""
        if len(token_ids) != len(caches) or not token_ids or (adapters is not None and len(adapters) != len(caches)):
            raise QwenNPError(f"forward_batch: {len(token_ids)} sequences of token ids for {len(caches)} caches"
                              + (f" and {len(adapters)} adapters" if adapters is not None else ""))
        held = [id(cache) for cache in caches if cache is not None]
        if len(set(held)) < len(held):
            raise QwenNPError("forward_batch: the same KV cache is given for two sequences")
        ids = [self._check_ids(one) for one in token_ids]
        starts = [cache.length if cache is not None else 0 for cache in caches]
        for one, start, cache in zip(ids, starts, caches):
            if cache is not None and start + len(one) > cache.max_tokens:
                raise QwenNPError(f"cache: {start} cached + {len(one)} new tokens exceed its {cache.max_tokens} positions")
        for one, cache in zip(ids, caches):
            if cache is not None:
                cache.reserve(len(one))
        ends = np.cumsum([len(one) for one in ids]).tolist()
        positions = np.concatenate([np.arange(start, start + len(one)) for one, start in zip(ids, starts)])
        cos, sin = layers.rope_angles(self.inv_freq, positions)                          # [T, Dh] each
        rows = [slice(end - len(one), end) for end, one in zip(ends, ids)]
        return Batch(np.concatenate(ids), positions, rows, list(caches), cos, sin,
                     adapter_rows(rows, adapters or [None] * len(rows)))

    def _check_ids(self, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        return check_token_ids(token_ids, self.config.vocab_size)


def check_token_ids(token_ids: Sequence[int] | np.ndarray, vocab_size: int, name: str = "token_ids") -> np.ndarray:
    """The ids as an int64 array [T], if they are a non-empty 1-D sequence of integers in [0, vocab_size): the
    one check, for a forward pass and for a request before it joins a batch (whose forward pass a bad id would
    fail for every row). `name`: the parameter they came in, for the error."""
    ids = np.asarray(token_ids)
    # bool is an int in Python, and an array of them would index the embedding table as a mask.
    if (ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer)
            or (not isinstance(token_ids, np.ndarray) and any(isinstance(t, (bool, np.bool_)) for t in token_ids))):
        raise QwenNPError(f"{name}: expected a non-empty 1-D sequence of integers, got shape {ids.shape} {ids.dtype}")
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise QwenNPError(f"{name}: id {int(bad[0])} is outside the vocabulary [0, {vocab_size})")
    return ids.astype(np.int64)


def output_rows(rows: list[slice], last_only: bool, tails: Sequence[int] | None) -> list[int] | None:
    """The packed rows whose logits a forward_batch call returns (None: all): each sequence's last
    tails[b] rows, or its last one with last_only."""
    if tails is None:
        return [row.stop - 1 for row in rows] if last_only else None
    if len(tails) != len(rows) or not all(1 <= tail <= row.stop - row.start for tail, row in zip(tails, rows)):
        raise QwenNPError(f"forward_batch: tails {list(tails)} do not fit sequences of {[r.stop - r.start for r in rows]} tokens")
    return [i for tail, row in zip(tails, rows) for i in range(row.stop - tail, row.stop)]


def adapter_rows(rows: list[slice], adapters: Sequence[Adapter | None]) -> list[tuple[Adapter, slice | np.ndarray]]:
    """Each adapter that sequences ask for (in first-asked order), with the packed rows of all its sequences: a
    slice where they are consecutive (x[rows] is then a view, not a copy of a prompt's rows), else their indices [n]."""
    grouped: dict[int, tuple[Adapter, list[np.ndarray]]] = {}
    for row, adapter in zip(rows, adapters):
        if adapter is not None:
            grouped.setdefault(id(adapter), (adapter, []))[1].append(np.arange(row.start, row.stop))
    found: list[tuple[Adapter, slice | np.ndarray]] = []
    for adapter, parts in grouped.values():
        indices = np.concatenate(parts)                              # ascending: the sequences are packed in order
        consecutive = int(indices[-1]) - int(indices[0]) + 1 == len(indices)
        found.append((adapter, slice(int(indices[0]), int(indices[-1]) + 1) if consecutive else indices))
    return found


def advance(caches: Sequence[SequenceCache | None], ids: np.ndarray, rows: list[slice]) -> None:
    """After a forward pass: each cache counts its sequence's tokens (ids[rows[b]]) as held."""
    for row, cache in zip(rows, caches):
        if cache is not None:
            cache.advance(ids[row])


@dataclass
class Batch:
    """The tokens of forward_batch's sequences packed one after another: T rows, rows[b] sequence b's."""

    ids: np.ndarray                           # [T] token ids
    positions: np.ndarray                     # [T] each token's position in its own sequence
    rows: list[slice]                         # B slices of the T rows
    caches: list[SequenceCache | None]        # B caches (None: a sequence from position 0, not kept)
    cos: np.ndarray                           # [T, Dh] RoPE tables at those positions
    sin: np.ndarray                           # [T, Dh]
    # Each LoRA adapter the batch's sequences ask for, with the packed rows of those sequences (adapter_rows).
    adapters: list[tuple[Adapter, slice | np.ndarray]] = field(default_factory=list)

    def layer_weights(self, i: int, weights: LayerWeights) -> LayerWeights:
        """Layer i's weights as this batch's rows see them: the layer's own when no row asks for an adapter;
        else each projection some adapter of the batch adapts is a numerics.RowAdapters, its base once for
        every row and each adapter's rank-r update on that adapter's rows only."""
        if not self.adapters:
            return weights
        adapted: dict[str, Any] = {}                      # projection key -> its RowAdapters
        for key in LAYER_MATRICES:
            base = getattr(weights, key)
            groups = tuple((rows, one) for adapter, rows in self.adapters
                           if (one := adapter.adapted(i, key, base)) is not None)
            if groups:
                adapted[key] = RowAdapters(base, groups)
        return replace(weights, **adapted)

    def attention(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, note: Trace) -> np.ndarray:
        """Each sequence attends over its own keys only: its cached ones and these.  q [T, H, Dh],
        k/v [T, KVH, Dh] -> [T, H*Dh]. Appends this layer's k, v to each sequence's cache."""
        heads = []
        for row, cache in zip(self.rows, self.caches):
            keys, values = (k[row], v[row]) if cache is None else cache.append(layer, k[row], v[row])  # [S, KVH, Dh]
            heads.append(layers.attention(q[row], keys, values, self.positions[row], note))
        return np.concatenate(heads)                                                   # [T, H*Dh]


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
