"""Exercise 13 (section 7): rounding FP32 to BF16.

BF16 is FP32's top 16 bits: the sign, the same 8 exponent bits, 7 of the 23 mantissa bits. Write
`to_bf16(x)`: each FP32 value rounded to the nearest BF16 value, a tie to the one whose last kept bit is 0
(round half to even), returned as FP32. Near 1,000 the step is 4: 1001 -> 1000, 1002 -> 1000 (a tie, to
even), 1003 -> 1004. (Work on the bits: x.view(np.uint32).) Graded against
qwen_np.numbers.formats.round_trip(x, "bf16") on ties, negatives, tiny and huge values.
"""

from __future__ import annotations

import numpy as np


def to_bf16(x: np.ndarray) -> np.ndarray:
    """FP32 [...] -> FP32 [...], each value the nearest BF16 (ties to even). Finite inputs."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    kept_lowest = (bits >> 16) & 1                                    # the last kept bit: a tie goes to 0
    rounded = (bits + 0x7FFF + kept_lowest) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)
