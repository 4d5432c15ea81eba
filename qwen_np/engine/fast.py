"""The fast forward path: the same network as model.py, arranged so that a token costs little more
than reading every weight once.

FastQwen3Model overrides Qwen3Model.forward_batch (which forward calls) for untraced calls (a traced
call runs the readable path, which reports every intermediate). Decoding is memory-bound: each new token reads every weight
and does one multiply-add with it. So this path adds no new math; it stops wasting memory traffic
and Python time:

* Activation buffers for a call are allocated once per token count and reused by every layer; a
  decode step (T = 1, or one token per sequence of a batch) reuses the same ones step after step.
  Elementwise steps write in place.
* q/k/v and gate/up are multiplied as one matrix each when load_model put them back to back in
  memory (loading.back_to_back; back_to_back_view finds them: a view, never a copy); q and k get one
  RMSNorm and one RoPE call.
* Attention reads the KV cache where it lies: the queries served by one KV head are stacked into a
  [group*T, Dh] matrix and multiplied with that head's cached keys as a strided view, which BLAS
  accepts, instead of np.repeat-copying the whole cache for every layer and token. A decode step
  uses one GEMV per query (np.matvec / np.vecmat) instead.
* A weight not held in FP32 (numerics' kinds: the stored BF16/F16 values, int8 rows) is streamed:
  each worker thread widens a block of rows into its own reused FP32 buffer that stays in cache
  (the kind's widen()), multiplies it from there with single-threaded BLAS, applies the scale the
  kind leaves for after the product (int8's row scales), and moves on.
  NumPy's BF16 upcast is single-threaded, so splitting rows between threads is what lets every core
  convert. The norms, RoPE, attention and SiLU of a prompt are then split by token rows between the
  same threads.
* A weight of llama.cpp's block kinds (numerics.Grouped: Q8_0, Q4_0, the K-quants, ...) is w = a q + b
  with a scale a and an offset b per group of g inputs. For a few rows of x its product folds them
  out (grouped_rows): only the integer codes q are cast to FP32, each group's dot products q . x are
  one batched BLAS call per block of rows, and y = sum_g a (q . x) + sum_g b (sum of x over the group).
  Widening the values instead costs two more passes over FP32 data per weight (the scale and the
  offset), which in NumPy cost more than the product itself (GROUPED_M_MAX).
* A weight held as numerics.Panels (load_model's default for FP32, where BLAS has a small-matrix
  kernel) is multiplied as x @ panels: one NumPy call per thread, a small GEMM per panel of 32 rows
  of W, which OpenBLAS runs at about the speed of reading W for a few rows of x as for one. On W's
  own [out, in] layout the same few rows are dot products per output (OpenBLAS's "TN" case), which
  ran at half that speed: 5 tokens cost 1.5-1.7x one token there, 1.2-1.3x on panels.
* Prefill for generation asks for the last position's logits only (forward(last_only=True)).

The weights are the model's own arrays, read on every call: updating them in place (training) is
seen by the next forward, and nothing here keeps a copy. The decode buffers are kept per model, so
one model must not run two forward passes at once from different threads.

Every function reproduces the matching function in layers.py up to FP32 rounding (BLAS may sum in a
different order); tests/engine/test_fast_path.py holds the two paths to 1e-5 relative. Where a decode
step's time goes, and the measurements behind each choice, are in bench/README.md.
"""

from __future__ import annotations

import functools
import math
import threading
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

import numpy as np
from numpy.lib.array_utils import byte_bounds

from ..core import layers
from ..core.adapters import Adapter
from . import moe, runtime
from ..core.config import Qwen3Config
from .memory import MemoryPlan
from ..core.kv_cache import SequenceCache
from ..core.batch import Batch, advance, output_rows
from ..core.model import LayerWeights, Qwen3Model, Trace
from .paged import OwnPoolCache, PagedKVCache
from ..errors import QwenNPError
from ..numbers.numerics import (Adapted, Grouped, Int8Rows, Panels, RowAdapters, Weight, is_grouped, scratch,
                                without_adapters)

