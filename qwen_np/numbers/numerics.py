"""How weights are held between uses, and widened to FP32 when used: the weight kinds.

A model holds each matrix as one of:
* a NumPy array, always FULL_PRECISION (FP32; float64 for the gradient checks): used as it is;
* StoredRows: the checkpoint's own 16-bit values, BF16 or F16, often a view of the memory-mapped file;
* Int8Rows (`--memory int8`): int8 codes and one FP32 scale per row (formats.quantize_int8_rows at
  load), so W ~ codes * scale[:, None];
* Panels: FP32 values in the fast path's layout (column panels of W^T), what load_model's "auto" holds
  for a fast model when FP32 fits and BLAS has a small-matrix kernel: the same numbers, arranged so
  that a product of a few rows costs about what one row's does;
* Adapted: any of these, frozen, with a LoRA adapter beside it (training/lora.py): W + (alpha / r) B A;
* RowAdapters: any of these with a different adapter for each group of a batch's rows (a server's rows
  that ask for different adapters: core/model.py's Batch makes one per forward pass).
Every kind that is not a plain FP32 array has one way to make FP32 rows, `widen(out)`, which writes
FP32 values into `out` and returns the per-row scale still to be applied to the outputs of a product
(None if none): layers.linear, the fast path and upcast() are written once against it, so a new kind
of weight (a new memory mode) is one class here and the loader that makes it.

BF16 is the top half of an IEEE float32 (1 sign, 8 exponent, 7 mantissa bits), so widening it is
exact: put the 16 bits in the high half of a uint32 and reinterpret (bf16_bits_to_f32 does it in two
NumPy passes; ml_dtypes' bfloat16 cast does the same in one C loop). Which is faster depends on the
machine (bf16_widening), never the bits.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol, TypeGuard, runtime_checkable

import numpy as np

# On-disk dtype name (safetensors) -> the name of the NumPy dtype (dtype_named) whose bytes we read and write.
STORAGE_DTYPES = {"BF16": "bfloat16", "F16": "<f2", "F32": "<f4"}
BYTES_PER_VALUE = {"FP32": 4, "BF16": 2, "FP16": 2, "FP8": 1, "INT8": 1, "INT4": 0.5}


# Weights used as they are: FP32, or float64 for the gradient checks. Also what training can update.
FULL_PRECISION = (np.dtype(np.float32), np.dtype(np.float64))


def bf16_bits_to_f32(bits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Exact BF16 -> FP32: shift the 16 stored bits into the high half of a 32-bit word."""
    if out is None:
        out = np.empty(bits.shape, dtype=np.float32)
    words = out.view(np.uint32)
    words[...] = bits      # widen first: np.left_shift(bits, 16, dtype=uint32) casts through a
    words <<= 16           # buffered loop and measured 1.3-4.5x slower on this machine
    return out


# Which exact BF16 -> FP32 widening StoredRows uses: "cast" (ml_dtypes' cast, one pass) or "shift"
# (bf16_bits_to_f32: NumPy's uint16 -> uint32 copy, then a shift in place). The faster differs by
# machine by more than 1.5x either way: single thread, BF16 bytes a second, ml_dtypes' cast 11-24 GB/s
# and the shift 6-16 GB/s on an AVX-512 EPYC (Zen 4), but 1.9-2.3 against 3.2-3.8 GB/s on an AVX2-only one (Zen 3)
# (bench/README.md, "BF16 upcast"). So it is timed once per process on a block in cache (a few
# milliseconds), under a lock: both give the same bits, only the time differs.
_widening: list[str] = []
_widening_lock = threading.Lock()


def bf16_widening() -> str:
    """The faster exact BF16 widening on this machine, "cast" or "shift" (timed once, then remembered)."""
    if not _widening:
        with _widening_lock:
            if not _widening:
                _widening.append(_time_bf16_widenings())
    return _widening[0]


