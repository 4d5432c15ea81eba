"""The sequences of one forward pass packed as one batch: what the network's steps read besides the weights.

Several sequences run as one batch (`Qwen3Model.forward_batch`), each with its own cache, length and positions.
Every step but attention treats tokens one at a time, so the batch's tokens are packed one sequence after
another into one [T, D] matrix: each weight is read once for all of them, which is why a memory-bound decode
step for 8 sequences costs little more than one for a single sequence. Only attention looks across tokens,
and it runs per sequence (`Batch.attention`), over that sequence's own keys: there is no padding, so nothing
can attend to another sequence's tokens or to padding. Here: the input checks, the packing, each row's LoRA
adapter, and the bookkeeping of the caches after a pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Sequence, TypeVar

import numpy as np

from ..errors import QwenNPError
from ..numbers.numerics import RowAdapters
from . import layers
from .adapters import Adapter
from .config import LAYER_MATRICES
from .kv_cache import SequenceCache

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

# A layer's weights (model.LayerWeights, which imports this module): any dataclass holding its projections.
Layer = TypeVar("Layer", bound="DataclassInstance")


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

    def layer_weights(self, i: int, weights: Layer) -> Layer:
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

    def attention(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, note: layers.Note) -> np.ndarray:
        """Each sequence attends over its own keys only: its cached ones and these.  q [T, H, Dh],
        k/v [T, KVH, Dh] -> [T, H*Dh]. Appends this layer's k, v to each sequence's cache."""
        heads = []
        for row, cache in zip(self.rows, self.caches):
            keys, values = (k[row], v[row]) if cache is None else cache.append(layer, k[row], v[row])  # [S, KVH, Dh]
            heads.append(layers.attention(q[row], keys, values, self.positions[row], note))
        return np.concatenate(heads)                                                   # [T, H*Dh]


def pack(token_ids: Sequence[Sequence[int] | np.ndarray], caches: Sequence[SequenceCache | None],
         adapters: Sequence[Adapter | None] | None, vocab_size: int, inv_freq: np.ndarray,
         rope_scale: float = 1.0) -> Batch:
    """The sequences' checked ids, one sequence after another, as a Batch (with each one's adapter and the RoPE
    tables at their positions, from inv_freq [Dh/2], times rope_scale); their caches reserve room for them (every row checked
    first: nothing half-done)."""
    if len(token_ids) != len(caches) or not token_ids or (adapters is not None and len(adapters) != len(caches)):
        raise QwenNPError(f"forward_batch: {len(token_ids)} sequences of token ids for {len(caches)} caches"
                          + (f" and {len(adapters)} adapters" if adapters is not None else ""))
    held = [id(cache) for cache in caches if cache is not None]
    if len(set(held)) < len(held):
        raise QwenNPError("forward_batch: the same KV cache is given for two sequences")
    ids = [check_token_ids(one, vocab_size) for one in token_ids]
    starts = [cache.length if cache is not None else 0 for cache in caches]
    for one, start, cache in zip(ids, starts, caches):
        if cache is not None and start + len(one) > cache.max_tokens:
            raise QwenNPError(f"cache: {start} cached + {len(one)} new tokens exceed its {cache.max_tokens} positions")
    for one, cache in zip(ids, caches):
        if cache is not None:
            cache.reserve(len(one))
    ends = np.cumsum([len(one) for one in ids]).tolist()
    positions = np.concatenate([np.arange(start, start + len(one)) for one, start in zip(ids, starts)])
    cos, sin = layers.rope_angles(inv_freq, positions, rope_scale)                     # [T, Dh] each
    rows = [slice(end - len(one), end) for end, one in zip(ends, ids)]
    return Batch(np.concatenate(ids), positions, rows, list(caches), cos, sin,
                 adapter_rows(rows, adapters or [None] * len(rows)))


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
