"""Inf and NaN found where a GGUF's values come from, none widened: the first in a float tensor's bit
patterns (F32, F16, BF16: first_not_finite) and in each block kind's FP16 fields (its d, m and dmin:
first_bad_scale), so that a damaged file is refused at load rather than served as NaN."""

from __future__ import annotations

import numpy as np

# The FP16 fields of each kind's block (Q8_0 and Q4_0 too): name and byte offset, as ggml's block structs lay
# them out and its ggml_validate_row_data checks them. One inf or NaN there makes a whole group's values inf
# or NaN (inf * 0 is NaN too), which no later step can tell from a real activation's overflow.
FP16_FIELDS: dict[str, tuple[tuple[str, int], ...]] = {
    "Q8_0": (("d", 0),), "Q4_0": (("d", 0),), "Q4_1": (("d", 0), ("m", 2)), "Q5_0": (("d", 0),),
    "Q5_1": (("d", 0), ("m", 2)), "Q2_K": (("d", 80), ("dmin", 82)), "Q3_K": (("d", 108),),
    "Q4_K": (("d", 0), ("dmin", 2)), "Q5_K": (("d", 0), ("dmin", 2)), "Q6_K": (("d", 208),)}
# The exponent bits of each float width: all of them set is inf or NaN, whatever the sign and mantissa.
EXPONENTS: dict[str, tuple[np.dtype, int]] = {"F16": (np.dtype(np.uint16), 0x7C00), "BF16": (np.dtype(np.uint16), 0x7F80),
                                              "F32": (np.dtype(np.uint32), 0x7F800000)}
CHECK_VALUES = 1 << 20                        # values checked per step: the masked copy stays near L2


def first_not_finite(bits: np.ndarray, fmt: str) -> tuple[int, int, float] | None:
    """(row, column, value) of the first value of bits [rows, n] (a float format's bit patterns as unsigned
    integers, any strides: a field of every block is a strided view) that is inf or NaN, else None. Integer
    masks, not np.isfinite: FP16 has no vectorised isfinite in NumPy, BF16 no dtype at all."""
    dtype, exponent = EXPONENTS[fmt]
    mask = dtype.type(exponent)
    rows, columns = bits.shape
    step = max(1, CHECK_VALUES // max(columns, 1))
    for start in range(0, rows, step):
        masked = np.bitwise_and(bits[start:start + step], mask)
        if masked.size and masked.max() == mask:               # masked values are at most the mask itself
            row, column = np.unravel_index(int(np.argmax(masked == mask)), masked.shape)
            return start + int(row), int(column), _as_float(int(bits[start + row, column]), fmt)
    return None


def _as_float(word: int, fmt: str) -> float:
    """A value's bit pattern in `fmt` as a float (BF16 is FP32's top half)."""
    if fmt == "F16":
        return float(np.uint16(word).view(np.float16))
    return float(np.uint32(word << 16 if fmt == "BF16" else word).view(np.float32))


def first_bad_scale(kind: str, blocks: np.ndarray) -> tuple[str, int, int, float] | None:
    """(field name, row, block, value) of the first FP16 field (FP16_FIELDS) of blocks [rows, nb, bytes] of `kind` that
    is inf or NaN, else None: a strided view of each field, no copy of the blocks."""
    for name, at in FP16_FIELDS[kind]:
        found = first_not_finite(blocks[..., at:at + 2].view(np.uint16)[..., 0], "F16")
        if found is not None:
            return (name, *found)
    return None