def _time_bf16_widenings(rows: int = 256, columns: int = 2048, rounds: int = 5) -> str:
    """Best of `rounds` (interleaved) of each widening of a [rows, columns] BF16 block into FP32, in cache."""
    bits = np.random.default_rng(0).integers(0x3C00, 0x3D00, (rows, columns), dtype=np.uint16)
    values, out = bits.view(dtype_named("bfloat16")), np.empty((rows, columns), np.float32)
    ways = {"cast": lambda: np.copyto(out, values, casting="unsafe"), "shift": lambda: bf16_bits_to_f32(bits, out)}
    best = dict.fromkeys(ways, math.inf)
    for _ in range(rounds):
        for name, way in ways.items():
            start = time.perf_counter()
            way()
            best[name] = min(best[name], time.perf_counter() - start)
    return min(best, key=best.__getitem__)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """FP32 -> BF16 bits, rounding to nearest even as torch's .to(bfloat16) does (NaN stays NaN)."""
    word = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((word >> 16) & 1) + np.uint32(0x7FFF)        # ties go to the even neighbour
    bits = ((word + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    bits[nan] = ((word[nan] >> 16) | 0x0040).astype(np.uint16)  # keep NaN a NaN (quiet bit set)
    return bits


@dataclass(frozen=True)
class StoredRows:
    """A matrix [out, in] held as the checkpoint stores it: BF16 (ml_dtypes.bfloat16) or F16 values (or
    FP32 rows gathered out of Panels).

    Indexing picks rows (a block of rows, or the embedding rows of some tokens). A product widens a
    block of rows at a time, exactly, so no FP32 copy of the whole matrix ever exists (an 8B model
    does not fit in RAM as FP32)."""

    values: np.ndarray           # bfloat16 or float16 [out, in] (FP32 from Panels)

    @property
    def dtype(self) -> np.dtype:
        return self.values.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def ndim(self) -> int:
        return self.values.ndim

    @property
    def nbytes(self) -> int:
        return self.values.nbytes

    def __getitem__(self, rows: Any) -> "StoredRows":
        return StoredRows(self.values[rows])

    def widen(self, out: np.ndarray) -> None:
        """Exact FP32 values into out (same shape); no scale remains."""
        if self.values.dtype.name == "bfloat16" and bf16_widening() == "shift":
            bf16_bits_to_f32(self.values.view(np.uint16), out)
        else:
            np.copyto(out, self.values, casting="unsafe")


@dataclass(frozen=True)
class Int8Rows:
    """A matrix [out, in] kept as int8 codes with one FP32 scale per row: W ~ codes * scale[:, None].

    Indexing picks rows of both (a block of rows, or the embedding rows of some tokens). A product
    needs no FP32 copy of W: y[o] = x . W[o] = scale[o] * (x . codes[o]), so it casts the codes,
    multiplies, and scales the outputs (one pass over the weight instead of two; bench/README.md).
    """

    codes: np.ndarray            # int8 [out, in]
    scale: np.ndarray            # FP32 [out]

    dtype = np.dtype(np.int8)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.codes.shape

    @property
    def ndim(self) -> int:
        return self.codes.ndim

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes

    def __getitem__(self, rows: Any) -> "Int8Rows":
        return Int8Rows(self.codes[rows], self.scale[rows])

    def widen(self, out: np.ndarray) -> np.ndarray:
        """The codes as FP32 into out (exact: int8 fits in FP32); the rows' scales remain to be applied."""
        np.copyto(out, self.codes, casting="unsafe")
        return self.scale


# Rows of W per panel of Panels (below): measured (bench/README.md, "Panels").
PANEL = 32


@dataclass(frozen=True)
class Panels:
    """An FP32 matrix W [out, in] held for the fast path as column panels of W^T: values [out/P, in, P],
    panel j = W[jP:(j+1)P]^T (P = PANEL), each panel contiguous.

    Why: a product of a few rows, x [M, in] W^T, is then one NumPy call, x @ values ([out/P, M, P]):
    one small BLAS GEMM per panel, which OpenBLAS runs in its "NN" form (the panel's P outputs are
    contiguous for each input: one broadcast of x and a vector multiply-add per input). On W's own
    layout the same product is a dot product per output ("TN"), which OpenBLAS's small-matrix kernel
    runs at about half the speed of reading W (bench/README.md, "Panels"); where there is no such
    kernel (OpenBLAS's Haswell one) a panel's few rows take the packing GEMM, so load_model holds
    Panels only where there is. One token and a prompt (a GEMM per panel) cost about what they cost
    on W's layout.

    Indexing picks rows: a slice of whole panels stays Panels; any other rows (the embedding rows
    of some tokens) are gathered into FP32 rows, as StoredRows. widen() writes W's own layout."""

    values: np.ndarray            # FP32 [out/P, in, P]

    dtype = np.dtype(np.float32)

    @property
    def shape(self) -> tuple[int, ...]:
        n, columns, size = self.values.shape
        return (n * size, columns)

    @property
    def ndim(self) -> int:
        return 2

    @property
    def nbytes(self) -> int:
        return self.values.nbytes

    def __getitem__(self, rows: Any) -> "Panels | StoredRows":
        size = self.values.shape[2]
        if isinstance(rows, slice) and rows.step in (None, 1):
            start, stop, _ = rows.indices(self.shape[0])
            if start % size == 0 and stop % size == 0:
                return Panels(self.values[start // size:stop // size])
        picked = np.arange(self.shape[0])[rows]
        return StoredRows(self.values[picked // size, :, picked % size])      # [rows, in]

    def widen(self, out: np.ndarray) -> None:
        """W's rows [out, in] into out."""
        n, columns, size = self.values.shape
        np.copyto(np.reshape(out, (n, size, columns), copy=False), self.values.transpose(0, 2, 1))


def panel_shape(shape: tuple[int, ...]) -> tuple[int, int, int] | None:
    """Panels' values shape for a matrix of `shape` [out, in]; None unless its rows split into whole panels."""
    if len(shape) != 2 or shape[0] % PANEL:
        return None
    return (shape[0] // PANEL, shape[1], PANEL)


def panels(weight: np.ndarray, out: np.ndarray | None = None) -> Panels:
    """W [out, in] (any dtype upcast reads) as Panels, written into `out` (panel_shape) if given."""
    shape = panel_shape(weight.shape)
    if shape is None:
        raise ValueError(f"a matrix of shape {weight.shape} does not split into panels of {PANEL} rows")
    values = np.empty(shape, np.float32) if out is None else out
    np.copyto(values, weight.reshape(shape[0], PANEL, shape[1]).transpose(0, 2, 1), casting="unsafe")
    return Panels(values)


class Held(Protocol):
    """A weight kind that is not FP32: rows index out of it, and widen(out) writes FP32 values into `out`
    (its shape) and returns the per-row scale still to be applied after a product, or None. StoredRows
    and Int8Rows here; formats.FormatRows holds llama.cpp's block formats (--memory q8_0, q4_0)."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> np.dtype: ...

    @property
    def nbytes(self) -> int: ...

    def __getitem__(self, rows: Any) -> "Held": ...

    def widen(self, out: np.ndarray) -> np.ndarray | None: ...


@runtime_checkable
class Grouped(Held, Protocol):
    """A Held kind whose values are integer codes with a scale and an offset per group of g consecutive
    inputs of a row, w = a q + b (llama.cpp's block formats: formats.FormatRows, ggml_blocks.BlockRows).
    groups() gives (codes [rows, in] int8/uint8, a [rows, in/g] FP32, b [rows, in/g] FP32 or None), views
    of this thread's scratch memory valid until its next groups() call (a and b transposed views of
    group-major arrays); widen() is widen_groups of them. The fast path multiplies the codes and
    applies a and b per group (fast.py): the same values, summed in another order. coded() gives the
    same codes in the order its bit fields unpack cheapest (code_order: the value index of each input;
    None for value order), group-major: [G, rows, g], each group's codes of a row side by side (the layout
    in which the fast path's batched product runs fastest: grouped_rows), and a and b [G, rows] in that
    order; the fast path puts x in that order instead (ggml_blocks, "code order")."""

    @property
    def group(self) -> int: ...                 # g: inputs per scale

    def __getitem__(self, rows: Any) -> "Grouped": ...

    def groups(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]: ...

    @property
    def code_order(self) -> np.ndarray | None: ...     # the value index of each input in coded()'s order

    def coded(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]: ...


_GROUPED_KINDS: dict[type, bool] = {}


def is_grouped(weight: object) -> TypeGuard[Grouped]:
    """isinstance(weight, Grouped), decided once per class. Why: a runtime_checkable Protocol's isinstance
    walks every class of the MRO for the protocol's members on each call (~10-25 us), and the fast path
    asks it of every product, ~110 times a decode token: 2-3 ms of a 0.6B token's ~90 ms (bench/README.md,
    "Where a token's time goes"). Every instance of a weight class has the same members."""
    kind = type(weight)
    if kind not in _GROUPED_KINDS:
        _GROUPED_KINDS[kind] = isinstance(weight, Grouped)
    return _GROUPED_KINDS[kind]


@functools.cache
def dtype_named(name: str) -> np.dtype:
    """NumPy's dtype `name`, or ml_dtypes' (bfloat16, float8_e4m3fn, float4_e2m1fn, ...). ml_dtypes is imported
    here alone, on first use: its import takes most of a second, which a command's --help or usage error
    never needs (qwen_np/__init__.py)."""
    try:
        return np.dtype(name)
    except TypeError:                        # not NumPy's own: ml_dtypes' (importing it registers its names)
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))


_scratch = threading.local()


def scratch(name: str, shape: tuple[int, ...], dtype: np.dtype | type = np.float32) -> np.ndarray:
    """This thread's reused array called `name`, uninitialised, C-contiguous, of `shape` (its memory grown
    when too small, never shrunk). Why: NumPy's temporaries of more than ~128 KiB come from fresh pages
    of the kernel each time (glibc's allocator returns them when freed), and a page fault costs ~3 us in
    this VM: a fresh 1 MiB array costs more to fault in than most passes over it. Each caller's names
    are its own; a second request for a name reuses the memory of the first."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    buffer = getattr(_scratch, name, None)
    if buffer is None or buffer.size < nbytes:
        buffer = np.empty(max(nbytes, 1), np.uint8)
        setattr(_scratch, name, buffer)
    return buffer[:nbytes].view(dtype).reshape(shape)


def group_major(codes: np.ndarray, group: int, name: str) -> np.ndarray:
    """Codes [P, rows, n] (their last axis contiguous; n a multiple of g), read as [rows, P * n], as groups of
    g: [P * n / g, rows, g] C-contiguous, this thread's scratch `name`. Each group's g codes move as one
    void item: a copy whose inner loop ran over g = 16 or 32 elements would cost more per loop than the
    copy (formats._contiguous_blocks' trap)."""
    planes, rows, n = codes.shape
    item = np.dtype((np.void, group * codes.itemsize))
    out = scratch(name, (planes, n // group, rows, group), codes.dtype)
    out.view(item)[..., 0] = codes.view(item).transpose(0, 2, 1)
    return out.reshape(-1, rows, group)


def widen_groups(codes: np.ndarray, a: np.ndarray, b: np.ndarray | None, out: np.ndarray) -> np.ndarray:
    """out [rows, in] = a q (+ b) group by group, codes [rows, in], a and b [rows, in/g]: the FP32 product
    first, then the sum, as ggml's reference dequantizers round them."""
    group = out.shape[-1] // a.shape[-1]
    out[...] = codes                                                   # exact: small integers
    # Full-size factors: they multiply faster than a broadcast over [rows, in/g, g], whose inner loop
    # runs only g elements (measured 1.2x; bench/README.md, "Bigger models in Q4_0").
    out *= np.repeat(a, group, axis=-1)
    if b is not None:
        out += np.repeat(b, group, axis=-1)
    return out


# A weight matrix as a model holds it: a NumPy array is always FULL_PRECISION (used as it is); every
# other kind is a Held, with its widen().
Weight = np.ndarray | Held


def held(stored: np.ndarray) -> Weight:
    """A tensor read from a checkpoint as a model holds it: FP32 as it is, 16-bit values as StoredRows."""
    return stored if stored.dtype in FULL_PRECISION else StoredRows(stored)


def upcast(weight: Weight | np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """FP32 copy of a weight of any kind (or of a stored BF16/F16/F32 array), optionally written into `out`."""
    if isinstance(weight, np.ndarray):
        if out is None:
            return weight.astype(np.float32)
        np.copyto(out, weight, casting="unsafe")
        return out
    if out is None:
        out = np.empty(weight.shape, dtype=np.float32)
    scale = weight.widen(out)
    if scale is not None:
        out *= scale[..., None]                                    # as formats.dequantize_int8_rows
    return out


@dataclass(frozen=True)
class Adapted:
    """A frozen weight W [out, in] of any kind with a LoRA adapter (training/lora.py): W + scale * B A.

    Why a weight kind and not a hook or a copy of the network: the adapter belongs to one projection,
    so it travels with that projection's weight; every product of the one network (layers.linear,
    the fast path, the backward) meets it where it meets W, and a model without adapters holds none.
    layers.linear multiplies as LoRA does, x W^T + scale (x A^T) B^T, never forming B A (rank r is
    small: two thin products instead of a new [out, in] matrix). widen() does form the merged rows, so
    anything written against Held (upcast, a row block of the streaming paths) reads the adapted
    weight correctly too: what merging into the checkpoint writes.
    """

    base: Weight                 # [out, in], frozen: never trained
    a: np.ndarray                # lora_A [r, in], FP32
    b: np.ndarray                # lora_B [out, r], FP32
    scale: float                 # alpha / r

    @property
    def shape(self) -> tuple[int, ...]:
        return self.base.shape

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.float32)

    @property
    def nbytes(self) -> int:
        return self.base.nbytes + self.a.nbytes + self.b.nbytes

    def __getitem__(self, rows: Any) -> "Adapted":
        return Adapted(self.base[rows], self.a, self.b[rows], self.scale)

    def widen(self, out: np.ndarray) -> None:
        """The merged rows W + scale * B A into out, in FP32 (the base's own scale, if any, applied)."""
        upcast(self.base, out)
        out += np.float32(self.scale) * (self.b @ self.a)                              # [rows, in]


@dataclass(frozen=True)
class RowAdapters:
    """A frozen weight W [out, in] of any kind with a different LoRA adapter for each group of the token rows
    it multiplies: a batch whose rows ask for different adapters (a server's; core/model.py's Batch makes
    it for one forward pass, from that pass's rows, and no model holds it).

    groups: (rows, Adapted) pairs, rows the packed rows of x that see that Adapted weight W + s_g B_g A_g (a
    slice, or their indices [n]); a row in no group sees W. layers.linear and fast.linear multiply W once for every row
    and add each group's rank-r update to its own rows only: one base serves every adapter, nothing copied.
    """

    base: Weight                                       # [out, in], the one frozen W of every group
    groups: tuple[tuple[slice | np.ndarray, Adapted], ...]     # (rows of x, the weight those rows see)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.base.shape

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.float32)

    @property
    def nbytes(self) -> int:
        return self.base.nbytes + sum(adapted.a.nbytes + adapted.b.nbytes for _, adapted in self.groups)

    def __getitem__(self, rows: Any) -> "RowAdapters":
        return RowAdapters(self.base[rows], tuple((x_rows, adapted[rows]) for x_rows, adapted in self.groups))

    def widen(self, out: np.ndarray) -> None:
        """No one matrix holds it (each group of rows sees its own): only a product can apply it."""
        raise TypeError("RowAdapters: the rows of a batch see different weights; multiply with layers.linear")


def without_adapters(weight: Weight) -> Weight:
    """The frozen base under an Adapted or RowAdapters weight (and under its base's adapters, if any); any
    other weight as it is."""
    while isinstance(weight, (Adapted, RowAdapters)):
        weight = weight.base
    return weight
