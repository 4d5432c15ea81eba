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

Stored as int8 (llama.cpp's `-ctk q8_0` idea, with coarser scales): each position's key of each head, its
Dh values, is kept as int8 codes and one FP32 scale, symmetric absmax / 127 (numbers.formats.quantize_int8_rows),
so a value is off by at most scale / 2 and a head of Dh = 128 takes 128 + 4 bytes, 52% of BF16's 256.
A scale per position and head, not per block of positions: a position's scale is final when it is written,
so appending one token never re-quantizes the keys before it. Read back as code * scale in FP32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from .defaults import KV_DTYPES   # name -> its NumPy dtype's (dtype_named); defined there for --help
from ..errors import QwenNPError
from ..numbers.formats import dequantize_int8_rows, quantize_int8_rows
from ..numbers.numerics import bf16_bits_to_f32, bf16_widening, dtype_named
from .config import Qwen3Config



def kv_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a KV cache dtype name (KV_DTYPES)."""
    if name not in KV_DTYPES:
        raise QwenNPError(f"expected one of {', '.join(KV_DTYPES)}, got {name!r}", "kv_dtype")
    return dtype_named(KV_DTYPES[name])


SCALED_KV_DTYPE = "int8"     # the one KV dtype whose codes carry scales
BF16 = dtype_named("bfloat16")


def kv_position_bytes(config: Qwen3Config, dtype: str = "fp32") -> int:
    """Bytes the keys and values of one position take in every layer, stored as `dtype` (int8: scales included)."""
    per_head = config.head_dim * kv_dtype(dtype).itemsize + (4 if dtype == SCALED_KV_DTYPE else 0)   # FP32 scale
    return 2 * config.num_hidden_layers * config.num_key_value_heads * per_head


def kv_scales(shape: tuple[int, ...], dtype: str) -> np.ndarray | None:
    """The scales of a cache array of `shape` [..., KVH, Dh] stored as `dtype`: FP32 [..., KVH] for int8
    (one per position and head), None for the plain dtypes."""
    return np.zeros(shape[:-1], np.float32) if dtype == SCALED_KV_DTYPE else None


def store(codes: np.ndarray, scales: np.ndarray | None, index: tuple, x: np.ndarray) -> None:
    """codes[index] = x [..., KVH, Dh] (FP32) as the cache holds it: rounded to BF16 / FP16 by the assignment,
    or quantized to int8 with its scales [..., KVH] (scales[index])."""
    if scales is None:
        codes[index] = x
    else:
        codes[index], scales[index] = quantize_int8_rows(x)


def widened(codes: np.ndarray, scales: np.ndarray | None, out: np.ndarray | None = None) -> np.ndarray:
    """Stored keys or values [..., KVH, Dh] as FP32: the stored array itself (a view) when FP32; else widened
    into `out` (a new array if None): exactly for BF16 / FP16, code * scale rounded once for int8."""
    if scales is not None:
        return dequantize_int8_rows(codes, scales, out)
    if codes.dtype == np.float32:
        return codes
    if out is None:
        return codes.astype(np.float32)
    np.copyto(out, codes)
    return out


@dataclass(frozen=True)
class Unscaled:
    """One layer's keys and values [S, KVH, Dh] in FP32 as a decode step reads them: BF16 / FP16 widened, int8's
    codes widened but not yet times their scales [S, KVH], which come beside them (None: nothing to apply).
    Attention multiplies its S scores a head by the key scales and its S weights by the value scales instead
    of every one of the S x Dh codes: one pass over the codes (the cast) instead of two."""

    keys: np.ndarray
    values: np.ndarray
    key_scales: np.ndarray | None
    value_scales: np.ndarray | None


def unscaled_into(codes: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Stored keys or values [..., KVH, Dh] as FP32 without int8's scales: exact for every stored dtype (BF16 by
    the faster of two exact widenings on this machine, numerics.bf16_widening: the cast alone measured 2x an
    FP32 cache's whole decode attention)."""
    if codes.dtype == BF16 and bf16_widening() == "shift":
        return bf16_bits_to_f32(codes.view(np.uint16), out)
    out[...] = codes
    return out


class SequenceCache(Protocol):
    """What a forward pass needs of one sequence's cache: KVCache below, or engine.paged.PagedKVCache."""

    @property
    def length(self) -> int: ...             # positions filled

    @property
    def max_tokens(self) -> int: ...         # positions it can hold

    def reserve(self, new_tokens: int) -> None: ...

    @property
    def dtype(self) -> str: ...               # the KV dtype its keys and values are stored as (KV_DTYPES)

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None: ...

    def append(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...

    def unscaled(self, layer: int, end: int) -> Unscaled: ...

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
        self.key_scales, self.value_scales = kv_scales(shape, dtype), kv_scales(shape, dtype)   # [L, S_max, KVH]
        self.dtype, self.max_tokens, self.length = dtype, max_tokens, 0
        self._widened: np.ndarray | None = None          # unscaled()'s buffers, made at its first call

    def reserve(self, new_tokens: int) -> None:
        """Check that `new_tokens` more positions fit (this cache was sized up front)."""
        if self.length + new_tokens > self.max_tokens:
            raise QwenNPError(f"cache: {self.length} cached + {new_tokens} new tokens exceed its {self.max_tokens} positions")

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store this pass's keys/values k, v [T, KVH, Dh] of `layer` after the `length` cached positions."""
        end = self.length + len(k)
        store(self.keys, self.key_scales, (layer, slice(self.length, end)), k)
        store(self.values, self.value_scales, (layer, slice(self.length, end)), v)

    def append(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """write(), then return every key and value so far in position order, FP32 [S, KVH, Dh] each (S = length + T)."""
        self.write(layer, k, v)
        end = self.length + len(k)
        return self._read(self.keys, self.key_scales, layer, end), self._read(self.values, self.value_scales, layer, end)

    def unscaled(self, layer: int, end: int) -> Unscaled:
        """Positions [0, end) of `layer` as a decode step reads them (Unscaled): views when FP32, else widened into
        this cache's two reused buffers (valid until the next call): a fresh array a layer would be mapped and
        page-faulted in anew each time."""
        if self.dtype == "fp32":
            return Unscaled(self.keys[layer, :end], self.values[layer, :end], None, None)
        if self._widened is None:
            self._widened = np.empty((2, *self.keys.shape[1:]), np.float32)                  # [2, S_max, KVH, Dh]
        scales = (None, None) if self.key_scales is None or self.value_scales is None else (
            self.key_scales[layer, :end], self.value_scales[layer, :end])
        return Unscaled(unscaled_into(self.keys[layer, :end], self._widened[0, :end]),
                        unscaled_into(self.values[layer, :end], self._widened[1, :end]), *scales)

    @staticmethod
    def _read(codes: np.ndarray, scales: np.ndarray | None, layer: int, end: int) -> np.ndarray:
        """Positions [0, end) of `layer` as FP32 [end, KVH, Dh]."""
        return widened(codes[layer, :end], None if scales is None else scales[layer, :end])

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