# FP32 bytes each thread upcasts per block of a BF16 (or int8) weight: small enough that the block stays in
# cache between its upcast and its product, large enough that Python's per-block calls stay few. The best
# size differed with the core's L2 on the two machines measured: 8 MiB with a 1 MiB L2 (an AVX-512 EPYC:
# Qwen3-8B decode with 2, 4, 8 MiB blocks 1.41, 1.47, 1.60 tok/s), 2 MiB with a 512 KiB one (an AVX2-only
# EPYC: Qwen3-0.6B BF16, one token, 2 / 3 / 4 MiB 315 / 362 / 396 ms). 8 MiB where the OS does not say.
BLOCK_BYTES = 2 * 1024 ** 2 if (runtime.l2_bytes() or 1024 ** 2) < 1024 ** 2 else 8 * 1024 ** 2
# A product of a few rows (a batched decode step: one token per sequence; a few new tokens of one
# sequence) costs OpenBLAS far more than its FLOPs: its GEMM packs the whole weight first, which a GEMV
# never does. Where BLAS has a small-matrix kernel (M*N*K <= 100^3, no packing) x [M, in] with
# 2 <= M <= SMALL_M_MAX is multiplied by slices of W small enough for it (when those are at least
# SMALL_ROWS_MIN rows: a very wide W does not become thousands of calls; even 4-10-row slices beat the
# packing GEMM by 2-4x: Qwen3-8B's down_proj, a widened [128, 12288] block at M = 8, one thread, 1.6 ms
# in one call, 0.43-0.46 ms in 8-10-row slices; [512, 4096] at M = 16: 2.4 ms, 0.9-1.0). Qwen3-0.6B's gate|up
# [6144, 1024] at M = 5, one thread, weights not in cache, SkylakeX kernel: 5.9 ms in one call, 1.9 ms
# in slices, a GEMV 1.25 ms: the kernel runs at ~35 GFLOP/s, so 5 rows cost ~1.5x a GEMV, 9 rows ~1.8x
# (bench/README.md, few new tokens; W_s x^T slices were no faster in a whole forward).
# The kernel has a second condition for our layout (W^T transposed, OpenBLAS's "TN" case): it is
# used only while the slice's output has at most 1200 values (M x rows). 1e6 / 1024 = 976 met it for
# Qwen3-0.6B's products by luck; the bundled model's [1536, 256] at M = 5 took 270 us in 781-row
# slices (the packing GEMM) against 35 us in one GEMV.
SMALL_PRODUCT = 100 ** 3
SMALL_TN_OUTPUT = 1200
SMALL_M_MAX = 16
SMALL_ROWS_MIN = 4
# A few rows' product of a weight under this many bytes stays on the calling thread: handing half of
# it to a worker thread (~50-100 us) costs more than it saves (the bundled model's [256, 768] at M = 2:
# 10 us on one thread, 114 us split over two).
SPLIT_MIN_BYTES = 4 * 1024 ** 2
# Without that kernel (OpenBLAS's Haswell one, Zen's) up to MATVEC_M_MAX rows are one GEMV per row of x
# over slices of W of MATVEC_SLICE_BYTES, which stay in L2 between the rows (np.matvec: one call per
# slice): only the first row reads the slice from memory. gate|up, same conditions, Haswell kernel,
# GEMV 1.22 ms: M = 2 1.60 ms (one GEMM 3.7), M = 5 2.45 (4.05), M = 9 3.56 (4.41), M = 16 5.44 (4.65).
# A block of a stored (BF16, int8) weight is already in cache once widened, where the GEMM packs it
# cheaply: GEMVs win there up to M = 3 only (forwards of 5 tokens, 2 threads, quiet: Qwen3-0.6B BF16
# 1.93x one token with GEMVs, 1.97x without; Qwen3-8B BF16 shapes 3.57x against 2.32x; 9 tokens of 0.6B
# BF16 1.2x slower with them).
MATVEC_M_MAX = 9
MATVEC_M_MAX_WIDENED = 3
MATVEC_SLICE_BYTES = 512 * 1024
# The trap under both: NumPy's gufunc loops (np.matmul, np.matvec) let go of the GIL only when their
# output has more than 500 elements (NPY_BEGIN_THREADS_THRESHOLDED), np.dot's BLAS path always. A
# slice's product x [M, in] W_s^T has M x rows outputs: Qwen3-0.6B's down and o at M = 5-8 have
# 320-490, so with np.matmul our two threads took turns (down [1024, 3072] at M = 8, 2 threads:
# 1.16 ms with np.matmul, 0.79 with np.dot, one GEMV 0.41). So the small-matrix slices go through
# np.dot (into a contiguous scratch: np.dot writes only there), and the GEMV slices are made wide
# enough for their M (GIL_FREE_OUTPUT).
GIL_FREE_OUTPUT = 501
# Block kinds (numerics.Grouped) with up to this many rows of x fold the scales out of the product
# (grouped_rows); more rows (a prompt) widen a block of rows and multiply it, the GEMM amortising the
# widening over the rows. Repacked GGUF kinds (ggml_repacked.RepackedRows), [3072, 1024], two threads, an
# AVX2-only EPYC, ns a weight folded / widened: Q4_K 0.88 / 3.04 at 1 row, 1.45 / 3.21 at 5, 1.40 / 2.69
# at 16, 3.17 / 4.27 at 32, 4.67 / 5.00 at 64; Q8_0 0.56 / 1.57, 0.82 / 2.00, 1.19 / 2.02, 1.90 / 2.66,
# 3.66 / 3.31 (the rows widened as blocks were cheaper: 8 was the limit before).
GROUPED_M_MAX = 32
# The sizes of a grouped product's work, per thread: codes decoded per coded() call (its bit fields'
# NumPy calls cost microseconds each whatever their size), and FP32 bytes of them cast and multiplied
# per tile. Both large, though a tile then spills L2 to L3: each NumPy call lets go of the GIL and
# takes it back, and with two threads these short calls queued for it (the trap: more threads, slower
# products). Two threads, quiet machine, ns a weight (x BF16's product of the same shape, side by side),
# 1 Mi values / 512 KiB tiles -> 2 Mi / 2 MiB: Q4_K [6144, 1024] 1.45 (2.57x) -> 0.97 (1.71x), [1024, 3072]
# 1.85 (2.29x) -> 1.13 (1.40x); Q6_K unpacked 0.82 (1.45x) -> 0.47 (0.84x); 4 Mi / 4 MiB better for some
# shapes, worse for [1024, 3072] (1.96x). One thread: within the noise (Q4_K [8192, 1024] 0.69 -> 0.62).
GROUPED_DECODE_VALUES = 2 * 1024 ** 2
GROUPED_BLOCK_BYTES = 2 * 1024 * 1024


# --- matrix products -------------------------------------------------------------------------------

