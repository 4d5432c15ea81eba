"""How weights are held between uses, and widened to FP32 when used: BF16/F16 bits, or int8 rows.

BF16 is the top half of an IEEE float32 (1 sign, 8 exponent, 7 mantissa bits), so widening it is
exact: put the 16 bits in the high half of a uint32 and reinterpret. NumPy has no bfloat16 dtype,
so BF16 tensors travel as uint16 "bit" arrays until they are upcast.

`--memory int8` holds each matrix as Int8Rows: int8 codes and one FP32 scale per row (made by
formats.quantize_int8_rows at load), so a weight is W ~ codes * scale[:, None].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# On-disk dtype name (safetensors) -> the NumPy dtype whose bytes we read. BF16 stays as raw bits.
STORAGE_DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype("<u2"),
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
}
BYTES_PER_VALUE = {"FP32": 4, "BF16": 2, "FP16": 2, "FP8": 1, "INT8": 1, "INT4": 0.5}


def bf16_bits_to_f32(bits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Exact BF16 -> FP32: shift the 16 stored bits into the high half of a 32-bit word."""
    if out is None:
        out = np.empty(bits.shape, dtype=np.float32)
    words = out.view(np.uint32)
    words[...] = bits      # widen first: np.left_shift(bits, 16, dtype=uint32) casts through a
    words <<= 16           # buffered loop and measured 1.3-4.5x slower on this machine
    return out


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """FP32 -> BF16 bits, rounding to nearest even as torch's .to(bfloat16) does (NaN stays NaN)."""
    word = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((word >> 16) & 1) + np.uint32(0x7FFF)        # ties go to the even neighbour
    bits = ((word + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    bits[nan] = ((word[nan] >> 16) | 0x0040).astype(np.uint16)  # keep NaN a NaN (quiet bit set)
    return bits


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


# A weight matrix as a model holds it: FP32, stored BF16 bits / F16, or int8 rows.
Weight = np.ndarray | Int8Rows


def upcast(stored: Weight, out: np.ndarray | None = None) -> np.ndarray:
    """FP32 copy of a stored tensor (BF16 bits, F16, F32 or Int8Rows), optionally written into `out`."""
    if isinstance(stored, Int8Rows):
        if out is None:
            out = np.empty(stored.shape, dtype=np.float32)
        out[...] = stored.codes                                    # exact: int8 fits in FP32
        out *= stored.scale[..., None]                             # as formats.dequantize_int8_rows
        return out
    if stored.dtype == np.uint16:
        return bf16_bits_to_f32(stored, out)
    if out is None:
        return stored.astype(np.float32)
    out[...] = stored
    return out
