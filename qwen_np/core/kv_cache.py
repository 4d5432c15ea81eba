"""The KV cache: the keys and values of every position seen so far, so that a decode step computes
only the new token's q/k/v and attends over the cache instead of running the whole prompt again.

    keys[l, p]   layer l's key of position p, after RoPE      [L, S_max, KVH, Dh]
    values[l, p] layer l's value of position p                 [L, S_max, KVH, Dh]

Positions 0 .. length-1 are filled. A forward pass appends each layer's new keys/values after them
and reads back every key so far, then advances `length` by its tokens. This is one sequence's cache,
positions in order, sized for the whole generation before the first token: the one to read first.
engine/paged.py keeps the same keys in fixed-size blocks taken from a pool shared by many sequences
(continuous batching, prefix caching); both give the network the same keys (tests/engine/test_kv_cache.py).

Only KVH heads are stored, not H (grouped-query attention): Qwen3-8B's cache is 4x smaller than its
queries' head count suggests. Stored as BF16 or FP16 it is half as large again; keys are widened to
FP32 as they are read, so attention itself always runs in FP32.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from .defaults import KV_DTYPES   # name -> its NumPy dtype's (dtype_named); defined there for --help
from ..errors import QwenNPError
from ..numbers.numerics import dtype_named
from .config import Qwen3Config



def kv_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a KV cache dtype name (KV_DTYPES)."""
    if name not in KV_DTYPES:
        raise QwenNPError(f"expected one of {', '.join(KV_DTYPES)}, got {name!r}", "kv_dtype")
    return dtype_named(KV_DTYPES[name])


class SequenceCache(Protocol):
    """What a forward pass needs of one sequence's cache: KVCache below, or engine.paged.PagedKVCache."""

    @property
    def length(self) -> int: ...             # positions filled

    @property
    def max_tokens(self) -> int: ...         # positions it can hold

    def reserve(self, new_tokens: int) -> None: ...

    def append(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...

    def advance(self, ids: Sequence[int] | np.ndarray) -> None: ...

    def truncate(self, length: int) -> None: ...

    def free(self) -> None: ...


class KVCache:
    """One sequence's keys and values for up to `max_tokens` positions, stored as `dtype` (KV_DTYPES)."""

    def __init__(self, config: Qwen3Config, max_tokens: int, dtype: str = "fp32") -> None:
        if max_tokens <= 0:
            raise QwenNPError(f"max_tokens: the KV cache needs at least one position, got {max_tokens}")
        shape = (config.num_hidden_layers, max_tokens, config.num_key_value_heads, config.head_dim)
        self.keys = np.zeros(shape, dtype=kv_dtype(dtype))                             # [L, S_max, KVH, Dh]
        self.values = np.zeros(shape, dtype=kv_dtype(dtype))                           # [L, S_max, KVH, Dh]
        self.dtype, self.max_tokens, self.length = dtype, max_tokens, 0

    def reserve(self, new_tokens: int) -> None:
        """Check that `new_tokens` more positions fit (this cache was sized up front)."""
        if self.length + new_tokens > self.max_tokens:
            raise QwenNPError(f"cache: {self.length} cached + {new_tokens} new tokens exceed its {self.max_tokens} positions")

    def append(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store this pass's keys/values k, v [T, KVH, Dh] of `layer` after the `length` cached positions,
        and return every key and value so far in position order, FP32 [S, KVH, Dh] each (S = length + T)."""
        end = self.length + len(k)
        self.keys[layer, self.length:end] = k          # rounded here when the cache holds BF16 / FP16
        self.values[layer, self.length:end] = v
        return _fp32(self.keys[layer, :end]), _fp32(self.values[layer, :end])

    def advance(self, ids: Sequence[int] | np.ndarray) -> None:
        """After every layer has appended: count this pass's tokens as cached."""
        self.length += len(ids)

    def truncate(self, length: int) -> None:
        """Forget every position from `length` on (a chat whose history changed, rejected drafted tokens)."""
        if not 0 <= length <= self.length:
            raise QwenNPError(f"cache: cannot truncate {self.length} cached positions to {length}")
        self.length = length

    def free(self) -> None:
        self.truncate(0)


def _fp32(stored: np.ndarray) -> np.ndarray:
    """Cached keys or values as FP32: the stored array itself (a view) when it is FP32, else widened (exactly)."""
    return stored if stored.dtype == np.float32 else stored.astype(np.float32)
