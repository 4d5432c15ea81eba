"""Number formats for weights: quantize FP32 to a smaller format and dequantize back to FP32.

`round_trip(x, fmt)` is the whole story for a precision experiment: the FP32 values a model would
compute with if its weights were stored in `fmt`. Each format is a quantize/dequantize pair of small
functions; the quantized parts are the storage an inference mode would keep (int8 codes plus scales).

Shapes: a weight is [out, in] (as nn.Linear stores it, y = x W^T). Every function also accepts any
[..., in]: the leading axes are "rows", the last axis is the one scales and blocks run along.

Decisions (the numbers a reader needs to compare with other tools):
* Plain casts (fp16, bf16) round to nearest, ties to even, as hardware does, and follow IEEE:
  NaN stays NaN, inf stays inf, finite values past the format's largest overflow to +-inf
  (fp16: |x| >= 65520; bf16: |x| >= 2^128 (1 - 2^-9)).
* Scaled formats map the largest |value| of their group onto the format's largest code:
  - "per tensor" (fp8_e4m3, fp8_e5m2): one FP32 scale, amax/448 (E4M3FN) or amax/57344 (E5M2).
  - "per channel" (int8, fp8_*_rows): one FP32 scale per output channel, i.e. per row of [out, in]
    (each output y[o] then has a single scale, which an inference mode can apply after the dot product).
  - blocks (q8_0, q4_0, mxfp4): one scale per 32 consecutive values of a row, as llama.cpp and OCP MX
    do; the last axis must be a multiple of 32.
  FP8 values are clipped to the format's range before the cast (saturation): ml_dtypes' E4M3FN cast
  turns |x| >= 465 into NaN. With the amax scale x / scale stays within an ulp of 448; a scale given
  by the caller (calibrated, shared between tensors) can push values far past it.
* A scaled format refuses NaN and inf (QwenNPError): a single inf makes every scale of its group
  infinite, and the integer codes have no NaN to carry. A weight with NaN is broken; say so early.
  q8_0 and q4_0 also refuse a block whose FP16 scale would overflow (|x| >= 127 * 65520 ~ 8.3e6 for
  q8_0, 8 * 65520 = 524160 for q4_0), where llama.cpp would store an infinite scale.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import QwenNPError
from .names import FORMATS
from .numerics import bf16_bits_to_f32, dtype_named, f32_to_bf16_bits, group_major, scratch, widen_groups

BLOCK = 32                                   # values per block in q8_0, q4_0 and mxfp4
E4M3_MAX = np.float32(448.0)                 # largest finite float8_e4m3fn
E5M2_MAX = np.float32(57344.0)               # largest finite float8_e5m2
INT8_MAX = np.float32(127.0)                 # symmetric int8: -128 is never used


# ---- helpers shared by the formats ----------------------------------------------------------------

def _as_f32(x: np.ndarray, fmt: str) -> np.ndarray:
    """x as a C-contiguous FP32 array of at least one axis."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim == 0 or x.size == 0:
        raise QwenNPError(f"{fmt}: expected a non-empty array with at least one axis, got shape {x.shape}")
    return x


def _finite(x: np.ndarray, fmt: str) -> np.ndarray:
    """x as FP32, or a QwenNPError if it holds NaN or inf (scaled formats cannot represent them)."""
    x = _as_f32(x, fmt)
    bad = x.size - int(np.count_nonzero(np.isfinite(x)))
    if bad:
        raise QwenNPError(f"{fmt}: cannot quantize non-finite values ({bad} NaN/inf in an array of shape "
                          f"{x.shape}); its scales come from the largest |value|")
    return x