def linear(x: np.ndarray, weight: Weight, out: np.ndarray) -> np.ndarray:
    """out = x W^T, as layers.linear, written into `out`.  x [T, in], weight [out, in], out [T, out].

    FP32 weights go straight to BLAS, unless x has few rows (few_rows). For those, and for
    a BF16, int8 or block-kind weight, the rows of W (columns of out) are split evenly between
    runtime.threads() threads (a block kind's few rows of x as grouped_rows); call it inside
    runtime.single_threaded_blas() (forward does), or each thread's BLAS call would start threads of
    its own. An Adapted or RowAdapters weight (LoRA) is its base's product plus
    layers.add_adapter_products: the same two steps as layers.linear.
    """
    if isinstance(weight, (Adapted, RowAdapters)):     # LoRA: the base as any weight, then the thin rank-r updates
        linear(x, weight.base, out)
        layers.add_adapter_products(out, x, weight)
        return out
    if isinstance(weight, np.ndarray) and not few_rows(x.shape[0]):
        return np.matmul(x, weight.T, out=out)
    if isinstance(weight, Panels):
        return _panel_products(x, weight, out)
    if is_grouped(weight) and x.shape[0] <= GROUPED_M_MAX:
        order = weight.code_order                                   # x in the order of the codes
        coded = x if order is None else x[:, order]
        by_group = np.ascontiguousarray(coded.reshape(x.shape[0], -1, weight.group).transpose(1, 0, 2))   # [G, M, g]
        sums = by_group.sum(axis=2).T                                                                # [M, G]
        runtime.split(weight.shape[0], _parts(x, weight), lambda rows: grouped_rows(by_group, sums, weight, out, rows))
        return out
    runtime.split(weight.shape[0], _parts(x, weight), lambda rows: _rows(x, weight, out, rows))
    return out


