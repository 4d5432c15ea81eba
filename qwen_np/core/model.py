"""Qwen3ForCausalLM in NumPy: the weights, the KV cache, and one forward pass top to bottom.

    token ids [T]
      -> embed_tokens                                   [T, D]
      -> L x decoder layer:
           x = x + attention(input_layernorm(x))       q/k/v proj, per-head q/k RMSNorm, RoPE, GQA
           x = x + swiglu(post_attention_layernorm(x))
      -> norm                                           [T, D] hidden states (an embedding model's output)
      -> lm_head                                        [T, V] logits at every position

The KV cache keeps the post-RoPE keys and the values of every position seen so far, so a decode step
only computes the new token's q/k/v and attends over the cache instead of re-running the prompt.
The cache is paged (kv_cache.py): fixed-size blocks of positions from a pool, found through the
sequence's block table; model.KVCache is one sequence's cache over a pool of its own.

Several sequences run as one batch (`forward_batch`), each with its own cache, length and positions.
Every step but attention treats tokens one at a time, so the batch's tokens are packed one sequence
after another into one [T, D] matrix: each weight is read once for all of them, which is why a
memory-bound decode step for 8 sequences costs little more than one for a single sequence. Only
attention looks across tokens, and it runs per sequence, over that sequence's own keys: there is no
padding, so nothing can attend to another sequence's tokens or to padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from . import layers
from .config import Qwen3Config
from ..errors import QwenNPError
from .kv_cache import KVCache, PagedKVCache
from ..numbers.numerics import Weight

# trace(name, value) is called with every intermediate of the forward pass when given (see inspection).
Trace = layers.Note


@dataclass
class LayerWeights:
    """One decoder layer's tensors, named as in the checkpoint (model.layers.{i}.<...>.weight).

    config.LAYER_TENSORS gives each one's checkpoint name and shape ([out, in] for projections;
    q_norm and k_norm are one [Dh] weight shared by every head). In "bf16" memory mode the
    projections are the checkpoint's stored values, memory-mapped (numerics.StoredRows); in "int8"
    mode they are numerics.Int8Rows. The norm weights are always FP32.
    """

    input_layernorm: np.ndarray
    q_proj: Weight
    k_proj: Weight
    v_proj: Weight
    q_norm: np.ndarray
    k_norm: np.ndarray
    o_proj: Weight
    post_attention_layernorm: np.ndarray
    gate_proj: Weight
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

    def new_cache(self, max_tokens: int, dtype: str = "fp32") -> KVCache:
        """An empty KV cache for up to `max_tokens` positions, stored as `dtype` (kv_cache.KV_DTYPES)."""
        return KVCache(self.config, max_tokens, dtype)

    def forward(self, token_ids: Sequence[int] | np.ndarray, cache: PagedKVCache | None = None,
                trace: Trace | None = None, last_only: bool = False) -> np.ndarray:
        """Logits [T, V] (FP32) for every position of `token_ids`; [1, V] for the last one if `last_only`.

        Without a cache the tokens are a whole sequence starting at position 0. With a cache they
        continue after the cache's `length` positions, and their keys/values are appended to it.
        last_only: generation needs only the next token's logits; the LM head ([V, D], a quarter of
        Qwen3-0.6B's weights) then multiplies one row instead of T.
        """
        return self.forward_batch([token_ids], [cache], trace, last_only)

    def forward_batch(self, token_ids: Sequence[Sequence[int] | np.ndarray], caches: Sequence[PagedKVCache | None],
                      trace: Trace | None = None, last_only: bool = False,
                      tails: Sequence[int] | None = None, head: bool = True) -> np.ndarray:
        """`forward` for B sequences at once: sequence b's tokens continue caches[b] (or start at
        position 0 when it is None). Logits [T, V] for the T tokens of all sequences, one sequence
        after another; with `last_only`, [B, V]: each sequence's last position; with `tails`, the last
        tails[b] positions of each sequence b, one after another (a speculative row verifies several).
        head=False: the final norm's output [..., D] at those positions instead of logits, the LM head
        left out (what an embedding model such as Qwen3-Embedding gives).

        Each sequence gets the logits it would get alone (up to the rounding of BLAS sums).
        """
        if len(token_ids) != len(caches) or not token_ids:
            raise QwenNPError(f"forward_batch: {len(token_ids)} sequences of token ids for {len(caches)} caches")
        head_weight = self.lm_head if head else None       # raises now, before any work, if there is none
        ids, positions, rows = self._pack(token_ids, caches)                             # [T], [T], B slices
        note = trace or layers.ignore
        cos, sin = layers.rope_angles(self.inv_freq, positions)                        # [T, Dh] each

        x = layers.embed(ids, self.embed_tokens)                                       # [T, D]
        note("model.embed_tokens", x)
        for i, layer in enumerate(self.layers):
            x = self.decoder_layer(i, layer, x, positions, rows, cos, sin, caches, note)   # [T, D]
        x = layers.rms_norm(x, self.norm, self.config.rms_norm_eps)                    # [T, D]
        note("model.norm", x)
        picked = output_rows(rows, last_only, tails)        # the rows whose logits are asked for (None: all)
        if picked is not None:
            x = x[picked]                                                              # [B, D] or [sum(tails), D]
        if head_weight is None:
            advance(caches, ids, rows)
            return x
        logits = layers.linear(x, head_weight)                                         # [T, V]
        note("lm_head", logits)
        advance(caches, ids, rows)
        return logits

    def decoder_layer(self, i: int, w: LayerWeights, x: np.ndarray, positions: np.ndarray, rows: list[slice],
                      cos: np.ndarray, sin: np.ndarray, caches: Sequence[PagedKVCache | None], note: Trace) -> np.ndarray:
        """x + attention(input_layernorm(x)), then + mlp(post_attention_layernorm(x)).  [T, D] -> [T, D].

        Layer i with weights w, on the packed rows of forward_batch: x [T, D] holds the sequences one
        after another (rows[b] is sequence b's slice), at positions [T] with their RoPE tables cos/sin
        [T, Dh]; caches[b] (or None) receives sequence b's keys and values. `note` sees every step.
        The one place a decoder layer is written: the extension point for code that runs the network
        a layer at a time (the precision lab rounds its input, training recomputes it in the backward,
        the inspection steps point at its lines)."""
        c, T, name = self.config, x.shape[0], f"model.layers.{i}"
        eps = c.rms_norm_eps

        # --- self-attention block ---
        h = layers.rms_norm(x, w.input_layernorm, eps)                                  # [T, D]
        note(f"{name}.input_layernorm", h)
        q = layers.linear(h, w.q_proj).reshape(T, c.num_attention_heads, c.head_dim)    # [T, H, Dh]
        note(f"{name}.self_attn.q_proj", q)
        k = layers.linear(h, w.k_proj).reshape(T, c.num_key_value_heads, c.head_dim)    # [T, KVH, Dh]
        note(f"{name}.self_attn.k_proj", k)
        v = layers.linear(h, w.v_proj).reshape(T, c.num_key_value_heads, c.head_dim)    # [T, KVH, Dh]
        note(f"{name}.self_attn.v_proj", v)
        q = layers.rms_norm(q, w.q_norm, eps)          # per head, over Dh, BEFORE RoPE    [T, H, Dh]
        note(f"{name}.self_attn.q_norm", q)
        k = layers.rms_norm(k, w.k_norm, eps)          # v gets no norm                    [T, KVH, Dh]
        note(f"{name}.self_attn.k_norm", k)
        q = layers.rope(q, cos, sin)                                                     # [T, H, Dh]
        note(f"{name}.self_attn.rope_q", q)
        k = layers.rope(k, cos, sin)                                                     # [T, KVH, Dh]
        note(f"{name}.self_attn.rope_k", k)
        heads = []                                     # each sequence attends over its own keys only
        for row, cache in zip(rows, caches):
            keys, values = (k[row], v[row]) if cache is None else cache.append(i, k[row], v[row])  # [S, KVH, Dh]
            heads.append(layers.attention(q[row], keys, values, positions[row], _scoped(note, f"{name}.self_attn.")))
        mixed = np.concatenate(heads)                                                    # [T, H*Dh]
        note(f"{name}.self_attn.weighted_sum", mixed)
        attn_out = layers.linear(mixed, w.o_proj)                                        # [T, D]
        note(f"{name}.self_attn.o_proj", attn_out)
        x = x + attn_out
        note(f"{name}.residual_attn", x)

        # --- MLP block (SwiGLU) ---
        h = layers.rms_norm(x, w.post_attention_layernorm, eps)                         # [T, D]
        note(f"{name}.post_attention_layernorm", h)
        mlp_out = layers.swiglu(h, w.gate_proj, w.up_proj, w.down_proj, _scoped(note, f"{name}.mlp."))  # [T, D]
        note(f"{name}.mlp.down_proj", mlp_out)
        x = x + mlp_out
        note(f"{name}.residual_mlp", x)
        return x

    def _pack(self, token_ids: Sequence[Sequence[int] | np.ndarray],
              caches: Sequence[PagedKVCache | None]) -> tuple[np.ndarray, np.ndarray, list[slice]]:
        """The sequences' checked ids [T] and positions [T], one sequence after another, and the
        slice of those T rows that belongs to each sequence."""
        held = [id(cache) for cache in caches if cache is not None]
        if len(set(held)) < len(held):
            raise QwenNPError("forward_batch: the same KV cache is given for two sequences")
        checked = [self._ids_and_positions(ids, cache) for ids, cache in zip(token_ids, caches)]
        for (ids, _), cache in zip(checked, caches):             # every row checked first: nothing half-done
            if cache is not None:
                cache.reserve(len(ids))
        ends = np.cumsum([len(ids) for ids, _ in checked]).tolist()
        rows = [slice(end - len(ids), end) for end, (ids, _) in zip(ends, checked)]
        return (np.concatenate([ids for ids, _ in checked]), np.concatenate([positions for _, positions in checked]),
                rows)

    def _ids_and_positions(self, token_ids: Sequence[int] | np.ndarray,
                           cache: PagedKVCache | None) -> tuple[np.ndarray, np.ndarray]:
        """The checked token ids [T] and their positions [T]: after the cache's `length` positions, or from 0."""
        ids = self._check_ids(token_ids)
        start = cache.length if cache is not None else 0
        if cache is not None and start + len(ids) > cache.max_tokens:
            raise QwenNPError(f"cache: {start} cached + {len(ids)} new tokens exceed its {cache.max_tokens} positions")
        return ids, np.arange(start, start + len(ids))

    def _check_ids(self, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        ids = np.asarray(token_ids)
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise QwenNPError(f"token_ids: expected a non-empty 1-D sequence of integers, got shape {ids.shape} {ids.dtype}")
        bad = ids[(ids < 0) | (ids >= self.config.vocab_size)]
        if bad.size:
            raise QwenNPError(f"token_ids: id {int(bad[0])} is outside the vocabulary [0, {self.config.vocab_size})")
        return ids.astype(np.int64)


def output_rows(rows: list[slice], last_only: bool, tails: Sequence[int] | None) -> list[int] | None:
    """The packed rows whose logits a forward_batch call returns (None: all): each sequence's last
    tails[b] rows, or its last one with last_only."""
    if tails is None:
        return [row.stop - 1 for row in rows] if last_only else None
    if len(tails) != len(rows) or not all(1 <= tail <= row.stop - row.start for tail, row in zip(tails, rows)):
        raise QwenNPError(f"forward_batch: tails {list(tails)} do not fit sequences of {[r.stop - r.start for r in rows]} tokens")
    return [i for tail, row in zip(tails, rows) for i in range(row.stop - tail, row.stop)]


def advance(caches: Sequence[PagedKVCache | None], ids: np.ndarray, rows: list[slice]) -> None:
    """After a forward pass: each cache counts its sequence's tokens (ids[rows[b]]) as held."""
    for row, cache in zip(rows, caches):
        if cache is not None:
            cache.advance(ids[row])


def _scoped(note: Trace, prefix: str) -> Trace:
    """A note that puts `prefix` before each step name (layers.attention says "scores", the trace
    shows "model.layers.3.self_attn.scores")."""
    if note is layers.ignore:
        return layers.ignore
    return lambda step, value: note(prefix + step, value)