def _blocks(x: np.ndarray, fmt: str) -> np.ndarray:
    """[..., in] FP32 -> [..., in/32, 32] view, or a QwenNPError naming the shape."""
    x = _finite(x, fmt)
    if x.shape[-1] % BLOCK:
        raise QwenNPError(f"{fmt}: the last axis must be a multiple of {BLOCK} (blocks of {BLOCK} values), "
                          f"got shape {x.shape}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)


def _output(shape: tuple[int, ...], out: np.ndarray | None) -> np.ndarray:
    """The FP32 array to dequantize into: `out` if given (checked), else a new one."""
    if out is None:
        return np.empty(shape, dtype=np.float32)
    if out.shape != shape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise QwenNPError(f"dequantize: out must be a C-contiguous float32 array of shape {shape}, "
                          f"got {out.dtype} {out.shape}")
    return out


def _reciprocal(scale: np.ndarray) -> np.ndarray:
    """1 / scale in FP32, 0 where the scale is 0 or so small (< 2^-128) that 1/scale overflows.

    Trap: llama.cpp computes `id = d ? 1/d : 0`; for an all-subnormal block 1/d is inf and x * inf
    has no integer code. Those blocks store an FP16 scale of 0, so any code dequantizes to 0: use 0.
    """
    with np.errstate(divide="ignore", over="ignore"):
        inverse = np.float32(1.0) / np.asarray(scale, dtype=np.float32)   # 0-d for a 1-D x's one row
    return np.where(np.isfinite(inverse), inverse, np.float32(0.0))


def _round_half_away(v: np.ndarray) -> np.ndarray:
    """C's roundf (ties away from zero), exact in floating point.

    Trap: trunc(v + 0.5) is wrong for v = 0.5 - 2^-25 (the sum rounds up to 1.0). The integer part
    and twice the fraction are both exact, so trunc(2 * frac) adds the 1 exactly when |frac| >= 0.5.
    """
    whole = np.trunc(v)
    return whole + np.trunc(2 * (v - whole))


def _fp16_scales(d: np.ndarray, fmt: str) -> np.ndarray:
    """Block scales rounded to FP16, or a QwenNPError if one overflows (llama.cpp would store inf)."""
    with np.errstate(over="ignore"):
        d16 = d.astype(np.float16)
    if np.isinf(d16).any():
        raise QwenNPError(f"{fmt}: a block scale of {float(np.max(np.abs(d))):.4g} overflows FP16 (largest "
                          f"65504); values this large cannot be stored in {fmt}")
    return d16


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """[..., in/32, 32] codes 0..15 -> [..., in/32, 16] bytes: element j low nibble, j + 16 high (llama.cpp)."""
    return codes[..., :16] | (codes[..., 16:] << np.uint8(4))


def _contiguous_blocks(codes: np.ndarray, name: str | None = None) -> np.ndarray:
    """codes [..., in/32, k] (k bytes per block, possibly a strided view: the codes of a GGUF file's
    blocks, k of every k + 2 bytes) as a C-contiguous array of the same shape and dtype (this thread's
    numerics.scratch `name` if named, else a new one).

    Trap: any NumPy loop over such a view runs an inner loop only k = 16 or 32 elements long, whose
    per-loop cost dominates (a nibble mask: 0.26 ns per weight). Viewed as one k-byte void item per
    block, the copy runs one long loop over the blocks (0.012 ns per weight; bench/README.md)."""
    if codes.flags.c_contiguous:
        return codes
    block = np.dtype((np.void, codes.shape[-1] * codes.itemsize))
    if name is None:
        return np.ascontiguousarray(codes.view(block)).view(codes.dtype).reshape(codes.shape)
    out = scratch(name, codes.shape, codes.dtype)
    out.view(block)[..., 0] = codes.view(block)[..., 0]
    return out


def _unpack_nibbles(packed: np.ndarray, name: str | None = None) -> np.ndarray:
    """[..., in/32, 16] bytes (any strides) -> [..., in/32, 32] codes 0..15 (inverse of _pack_nibbles),
    in this thread's numerics.scratch `name` (and names derived from it) if named, else new arrays.

    The masks run over the contiguous bytes as one flat loop, and each half-block of 16 codes is placed
    as one 16-byte void item: no NumPy loop runs over a 16-element axis (see _contiguous_blocks)."""
    def array(suffix: str, shape: tuple[int, ...]) -> np.ndarray:
        return np.empty(shape, np.uint8) if name is None else scratch(f"{name}{suffix}", shape, np.uint8)

    packed = _contiguous_blocks(packed, None if name is None else f"{name}.packed")
    half = np.dtype((np.void, BLOCK // 2))
    codes = array("", (*packed.shape[:-1], 2, BLOCK // 2))             # [..., in/32, low | high, 16]
    items = codes.view(half)[..., 0]                                   # [..., in/32, 2] of 16 bytes
    nibbles = array(".nibbles", packed.shape)
    items[..., 0] = np.bitwise_and(packed, np.uint8(0x0F), out=nibbles).view(half)[..., 0]
    items[..., 1] = np.right_shift(packed, np.uint8(4), out=nibbles).view(half)[..., 0]
    return codes.reshape(*packed.shape[:-1], BLOCK)


def _group_major_scales(d: np.ndarray, name: str) -> np.ndarray:
    """FP16 block scales [..., in/32] as FP32 [..., in/32], a transposed view of this thread's group-major
    scratch `name` (the layout the fast path applies them in: numerics.Grouped)."""
    rows = d.reshape(-1, d.shape[-1])
    out = scratch(name, rows.shape[::-1], np.float32)
    np.copyto(out, rows.T)
    return out.T.reshape(d.shape)


# ---- plain casts: fp32, fp16, bf16 ----------------------------------------------------------------

def quantize_fp32(x: np.ndarray) -> tuple[np.ndarray]:
    """The baseline: an FP32 copy."""
    return (_as_f32(x, "fp32").copy(),)


def dequantize_fp32(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    out = _output(x.shape, out)
    out[...] = x
    return out


def quantize_fp16(x: np.ndarray) -> tuple[np.ndarray]:
    """FP32 -> IEEE half (NumPy's cast: nearest-even, subnormals kept, overflow to inf)."""
    with np.errstate(over="ignore"):                            # overflow to inf is the stated policy
        return (_as_f32(x, "fp16").astype(np.float16),)


def dequantize_fp16(h: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    out = _output(h.shape, out)
    out[...] = h                                                # exact: every half is an FP32
    return out


def quantize_bf16(x: np.ndarray) -> tuple[np.ndarray]:
    """FP32 -> BF16 bits (uint16), nearest-even, the same rounding the checkpoint writer uses."""
    return (f32_to_bf16_bits(_as_f32(x, "bf16")),)


def dequantize_bf16(bits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    return bf16_bits_to_f32(bits, _output(bits.shape, out))    # exact, as the loader's upcast


# ---- scaled floats: FP8 E4M3FN / E5M2, per tensor or per row ---------------------------------------

def _quantize_fp8(x: np.ndarray, dtype: str, largest: np.float32, per_row: bool, fmt: str,
                  scale: np.ndarray | float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """x [..., in] -> (codes [..., in] of the dtype named `dtype` (dtype_named), FP32 scale: [] per tensor or
    [...] per row).

    The scale maps each group's amax onto `largest`, unless one is given (e.g. a calibrated or shared
    scale); then values past the range saturate instead of becoming NaN.
    """
    x = _finite(x, fmt)
    if scale is None:
        amax = np.max(np.abs(x), axis=-1) if per_row else np.max(np.abs(x))
        scale = np.asarray(amax / largest, dtype=np.float32)
        scale[scale == 0] = 1.0                                 # an all-zero group: any scale works
    scale = np.asarray(scale, dtype=np.float32)
    if not np.all(scale > 0) or not np.all(np.isfinite(scale)):
        raise QwenNPError(f"{fmt}: scales must be positive and finite, got {scale.ravel()[:4]}")
    scaled = x / scale[..., None]
    np.clip(scaled, -largest, largest, out=scaled)              # saturate (see module notes)
    return scaled.astype(dtype_named(dtype)), scale


def dequantize_scaled(codes: np.ndarray, scale: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """codes [..., in] (int8 or FP8) * scale ([] per tensor or [...] per row) -> FP32 [..., in]."""
    out = _output(codes.shape, out)
    out[...] = codes                                            # exact: FP8 and int8 fit in FP32
    out *= np.asarray(scale, dtype=np.float32)[..., None]
    return out


def quantize_fp8_e4m3(x: np.ndarray,
                      scale: np.ndarray | float | None = None) -> tuple[np.ndarray, np.ndarray]:
    return _quantize_fp8(x, "float8_e4m3fn", E4M3_MAX, per_row=False, fmt="fp8_e4m3", scale=scale)


def quantize_fp8_e5m2(x: np.ndarray,
                      scale: np.ndarray | float | None = None) -> tuple[np.ndarray, np.ndarray]:
    return _quantize_fp8(x, "float8_e5m2", E5M2_MAX, per_row=False, fmt="fp8_e5m2", scale=scale)


def quantize_fp8_e4m3_rows(x: np.ndarray,
                           scale: np.ndarray | float | None = None) -> tuple[np.ndarray, np.ndarray]:
    return _quantize_fp8(x, "float8_e4m3fn", E4M3_MAX, per_row=True, fmt="fp8_e4m3_rows", scale=scale)


def quantize_fp8_e5m2_rows(x: np.ndarray,
                           scale: np.ndarray | float | None = None) -> tuple[np.ndarray, np.ndarray]:
    return _quantize_fp8(x, "float8_e5m2", E5M2_MAX, per_row=True, fmt="fp8_e5m2_rows", scale=scale)


# ---- INT8 per output row ---------------------------------------------------------------------------

def quantize_int8_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] -> (q int8 [out, in], scale FP32 [out]); w ~ q * scale[:, None].

    scale = amax(row) / 127, q = rint(w * (1 / scale)) (ties to even, as torch's quantize_per_channel).
    """
    w = _finite(w, "int8")
    scale = np.max(np.abs(w), axis=-1) / INT8_MAX                         # [out]
    q = np.rint(w * _reciprocal(scale)[..., None])                        # [out, in], |q| <= 127
    np.clip(q, -INT8_MAX, INT8_MAX, out=q)                                # w * (1/scale) may be 127.00001
    return q.astype(np.int8), scale


def dequantize_int8_rows(q: np.ndarray, scale: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """q int8 [out, in], scale [out] -> FP32 [out, in]; pass rows q[a:b], scale[a:b] to do a block."""
    return dequantize_scaled(q, scale, out)


# ---- llama.cpp Q8_0 --------------------------------------------------------------------------------

def quantize_q8_0(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] -> (q int8 [out, in], d FP16 [out, in/32]), as ggml's quantize_row_q8_0_ref.

    d = amax(block) / 127; q = roundf(w * (1/d)) with the FP32 d, before d is rounded to FP16.
    34 bytes per 32 weights on disk (8.5 bits).
    """
    blocks = _blocks(w, "q8_0")                                          # [out, in/32, 32]
    d = np.max(np.abs(blocks), axis=-1) / INT8_MAX                       # [out, in/32] FP32
    q = _round_half_away(blocks * _reciprocal(d)[..., None])             # [out, in/32, 32]
    return q.astype(np.int8).reshape(w.shape), _fp16_scales(d, "q8_0")


def dequantize_q8_0(q: np.ndarray, d: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """q int8 [out, in] or [out, in/32, 32] (a view of a GGUF's blocks), d FP16 [out, in/32] -> FP32
    [out, in]: q * float(d), block by block."""
    return widen_groups(*q8_0_groups(q, d), out=_output(d.shape[:-1] + (d.shape[-1] * BLOCK,), out))


def q8_0_groups(q: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    """Q8_0 as numerics.Grouped parts: (codes int8 [out, in], d as FP32 [out, in/32], no offset), in this
    thread's scratch memory (valid until its next call)."""
    codes = _contiguous_blocks(q.reshape(d.shape + (BLOCK,)), "q8_0.codes")    # [out, in/32, 32]
    return codes.reshape(*d.shape[:-1], -1), _group_major_scales(d, "q8_0.d"), None


# ---- llama.cpp Q4_0 --------------------------------------------------------------------------------

def quantize_q4_0(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] -> (nibbles uint8 [out, in/2], d FP16 [out, in/32]), as ggml's quantize_row_q4_0_ref.

    m = the value of largest |w| in the block (signed, first one on ties), d = m / -8, so m itself
    maps to code 0 (value -8 d = m) and the other side gets codes up to 15 (7 d). code =
    min(15, trunc(w / d + 8.5)), i.e. round half up of w/d + 8. 18 bytes per 32 weights (4.5 bits).
    """
    blocks = _blocks(w, "q4_0")                                          # [out, in/32, 32]
    largest = np.argmax(np.abs(blocks), axis=-1)[..., None]              # [out, in/32, 1]
    d = np.take_along_axis(blocks, largest, axis=-1)[..., 0] / np.float32(-8.0)   # [out, in/32]
    codes = np.trunc(blocks * _reciprocal(d)[..., None] + np.float32(8.5))
    codes = np.minimum(codes, 15).astype(np.uint8)                       # [out, in/32, 32] in 0..15
    return _pack_nibbles(codes).reshape(*w.shape[:-1], -1), _fp16_scales(d, "q4_0")


def dequantize_q4_0(nibbles: np.ndarray, d: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """nibbles uint8 [out, in/2] or [out, in/32, 16] (a view of a GGUF's blocks), d FP16 [out, in/32]
    -> FP32 [out, in]: (code - 8) * float(d), one rounding, as gguf's dequantizer."""
    return widen_groups(*q4_0_groups(nibbles, d), out=_output(d.shape[:-1] + (d.shape[-1] * BLOCK,), out))


def q4_0_groups(nibbles: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    """Q4_0 as numerics.Grouped parts: (code - 8 as int8 [out, in], d as FP32 [out, in/32], no offset), in
    this thread's scratch memory (valid until its next call)."""
    codes = _unpack_nibbles(nibbles.reshape(d.shape + (BLOCK // 2,)), "q4_0.codes")   # [out, in/32, 32] in 0..15
    codes -= np.uint8(8)                                # wraps: as int8 the bytes read code - 8 in -8..7
    return codes.view(np.int8).reshape(*d.shape[:-1], -1), _group_major_scales(d, "q4_0.d"), None


# ---- OCP MXFP4 -------------------------------------------------------------------------------------

E2M1_EMAX = 2               # the largest E2M1 value is 6 = 1.5 * 2^2
E8M0_BIAS = 127


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] -> (nibbles uint8 [out, in/2] of E2M1 codes, e uint8 [out, in/32] E8M0 exponents).

    OCP MX v1.0: the block scale is X = 2^(floor(log2 amax) - 2); elements are w / X rounded to
    E2M1 (nearest even, saturating at +-6). Codes are packed as llama.cpp's MXFP4 (4.25 bits).
    floor(log2 amax) comes from frexp, exactly (float32 log2 rounds up just below a power of two).
    An all-zero block gets e = 0, as llama.cpp writes it.
    """
    blocks = _blocks(w, "mxfp4")                                         # [out, in/32, 32]
    amax = np.max(np.abs(blocks), axis=-1)                               # [out, in/32]
    _, exponent = np.frexp(amax)                                         # amax = m 2^exponent, m in [0.5, 1)
    e = np.where(amax > 0, exponent - 1 - E2M1_EMAX + E8M0_BIAS, 0)
    e = np.clip(e, 0, 254).astype(np.uint8)                              # 255 is E8M0's NaN
    scaled = np.ldexp(blocks, (E8M0_BIAS - e.astype(np.int32))[..., None])   # exact: a power of two
    codes = scaled.astype(dtype_named("float4_e2m1fn")).view(np.uint8)        # [out, in/32, 32] in 0..15
    return _pack_nibbles(codes).reshape(*w.shape[:-1], -1), e


def dequantize_mxfp4(nibbles: np.ndarray, e: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """nibbles uint8 [out, in/2], e uint8 [out, in/32] -> FP32 [out, in]: E2M1 value * 2^(e - 127)."""
    out = _output(e.shape[:-1] + (e.shape[-1] * BLOCK,), out)
    codes = _unpack_nibbles(nibbles.reshape(e.shape + (BLOCK // 2,)))   # [out, in/32, 32]
    values = codes.view(dtype_named("float4_e2m1fn")).astype(np.float32)
    np.ldexp(values, (e.astype(np.int32) - E8M0_BIAS)[..., None], out=out.reshape(codes.shape))
    return out


# ---- the table -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Format:
    """One storage format: quantize(x [..., in]) -> parts; dequantize(*parts, out=None) -> FP32 [..., in]."""

    name: str
    bits_per_weight: float          # per weight, block scales included; FP32 per-row/tensor scales not
    layout: str                     # what one weight is: sign/exponent/mantissa bits, or codes and scales
    scale: str                      # the FP32 scales kept besides: "" none, "tensor" one, "row" one per row
    description: str
    quantize: Callable[[np.ndarray], tuple[np.ndarray, ...]]
    dequantize: Callable[..., np.ndarray]


FORMAT_TABLE: dict[str, Format] = {f.name: f for f in [
    Format("fp32", 32, "1/8/23", "", "IEEE single: the baseline", quantize_fp32, dequantize_fp32),
    Format("fp16", 16, "1/5/10", "", "IEEE half, nearest-even, overflow to inf", quantize_fp16, dequantize_fp16),
    Format("bf16", 16, "1/8/7", "", "bfloat16, nearest-even (what the checkpoints store)",
           quantize_bf16, dequantize_bf16),
    Format("fp8_e4m3", 8, "1/4/3", "tensor", "FP8 E4M3FN, one scale per tensor (amax -> 448), saturating",
           quantize_fp8_e4m3, dequantize_scaled),
    Format("fp8_e5m2", 8, "1/5/2", "tensor", "FP8 E5M2, one scale per tensor (amax -> 57344), saturating",
           quantize_fp8_e5m2, dequantize_scaled),
    Format("fp8_e4m3_rows", 8, "1/4/3", "row", "FP8 E4M3FN, one FP32 scale per output row (amax -> 448), saturating",
           quantize_fp8_e4m3_rows, dequantize_scaled),
    Format("fp8_e5m2_rows", 8, "1/5/2", "row", "FP8 E5M2, one FP32 scale per output row (amax -> 57344), saturating",
           quantize_fp8_e5m2_rows, dequantize_scaled),
    Format("int8", 8, "int8", "row", "symmetric INT8, one FP32 scale per output row (amax -> 127)",
           quantize_int8_rows, dequantize_int8_rows),
    Format("q8_0", 8.5, "32 x int8 + FP16", "", "llama.cpp Q8_0: blocks of 32 int8, FP16 scale amax/127",
           quantize_q8_0, dequantize_q8_0),
    Format("q4_0", 4.5, "32 x int4 + FP16", "", "llama.cpp Q4_0: blocks of 32 4-bit codes, FP16 scale max/-8",
           quantize_q4_0, dequantize_q4_0),
    Format("mxfp4", 4.25, "32 x E2M1 + E8M0", "", "OCP MXFP4: blocks of 32 E2M1, E8M0 power-of-two scale",
           quantize_mxfp4, dequantize_mxfp4),
]}


def get_format(fmt: str) -> Format:
    """The table entry for a format name, or a QwenNPError listing the known names."""
    try:
        return FORMAT_TABLE[fmt]
    except KeyError:
        raise QwenNPError(f"unknown number format {fmt!r}; expected one of {', '.join(FORMATS)}") from None


# ---- A model's weights held in a block format (--memory q8_0, q4_0) --------------------------------

# The formats a model can hold its matrices in (qwen_np.engine.memory's modes; HELD_FORMATS, named in
# core.defaults): blocks of a row, so a block of rows slices out of every part and widens on its own.


@dataclass(frozen=True)
class FormatRows:
    """A matrix [out, in] held as a format's quantized parts, row-major: llama.cpp's Q8_0 (int8 codes
    [out, in] and FP16 scales [out, in/32]) or Q4_0 (packed nibbles [out, in/2] and FP16 scales), the
    values of its blocks bit for bit. A numerics weight kind (Grouped): indexing picks rows of every part,
    widen() dequantizes them, groups() gives their codes and block scales. A block's FP16 scale is one
    per 32 inputs, so unlike int8's row scale it cannot be factored out of a whole dot product, only out
    of each block's 32 products (what the fast path does)."""

    fmt: str                          # a HELD_FORMATS name
    parts: tuple[np.ndarray, ...]     # what get_format(fmt).quantize returns, for these rows; or the codes
                                      # per block [out, in/32, 32 | 16] and scales as views of a GGUF's blocks
    columns: int                      # in

    group = BLOCK                     # inputs per scale (numerics.Grouped)

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.parts[1].shape[:-1], self.columns)    # the scales [out, in/32]: codes may be per block

    @property
    def dtype(self) -> np.dtype:
        return self.parts[0].dtype

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    def __getitem__(self, rows: Any) -> "FormatRows":
        return FormatRows(self.fmt, tuple(part[rows] for part in self.parts), self.columns)

    def widen(self, out: np.ndarray) -> None:
        get_format(self.fmt).dequantize(*self.parts, out=out)

    def groups(self) -> tuple[np.ndarray, np.ndarray, None]:
        return (q8_0_groups if self.fmt == "q8_0" else q4_0_groups)(*self.parts)

    code_order = None                 # coded() is groups() in value order

    def coded(self) -> tuple[np.ndarray, np.ndarray, None]:
        codes, a, _ = self.groups()
        return group_major(codes[None], BLOCK, f"{self.fmt}.coded"), a.T, None


def bits_per_weight(fmt: str) -> float:
    """Storage bits per weight of a format, block scales included (fp16 16, q8_0 8.5, q4_0 4.5)."""
    return get_format(fmt).bits_per_weight


def storage_bytes(shape: tuple[int, ...], fmt: str) -> int:
    """Bytes a tensor of `shape` occupies in `fmt`: its codes and block scales, plus its FP32 scales
    (one per tensor, or one per row: every axis but the last). Equals the nbytes of quantize's parts."""
    entry = get_format(fmt)
    values = math.prod(shape)
    scales = {"": 0, "tensor": 1, "row": values // shape[-1]}[entry.scale]
    return math.ceil(values * entry.bits_per_weight / 8) + 4 * scales


def round_trip(x: np.ndarray, fmt: str) -> np.ndarray:
    """FP32 values of x after storing it in `fmt`: dequantize(quantize(x)). x [..., in] -> FP32 [..., in]."""
    entry = get_format(fmt)
    return entry.dequantize(*entry.quantize(x))