def grouped_rows(by_group: np.ndarray, sums: np.ndarray, weight: Grouped, out: np.ndarray, part: slice) -> None:
    """out[:, part] = x W[part]^T for W = a q + b per group of g inputs (numerics.Grouped), without widening W:

        y[m, o] = sum_G a[o, G] (q[o, G] . x[m, G]) + sum_G b[o, G] sums[m, G]

    by_group: x as [G, M, g] (group G's inputs of every row of x), in the weight's code_order; sums: [M, G],
    each group's sum of x. A block of rows at a time (coded(): the codes group-major, a and b in the same
    order): its codes cast into this thread's FP32 scratch (exact), one batched product (per group, x's
    rows times the block's codes, each group's codes contiguous: 2.3-2.6x faster than the same product
    over [rows, G, g] codes, whose rows are in values apart), then a and b applied per group: the
    products [G, M, n] scaled in one broadcast and summed over G in one call (a loop over M of [G, n]
    slices, strided by M, cost 1.3-1.4x more at M = 5: bench/README.md).

    Trap: each group's product is OpenBLAS's "TN" case, whose AVX-512 small-matrix kernel stops at 1200
    outputs (SMALL_TN_OUTPUT); a 512-row tile at M = 5 (2560 outputs a group) took the packing GEMM, so
    up to SMALL_M_MAX rows of x the tiles there are small_product_rows' slices (1200 / M rows) for groups
    of 32 (Q4_K [6144, 1024] at M = 5, one thread: 1.05 -> 0.57 ns a weight). Not for more rows (the small
    tiles' extra NumPy calls cost more than they save), nor for groups of 16, whose small-kernel products
    ran slower than the packing GEMM's (bench/README.md)."""
    G, M, g = by_group.shape
    rows = max(1, GROUPED_DECODE_VALUES // (G * g))
    tile = max(1, GROUPED_BLOCK_BYTES // (4 * G * g))
    if g >= 32 and runtime.blas_has_small_matrix_kernel():     # each group's product on the small-matrix kernel
        tile = min(tile, small_product_rows(M, g) or tile)
    codes_f32 = scratch("fast.codes", (tile * G * g,))
    partial = scratch("fast.partial", (tile * G * M,))
    for start in range(part.start, part.stop, rows):
        stop = min(start + rows, part.stop)
        codes, scale, offset = weight[start:stop].coded()               # codes [G, n, g]; a, b [G, n]
        for first in range(0, stop - start, tile):
            last = min(first + tile, stop - start)
            q = codes_f32[:G * (last - first) * g].reshape(G, last - first, g)
            np.copyto(q, codes[:, first:last], casting="unsafe")        # exact: small integers
            dots = partial[:G * M * (last - first)].reshape(G, M, last - first)
            np.matmul(by_group, q.transpose(0, 2, 1), out=dots)         # [G, M, n]: x . q per group
            dots *= scale[:, None, first:last]
            y = out[:, start + first:start + last]                       # [M, n]
            np.sum(dots, axis=0, out=y)
            if offset is not None:
                y += sums @ offset[:, first:last]


def _parts(x: np.ndarray, weight: Weight) -> int:
    """Threads a product's weight is split between: one for a few rows of a small weight (SPLIT_MIN_BYTES;
    a weight not held in FP32 counted as FP32, since widening or unpacking its values is the work: Qwen3-0.6B's
    int8 o_proj and down_proj, 2-3 MB of codes, ran on one thread; bench/README.md, "Against NumPy's own limit")."""
    size = weight.nbytes if isinstance(weight, (np.ndarray, Panels)) else 4 * math.prod(weight.shape)
    return 1 if size < SPLIT_MIN_BYTES and x.shape[0] <= SMALL_M_MAX else runtime.threads()


def _panel_products(x: np.ndarray, weight: Panels, out: np.ndarray) -> np.ndarray:
    """out = x W^T for W held as Panels: x @ values, the panels split between runtime.threads() threads
    (one NumPy call each), each panel's product written straight into its P columns of out.

    One row is multiplied as two equal rows: OpenBLAS's GEMV over a panel's 32 columns ran slower than
    its small GEMM of 2 rows (Qwen3-0.6B, one token: 107-125 ms against 100-108; bench/README.md,
    "Panels"), and the second row costs no extra read of W."""
    if x.shape[0] == 1:
        twice = scratch("fast.twice", (2, out.shape[1]))
        _panel_products(np.concatenate([x, x]), weight, twice)
        out[...] = twice[:1]
        return out
    n, _, size = weight.values.shape
    by_panel = np.reshape(out, (x.shape[0], n, size), copy=False).transpose(1, 0, 2)     # [n, T, P] view
    runtime.split(n, _parts(x, weight), lambda p: np.matmul(x, weight.values[p], out=by_panel[p]))
    return out


def few_rows(M: int) -> bool:
    """Whether a product with M rows of x is multiplied in slices of W (see SMALL_PRODUCT, MATVEC_M_MAX)."""
    return 1 < M <= (SMALL_M_MAX if runtime.blas_has_small_matrix_kernel() else MATVEC_M_MAX)


def small_product_rows(M: int, columns: int, widened: bool = False) -> int | None:
    """Rows of W per BLAS call for x [M, columns]: a slice for the small-matrix kernel, or one that stays in
    L2 for the GEMVs; None (one call per thread's rows) for many rows of x, or when a small-matrix
    slice would be under SMALL_ROWS_MIN rows. widened: W is a block just widened (see MATVEC_M_MAX_WIDENED)."""
    if not few_rows(M):
        return None
    if not runtime.blas_has_small_matrix_kernel():
        rows = max(1, MATVEC_SLICE_BYTES // (4 * columns), -(-GIL_FREE_OUTPUT // M))
        return rows if M <= MATVEC_M_MAX_WIDENED or not widened else None
    rows = min(SMALL_PRODUCT // (M * columns), SMALL_TN_OUTPUT // M)
    return rows if rows >= SMALL_ROWS_MIN else None


def _rows(x: np.ndarray, weight: Weight, out: np.ndarray, part: slice) -> None:
    """out[:, part] = x W[part]^T: FP32 W in slices of small_product_rows; a stored (BF16 / int8) W
    upcast a cache-sized block of rows at a time, each block multiplied in those slices too."""
    step = small_product_rows(x.shape[0], x.shape[1], widened=not isinstance(weight, np.ndarray))
    if isinstance(weight, np.ndarray):                                  # FP32: as it is
        _products(x, weight[part], out[:, part], step)
        return
    rows, hi = _block_rows(weight.shape[1]), part.stop
    buffer = scratch("fast.block", (rows * weight.shape[1],))
    for start in range(part.start, hi, rows):
        stop = min(start + rows, hi)
        block = buffer[:(stop - start) * weight.shape[1]].reshape(stop - start, weight.shape[1])
        scale = weight[start:stop].widen(block)                       # numerics: exact FP32 values, or int8 codes
        _products(x, block, out[:, start:stop], step)
        if scale is not None:
            out[:, start:stop] *= scale                                 # y[o] = scale[o] (x . codes[o])


def _products(x: np.ndarray, weight: np.ndarray, out: np.ndarray, step: int | None) -> None:
    """out = x weight^T (FP32): in one BLAS call, or in slices of `step` rows of weight (few_rows): a
    small-matrix GEMM each where BLAS has that kernel (np.dot, see GIL_FREE_OUTPUT), else a GEMV per
    row of x (np.matvec: one call per slice)."""
    if step is None:
        if x.shape[0] * weight.shape[0] >= GIL_FREE_OUTPUT:
            np.matmul(x, weight.T, out=out)
        else:                                       # Qwen3-8B's down_proj: 128-row BF16 blocks
            _dot(x, weight, out)
        return
    small = runtime.blas_has_small_matrix_kernel()
    for start in range(0, weight.shape[0], step):
        part, columns = weight[start:start + step], slice(start, start + step)
        if small:
            _dot(x, part, out[:, columns])
        else:
            np.matvec(part, x, out=out[:, columns])


def _dot(x: np.ndarray, weight: np.ndarray, out: np.ndarray) -> None:
    """out = x weight^T by np.dot, which lets go of the GIL whatever the size (GIL_FREE_OUTPUT), into this
    thread's contiguous scratch (the only `out` np.dot takes), then copied to `out`."""
    product = scratch("fast.product", out.shape)
    np.dot(x, weight.T, out=product)
    out[...] = product


def _block_rows(columns: int) -> int:
    """Rows of a BF16 (or int8) weight upcast per block: BLOCK_BYTES of FP32, rounded down to a multiple of 64
    (whole GEMM panels: measured faster for both the prefill GEMM and the decode GEMV)."""
    rows = max(1, BLOCK_BYTES // (4 * columns))
    return rows - rows % 64 if rows >= 64 else rows


# --- the forward pass --------------------------------------------------------------------------------

class _Buffers:
    """Every activation of one decoder layer for T tokens, reused by all layers (and later calls)."""

    def __init__(self, config: Qwen3Config, T: int) -> None:
        D, F, H, KVH, Dh = (config.hidden_size, config.intermediate_size, config.num_attention_heads,
                            config.num_key_value_heads, config.head_dim)
        self.h = np.empty((T, D), np.float32)                          # normed input of a block
        self.qkv = np.empty((T, (H + 2 * KVH) * Dh), np.float32)      # q | k | v, side by side
        self.rope_scratch = np.empty((2, T, H + KVH, Dh // 2), np.float32)
        self.mixed = np.empty((T, H * Dh), np.float32)                 # attention output, head-major
        self.block_out = np.empty((T, D), np.float32)                  # o_proj / down_proj output
        self.gate_up = np.empty((T, 2 * F), np.float32)                # gate | up, side by side
        self.silu_scratch = np.empty((T, F), np.float32)


class _Fused:
    """A layer's q|k|v and gate|up as one matrix each, when its weights lie back to back in memory
    (views of the same memory: nothing to keep in sync); an adapted projection's base takes its place
    (its adapters are added after: _add_adapters). `parts` are the layer's own arrays they were made
    from: if one is replaced, the fused views are made again."""

    def __init__(self, w: LayerWeights) -> None:
        self.parts = (w.q_proj, w.k_proj, w.v_proj, w.gate_proj, w.up_proj)
        q, k, v = (without_adapters(part) for part in self.parts[:3])
        self.qkv = _joined([q, k, v])                                  # [(H + 2 KVH) Dh, D] or None
        # [2F, D] or None; None in a sparse layer (Qwen3-MoE), which has no dense MLP
        self.gate_up = (None if w.gate_proj is None or w.up_proj is None else
                        _joined([without_adapters(w.gate_proj), without_adapters(w.up_proj)]))

    def current(self, w: LayerWeights) -> bool:
        return all(a is b for a, b in zip(self.parts, (w.q_proj, w.k_proj, w.v_proj, w.gate_proj, w.up_proj)))


AnyWeight = TypeVar("AnyWeight", bound=Weight)    # a norm vector (np.ndarray) or a projection


def qwen3_weight(weight: AnyWeight | None, name: str) -> AnyWeight:
    """A weight every Qwen3 layer has. Only an ablation's layer lacks one, and FastQwen3Model refuses ablations."""
    if weight is None:
        raise QwenNPError(f"fast: the layer has no {name} (an ablation's layer; the fast path runs Qwen3 only)")
    return weight


def _joined(parts: list[Weight]) -> Weight | None:
    """The matrices as one [rows, in] matrix when their arrays lie back to back (back_to_back_view), else
    None: they are then multiplied one by one. Int8 rows need their codes back to back and their scales
    too (load_model carves each from an allocation of its own)."""
    if all(isinstance(part, Int8Rows) for part in parts):
        codes = back_to_back_view([part.codes for part in parts if isinstance(part, Int8Rows)])
        scale = back_to_back_view([part.scale for part in parts if isinstance(part, Int8Rows)])
        return None if codes is None or scale is None else Int8Rows(codes, scale)
    if all(isinstance(part, Panels) for part in parts):
        values = back_to_back_view([part.values for part in parts if isinstance(part, Panels)])
        return None if values is None else Panels(values)
    arrays = [part for part in parts if isinstance(part, np.ndarray)]
    return back_to_back_view(arrays) if len(arrays) == len(parts) else None


def back_to_back_view(parts: Sequence[np.ndarray]) -> np.ndarray | None:
    """The arrays as one [rows, ...] array, a view of their memory, when they lie back to back: slices of one
    flat allocation, in order, each ending where the next begins. That is the layout loading.back_to_back
    carves a layer's matrices in (and the weight cache's file keeps: its tensors in the table's order).
    Else None, never a copy: training updates the parts in place, and a copy would go stale."""
    first, flat = parts[0], parts[0].base
    if not (isinstance(flat, np.ndarray) and flat.ndim == 1 and flat.flags.c_contiguous and all(
            part.base is flat and part.flags.c_contiguous and part.dtype == flat.dtype
            and part.shape[1:] == first.shape[1:] for part in parts)):
        return None
    spans = [byte_bounds(part) for part in parts]                  # (first byte, one past the last byte)
    if any(end != begin for (_, end), (begin, _) in zip(spans, spans[1:])):
        return None
    start = (spans[0][0] - byte_bounds(flat)[0]) // flat.itemsize
    rows = sum(part.shape[0] for part in parts)
    return flat[start:start + rows * math.prod(first.shape[1:])].reshape(rows, *first.shape[1:])


class FastQwen3Model(Qwen3Model):
    """Qwen3Model whose untraced forward runs the fast path (same logits, tested)."""

    fast = True

    def __init__(self, config: Qwen3Config, embed_tokens: Weight, decoder_layers: list[LayerWeights],
                 norm: np.ndarray, lm_head: Weight | None, plan: MemoryPlan | None = None) -> None:
        if config.ablations:
            raise QwenNPError(f"fast: the fast path computes Qwen3 only, not the ablation {config.ablations}; use the "
                              "readable Qwen3Model (load_model(..., fast=False))")
        super().__init__(config, embed_tokens, decoder_layers, norm, lm_head, plan)
        self._decode_buffers = threading.local()              # .by_size: {T: _Buffers}, per thread
        self._fused: list[_Fused | None] = [None] * len(self.layers)

    def fused_weights(self, i: int) -> tuple[Weight | None, Weight | None]:
        """Layer i's q|k|v and gate|up as one matrix each (views of its weights), or None where the
        layer's matrices do not lie back to back."""
        w, fused = self.layers[i], self._fused[i]
        if fused is None or not fused.current(w):
            fused = self._fused[i] = _Fused(w)
        return fused.qkv, fused.gate_up

    def new_cache(self, max_tokens: int, dtype: str = "fp32") -> OwnPoolCache:
        """A paged cache over a pool of its own (decode steps read its blocks in place: _decode_attention)."""
        return OwnPoolCache(self.config, max_tokens, dtype)

    def forward_batch(self, token_ids: Sequence[Sequence[int] | np.ndarray], caches: Sequence[SequenceCache | None],
                      trace: Trace | None = None, last_only: bool = False,
                      tails: Sequence[int] | None = None, head: bool = True,
                      adapters: Sequence[Adapter | None] | None = None) -> np.ndarray:
        """Qwen3Model.forward_batch (and so forward): logits [T, V] ([B, V] if last_only, the last tails[b]
        rows of each sequence with tails); the final norm's output [..., D] there with head=False; each
        sequence's own adapter (`adapters`). A traced call runs the readable path."""
        if trace is not None:
            return super().forward_batch(token_ids, caches, trace, last_only, tails, head, adapters)
        head_weight = self.lm_head if head else None       # raises now, before any work, if there is none
        batch = self.pack(token_ids, caches, adapters)
        ids, rows = batch.ids, batch.rows
        picked = output_rows(rows, last_only, tails)           # checked before any work
        runtime.adapt_to_load()                  # fewer threads while other processes want the cores
        config, T = self.config, len(ids)
        buffers = self._buffers(T)
        x = layers.embed(ids, self.embed_tokens)                                     # [T, D]
        # Stored (BF16) weights are streamed by our threads with single-threaded BLAS; the steps
        # between products then split a prompt's rows between the same threads. With FP32 weights
        # OpenBLAS's own threads run the products and spin-wait between them, so the steps between
        # stay on one thread (measured: bench/README.md).
        # A batched decode step (a few tokens) multiplies FP32 weights the same way (linear).
        streamed = self._streams_weights() or few_rows(T)
        run = _Pass(batch, buffers, runtime.threads() if streamed else 1)
        blas = runtime.single_threaded_blas() if streamed else nullcontext()
        # SiLU's exp(-x) overflows to inf for x < -88, where silu(x) = x / inf = -0 is right: no warning.
        with blas, np.errstate(over="ignore"):
            for i, weights in enumerate(self.layers):
                self._layer(i, batch.layer_weights(i, weights), x, run)
            _rms_norm(x, self.norm, config.rms_norm_eps, out=buffers.h)
            h = buffers.h if picked is None else buffers.h[picked]
            if head_weight is None:
                advance(caches, ids, rows)
                return h.copy() if picked is None else h      # buffers.h is reused by the next call
            # A prefill's last rows of a few sequences: a small product, split like a decode step's.
            head_blas = runtime.single_threaded_blas() if few_rows(len(h)) and not streamed else nullcontext()
            with head_blas:
                logits = linear(h, head_weight, np.empty((len(h), config.vocab_size), np.float32))
        advance(caches, ids, rows)
        return logits

    def _buffers(self, T: int) -> _Buffers:
        """Activation buffers for T tokens: kept for decode-sized batches (reused step after step),
        fresh for a prompt (whose size changes from call to call)."""
        if T > MAX_KEPT_TOKENS:
            return _Buffers(self.config, T)
        kept = self._decode_buffers.__dict__.setdefault("by_size", {})      # this thread's own: threads that
        if T not in kept:                                                    # run forwards at once (eval's
            kept[T] = _Buffers(self.config, T)                               # windows) must not share them
        return kept[T]

    def _streams_weights(self) -> bool:
        """Whether any matrix is kept as stored (BF16/F16) or int8, and so is upcast block by block on use
        (an adapted one by its base: its adapters' thin products are FP32)."""
        matrices = [*([self.lm_head] if self.has_head else []),
                    *(without_adapters(m) for w in self.layers for m in w.matrices())]
        return not all(isinstance(m, np.ndarray) for m in matrices)

    def _layer(self, i: int, w: LayerWeights, x: np.ndarray, run: _Pass) -> None:
        """x += attention(input_layernorm(x)); x += mlp(post_attention_layernorm(x)), in place.  x [T, D],
        the tokens of every sequence of the batch (run.batch.rows says which are whose)."""
        eps, b = self.config.rms_norm_eps, run.buffers
        run.by_rows(lambda r: _rms_norm(x[r], w.input_layernorm, eps, out=b.h[r]))
        self._attention_block(i, w, run)                                            # b.h -> b.block_out

        def add_and_norm(r: slice) -> None:
            x[r] += b.block_out[r]
            _rms_norm(x[r], w.post_attention_layernorm, eps, out=b.h[r])

        run.by_rows(add_and_norm)
        self._mlp_block(i, w, run)                                                  # b.h -> b.block_out
        run.by_rows(lambda r: np.add(x[r], b.block_out[r], out=x[r]))

    def _attention_block(self, i: int, w: LayerWeights, run: _Pass) -> None:
        """block_out = o_proj(attention(q, k, v)) of the normed input h: q, k, v in one product when they lie
        back to back, QK-norm and RoPE in one pass over q and k, each sequence over its own cache's keys."""
        c, b, batch = self.config, run.buffers, run.batch
        T, H, KVH, Dh = len(batch.ids), c.num_attention_heads, c.num_key_value_heads, c.head_dim
        q_end, k_end = H * Dh, (H + KVH) * Dh
        qkv_weight = self.fused_weights(i)[0]
        q_norm, k_norm = qwen3_weight(w.q_norm, "q_norm"), qwen3_weight(w.k_norm, "k_norm")
        if qkv_weight is not None:                     # the bases as one matrix, then each one's adapters
            linear(b.h, qkv_weight, b.qkv)
            _add_adapters(b.h, [w.q_proj, w.k_proj, w.v_proj], b.qkv)
        else:
            linear(b.h, w.q_proj, b.qkv[:, :q_end])
            linear(b.h, w.k_proj, b.qkv[:, q_end:k_end])
            linear(b.h, w.v_proj, b.qkv[:, k_end:])

        def qk_norm_and_rope(r: slice) -> None:
            qk = b.qkv[r, :k_end].reshape(-1, H + KVH, Dh)     # q heads, then k heads: one norm, one RoPE
            _rms_norm(qk, None, c.rms_norm_eps, out=qk)
            qk[:, :H] *= q_norm
            qk[:, H:] *= k_norm
            _rope(qk, batch.cos[r], batch.sin[r], b.rope_scratch[:, r])

        run.by_rows(qk_norm_and_rope)
        q = b.qkv[:, :q_end].reshape(T, H, Dh)
        k = b.qkv[:, q_end:k_end].reshape(T, KVH, Dh)
        v = b.qkv[:, k_end:].reshape(T, KVH, Dh)

        def attend(keys: np.ndarray, values: np.ndarray, r: slice) -> None:
            _attention(q[r], keys, values, batch.positions[r], b.mixed[r])

        decoding: list[_Decoding] = []                  # the FP32 paged caches' decode steps
        for row, cache in zip(batch.rows, batch.caches):     # each sequence attends over its own keys only
            if cache is not None and row.stop - row.start == 1:     # a decode step
                cache.write(i, k[row], v[row])
                if isinstance(cache, PagedKVCache) and cache.dtype == "fp32":      # over the blocks where they lie
                    decoding.append(_Decoding(row.start, cache.runs(i, cache.length + 1)))
                else:        # over reused buffers (the next cache's read overwrites them): now; int8's scales apart
                    read = cache.unscaled(i, cache.length + 1)
                    _decode_attention(q, [_Decoding(row.start, [(read.keys, read.values)], read.key_scales,
                                                    read.value_scales)], b.mixed)
                continue
            keys, values = (k[row], v[row]) if cache is None else cache.append(i, k[row], v[row])  # [S, KVH, Dh]
            run.by_rows(functools.partial(attend, keys, values), row)
        if decoding:                                    # every decoding sequence's softmax in one go
            _decode_attention(q, decoding, b.mixed)
        linear(b.mixed, w.o_proj, b.block_out)

    def _mlp_block(self, i: int, w: LayerWeights, run: _Pass) -> None:
        """block_out = down_proj(silu(gate_proj(h)) * up_proj(h)): gate and up in one product when they lie
        back to back; a sparse layer's mixture of experts (moe.sparse_mlp)."""
        b, F, c = run.buffers, self.config.intermediate_size, self.config
        if w.router is not None and w.experts is not None:            # a sparse layer (Qwen3-MoE): engine/moe.py
            moe.sparse_mlp(b.h, w.router, w.experts, c.num_experts_per_tok, c.norm_topk_prob, b.block_out, linear)
            return
        gate_up_weight = self.fused_weights(i)[1]
        if gate_up_weight is not None:
            linear(b.h, gate_up_weight, b.gate_up)
            _add_adapters(b.h, [qwen3_weight(w.gate_proj, "gate_proj"), qwen3_weight(w.up_proj, "up_proj")], b.gate_up)
        else:
            linear(b.h, qwen3_weight(w.gate_proj, "gate_proj"), b.gate_up[:, :F])
            linear(b.h, qwen3_weight(w.up_proj, "up_proj"), b.gate_up[:, F:])
        gate, up = b.gate_up[:, :F], b.gate_up[:, F:]
        run.by_rows(lambda r: _silu_times(gate[r], up[r], b.silu_scratch[r]))
        linear(gate, qwen3_weight(w.down_proj, "down_proj"), b.block_out)


@dataclass(frozen=True)
class _Pass:
    """What one forward pass's layers share: the packed batch (ids, positions, each sequence's rows and cache,
    RoPE's tables), the activation buffers, and `parts`: every step between the products treats token rows
    independently (attention too, once this call's keys are in the cache), so each runs as up to `parts`
    slices of rows at once (see runtime.split)."""

    batch: Batch
    buffers: _Buffers
    parts: int

    def by_rows(self, step: Callable[[slice], object], within: slice | None = None) -> None:
        """step(r) for the rows `within` (default: all), as up to `parts` slices run at once."""
        within = slice(0, len(self.batch.ids)) if within is None else within
        n = within.stop - within.start
        split = min(self.parts, n // MIN_ROWS_PER_THREAD)
        if split > 1:
            runtime.split(n, split, lambda r: step(slice(within.start + r.start, within.start + r.stop)))
        else:
            step(within)


def _add_adapters(x: np.ndarray, parts: list[Weight], out: np.ndarray) -> None:
    """out += the LoRA updates of the adapted ones of `parts`, matrices multiplied as one (their frozen bases
    joined: _Fused), each into its own columns of out [T, sum of their rows]; every level of adapters, as
    linear's recursion into a base would add them."""
    start = 0
    for part in parts:
        columns, level = out[:, start:start + part.shape[0]], part
        while isinstance(level, (Adapted, RowAdapters)):
            layers.add_adapter_products(columns, x, level)
            level = level.base
        start += part.shape[0]


# Rows per thread below which a step stays on one thread: handing a job to a worker thread costs
# ~0.05-0.1 ms, more than the norms or RoPE of a few rows take.
MIN_ROWS_PER_THREAD = 16
# Batches of up to this many tokens (decode steps) keep their activation buffers between calls.
MAX_KEPT_TOKENS = 64


def _rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float, out: np.ndarray) -> np.ndarray:
    """layers.rms_norm into `out` (which may be x itself); weight None leaves the multiply to the caller.

    np.vecdot sums the squares without writing them out, where np.mean(x * x) makes two passes and a
    temporary (measured faster: bench/README.md).
    """
    inverse = np.vecdot(x, x)[..., None]                                        # [..., 1] sum of squares
    inverse /= np.float32(x.shape[-1])
    inverse += np.float32(eps)
    np.sqrt(inverse, out=inverse)
    np.divide(np.float32(1.0), inverse, out=inverse)
    np.multiply(x, inverse, out=out)
    if weight is not None:
        out *= weight
    return out


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, scratch: np.ndarray) -> None:
    """layers.rope in place on x [T, heads, Dh]: (a, b) -> (a cos - b sin, b cos + a sin) per half.

    Both halves of the cos/sin tables are equal, so only the first is read. a*cos + (-b)*sin in
    layers.rope rounds exactly like a*cos - b*sin: negation is exact.
    """
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    c, s = cos[:, None, :half], sin[:, None, :half]
    b_sin, a_sin = scratch[0], scratch[1]
    np.multiply(b, s, out=b_sin)
    np.multiply(a, s, out=a_sin)
    a *= c
    a -= b_sin
    b *= c
    b += a_sin


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray, out: np.ndarray) -> None:
    """layers.attention into `out` [T, H*Dh]: q [T, H, Dh], k/v [S, KVH, Dh] (cache views).

    Query head h = j*group + g reads KV head j, so the group's queries are rows of one matrix per KV
    head: scores [KVH, group*T, S] = q_j @ k_j^T, with k_j a strided view of the cache.
    """
    T, H, Dh = q.shape
    S, KVH = k.shape[0], k.shape[1]
    group = H // KVH
    if T == 1 and positions[0] + 1 == S:
        return _decode_attention(q, [_Decoding(0, [(k, v)])], out)
    queries = q.reshape(T, KVH, group, Dh).transpose(1, 2, 0, 3).reshape(KVH, group * T, Dh)
    scores = np.matmul(queries, k.transpose(1, 2, 0))                            # [KVH, group*T, S]
    scores *= np.float32(Dh ** -0.5)
    future = np.arange(S)[None, :] > positions[:, None]                           # [T, S]
    np.copyto(scores.reshape(KVH, group, T, S), -np.inf, where=future)
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    mixed = np.matmul(scores, v.transpose(1, 0, 2))                              # [KVH, group*T, Dh]
    out.reshape(T, KVH, group, Dh)[...] = mixed.reshape(KVH, group, T, Dh).transpose(2, 0, 1, 3)


@dataclass(frozen=True)
class _Decoding:
    """One sequence's decode step for _decode_attention: its row of q and out, its keys and values in runs of
    positions, in order, k/v [S_i, KVH, Dh] each (cache views: a paged cache's runs of consecutive blocks, so
    scattered blocks are read where they lie, not gathered into a copy first), and an int8 cache's scales
    [S, KVH] (kv_cache.Unscaled: the runs hold its widened codes; one run then)."""

    row: int
    runs: list[tuple[np.ndarray, np.ndarray]]
    key_scales: np.ndarray | None = None
    value_scales: np.ndarray | None = None


def _decode_attention(q: np.ndarray, rows: list[_Decoding], out: np.ndarray) -> None:
    """One new token at the end of its cache (it sees every key), for each of several sequences (_Decoding):
    q [T, H, Dh], out [T, H*Dh]. int8's scales multiply the scores (q . code * scale = (q . code) * scale)
    and the weights (sum_s w_s scale_s code_s), S numbers a head, instead of every code.

    Per KV head this is a matrix-vector product per query of its group, so NumPy's matvec/vecmat
    (one BLAS GEMV per query, no batching machinery) beat a batched matmul of [group, Dh] x [Dh, S]
    matrices (measured: bench/README.md). Each sequence's scores go into one [B, KVH, group, S_max]
    array (-inf past its own keys, exp(-inf) = 0), so the softmax is a few NumPy calls for all B
    sequences of a batch's decode step rather than a few per sequence (~30 us each); then each run's
    share of the weighted sum is added (one run: exactly one vecmat).
    """
    H, Dh = q.shape[1:]
    KVH = rows[0].runs[0][0].shape[1]
    lengths = [sum(len(k) for k, _ in d.runs) for d in rows]
    scores = np.full((len(rows), KVH, H // KVH, max(lengths)), -np.inf, np.float32)    # [B, KVH, group, S]
    for b, d in enumerate(rows):
        queries, start = q[d.row].reshape(KVH, H // KVH, Dh), 0                       # [KVH, group, Dh]
        for k, _ in d.runs:
            np.matvec(k.transpose(1, 0, 2)[:, None], queries, out=scores[b, ..., start:start + len(k)])
            start += len(k)
        if d.key_scales is not None:
            scores[b, ..., :start] *= d.key_scales.T[:, None]                         # [KVH, 1, S]
    scores *= np.float32(Dh ** -0.5)
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    for b, d in enumerate(rows):
        mixed, start = out[d.row].reshape(KVH, H // KVH, Dh), 0
        if d.value_scales is not None:
            scores[b, ..., :lengths[b]] *= d.value_scales.T[:, None]                  # the weights times the scales
        for j, (_, v) in enumerate(d.runs):
            weights, values = scores[b, ..., start:start + len(v)], v.transpose(1, 0, 2)[:, None]
            if j:
                mixed += np.vecmat(weights, values)                                   # [KVH, group, Dh]
            else:
                np.vecmat(weights, values, out=mixed)
            start += len(v)


def _silu_times(gate: np.ndarray, up: np.ndarray, scratch: np.ndarray) -> None:
    """gate <- silu(gate) * up, in place, rounding as layers.silu(gate) * up does."""
    np.negative(gate, out=scratch)
    np.exp(scratch, out=scratch)                 # overflows to inf for gate < -88 (forward ignores it)
    scratch += np.float32(1.0)
    np.divide(gate, scratch, out=gate)
    gate *= up

