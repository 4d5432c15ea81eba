"""llama.cpp's other block quantizations, as a GGUF stores them: the legacy Q4_1, Q5_0, Q5_1 and the
K-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (a Q4_K_M file is Q4_K and Q6_K tensors; the _S/_M/_L mixes are
per-tensor choices of these). A matrix is held as its blocks (BlockRows: the file's bytes, a view of
the mapped file) and widened a block of rows at a time, bit for bit as gguf's reference dequantizer
(gguf.quants.dequantize, tests/numbers/test_formats.py). Q8_0 and Q4_0 are formats.FormatRows. Those two, Q4_K
and Q6_K may instead be held repacked at load (ggml_repacked.RepackedRows).

A row is blocks of QK values (32 for the legacy kinds, 256 for the K-quants), each a fixed number of
bytes. Whatever the packing, every kind means the same thing: groups of g consecutive values (g = 32 or
16) share a scale a and an offset b, and a value is

    w = a * q + b          q a small integer code, a and b per group (b only in the kinds with a minimum)

    kind   QK  bytes  g   code q (bits)                 a                    b
    Q4_1   32   20   32   4-bit, 0..15                  d                    m
    Q5_0   32   22   32   5-bit, minus 16               d                    -
    Q5_1   32   24   32   5-bit, 0..31                  d                    m
    Q2_K  256   84   16   2-bit, 0..3                   d * (s & 15)         -dmin * (s >> 4)
    Q3_K  256  110   16   3-bit, minus 4                d * (s6 - 32)        -
    Q4_K  256  144   32   4-bit, 0..15                  d * s6               -dmin * m6
    Q5_K  256  176   32   5-bit, 0..31                  d * s6               -dmin * m6
    Q6_K  256  210   16   6-bit, minus 32               d * s8 (int8)        -

d, m and dmin are FP16; s, s6, m6 are 4-, 6- or 8-bit integers packed into the block. groups() returns
exactly these parts (codes [rows, in], a and b [rows, in/g]); widen() computes a * q, then + b, as FP32
operations in the order gguf's dequantizer does (a * q is exact: an FP16 has 11 significant bits, the
scale and the code together at most 13; only the + b rounds). x - y and x + (-y) are the same IEEE
operation, so b holds the minimum negated. The fast path multiplies the codes instead of the widened
values (fast.py): sum_g a (sum q x) + sum_g b (sum x), two small products per group.

Unpacking: the codes of a block are bit fields in runs of 16 to 64 bytes (Q4_K: 4 runs of 32 bytes,
each run's low nibbles one group and its high nibbles the next). NumPy loops over axes that short
cost more per loop than the work (see formats._contiguous_blocks), so each field is first copied out
of the blocks as one void item per block (block_field), its bits taken by masks and shifts over the whole
contiguous field, and the runs put in value order as void items (_runs). No Python loop runs per block.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .numerics import group_major, scratch, widen_groups

# (codes [R, in] int8/uint8 in value order, a [G, R] FP32, b [G, R] FP32 or None) of R rows of blocks
# [R, in/QK, bytes], G = in/g groups. a and b are group-major (one row per group, the rows of W along
# it), the layout in which the fast path applies them with long loops (fast.grouped_rows).
Groups = tuple[np.ndarray, np.ndarray, np.ndarray | None]
F32, U8 = np.dtype(np.float32), np.dtype(np.uint8)


def block_field(blocks: np.ndarray, start: int, size: int, name: str) -> np.ndarray:
    """Bytes [start, start + size) of every block, [R, nb, size] C-contiguous: one void item per block."""
    item = np.dtype((np.void, size))
    field = scratch(f"ggml.{name}", (*blocks.shape[:-1], size), U8)
    field.view(item)[..., 0] = blocks[..., start:start + size].view(item)[..., 0]
    return field


def group_bytes(blocks: np.ndarray, start: int, size: int, name: str, dtype: np.dtype = U8) -> np.ndarray:
    """Bytes [start, start + size) of every block (or the FP16 there, size 1, as FP32), block-major and
    then row-major: [nb, size, R]. Per-group values are worked on in this layout (_scales_by_group)."""
    rows, count = blocks.shape[0], blocks.shape[1]
    source = blocks[..., start:start + (2 if dtype == F32 else size)]
    if dtype == F32:
        source = source.view(np.float16)                                   # [R, nb, 1]
    out = scratch(f"ggml.{name}", (count, size, rows), dtype)
    np.copyto(out, source.transpose(1, 2, 0))                              # exact (FP16 -> FP32 too)
    return out


def _runs(parts: list[np.ndarray], name: str) -> np.ndarray:
    """Runs of codes interleaved: parts [..., n, L] (C-contiguous, all one shape) -> [..., n, len(parts), L],
    part i's run j at [..., j, i, :], each run moved as one L-byte void item."""
    *lead, length = parts[0].shape
    item = np.dtype((np.void, length))
    out = scratch(f"ggml.{name}", (*lead, len(parts), length), U8)
    items = out.view(item)[..., 0]                                         # [..., n, len(parts)]
    for i, part in enumerate(parts):
        items[..., i] = part.view(item)[..., 0]
    return out


def every_byte(value: int) -> np.uint64:
    """`value` in each of the 8 bytes of a uint64 lane."""
    return np.uint64(0x0101010101010101 * value)


def bit_planes(packed: np.ndarray, bits: int, name: str, at: int = 0, count: int | None = None) -> np.ndarray:
    """Bytes [..., L] (C-contiguous, L a multiple of 8) -> planes [count, ..., L]: plane j holds field j of
    every byte (its bits j*bits .. +bits), moved to bit `at`; count defaults to every field (8 / bits).

    The masks and shifts run on 8 bytes at a time, as uint64 lanes: a mask after each shift drops what
    moved in from the neighbouring byte. Trap: NumPy's uint8 left shift is not vectorised (0.5 ns a
    byte here, 15x a mask)."""
    count = 8 // bits if count is None else count
    lanes, mask = packed.view(np.uint64), every_byte(((1 << bits) - 1) << at)
    out = scratch(f"ggml.{name}", (count, *packed.shape), U8)
    for j, part in enumerate(out.view(np.uint64)):
        shift = bits * j - at
        if shift > 0:
            np.right_shift(lanes, np.uint64(shift), out=part)
        elif shift < 0:
            np.left_shift(lanes, np.uint64(-shift), out=part)
        np.bitwise_and(part if shift else lanes, mask, out=part)
    return out


def _bit_planes(packed: np.ndarray, bits: int, name: str, at: int = 0) -> np.ndarray:
    """Bytes [..., n, L] -> codes [..., n, 8 / bits, L]: field j of every byte (bit_planes), moved to bit
    `at`, is run j."""
    return _runs(list(bit_planes(packed, bits, f"{name}.planes", at)), name)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """Bytes [..., n, L] -> codes [..., n, 2, L]: each run's low nibbles, then its high ones."""
    return _bit_planes(packed, 4, "codes")


def _or(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """low |= high, as uint64 lanes (uint8 arrays of one shape, 8k bytes)."""
    np.bitwise_or(low.view(np.uint64), high.view(np.uint64), out=low.view(np.uint64))
    return low


def _scaled(d: np.ndarray, scales: np.ndarray, name: str, negate: bool = False) -> np.ndarray:
    """d [nb, 1, R] (FP32) times integer scales [nb, groups, R] -> FP32 [nb * groups, R] (exact products),
    negated if asked (a minimum's offset b = -dmin m)."""
    out = scratch(f"ggml.{name}", scales.shape, F32)
    np.multiply(d, scales, out=out)
    if negate:
        np.negative(out, out=out)
    return out.reshape(-1, out.shape[-1])


def _values(codes: np.ndarray) -> np.ndarray:
    """Codes [R, nb, ...] in value order -> [R, in]."""
    return codes.reshape(codes.shape[0], -1)


# ---- the kinds: blocks [R, nb, bytes] -> (codes, a, b) ------------------------------------------------

def _q4_1(blocks: np.ndarray) -> Groups:
    codes = _nibbles(block_field(blocks, 4, 16, "qs")[..., None, :])                   # [R, nb, 1, 2, 16]
    return _values(codes), group_bytes(blocks, 0, 1, "d", F32)[:, 0], group_bytes(blocks, 2, 1, "m", F32)[:, 0]


def _five_bits(blocks: np.ndarray, high_at: int) -> np.ndarray:
    """Q5_0/Q5_1's codes 0..31 [R, in]: the nibbles after the 4 bytes of 5th bits (bit i: value i)."""
    low = _nibbles(block_field(blocks, high_at + 4, 16, "qs")[..., None, :])            # [R, nb, 1, 2, 16]
    high = scratch("ggml.qh", (*blocks.shape[:-1], 32), U8)
    high[...] = np.unpackbits(block_field(blocks, high_at, 4, "qh4"), axis=-1, bitorder="little")   # [R, nb, 32]
    high *= np.uint8(16)
    return _values(_or(low.reshape(high.shape), high))


def _q5_0(blocks: np.ndarray) -> Groups:
    codes = _five_bits(blocks, 2)
    codes -= np.uint8(16)                                      # wraps: as int8 the bytes read q - 16
    return codes.view(np.int8), group_bytes(blocks, 0, 1, "d", F32)[:, 0], None


def _q5_1(blocks: np.ndarray) -> Groups:
    return _five_bits(blocks, 4), group_bytes(blocks, 0, 1, "d", F32)[:, 0], group_bytes(blocks, 2, 1, "m", F32)[:, 0]


def _q2_k(blocks: np.ndarray) -> Groups:
    codes = _bit_planes(block_field(blocks, 16, 64, "qs").reshape(*blocks.shape[:-1], 2, 32), 2, "codes")   # [R, nb, 2, 4, 32]
    return (_values(codes), *_q2_k_scales(blocks))


def _q2_k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q2_K's a = d * (s & 15) and b = -dmin * (s >> 4) per group of 16, [G, R] each (s: 16 bytes)."""
    scales = group_bytes(blocks, 0, 16, "scales")                                   # [nb, 16, R]: low a, high b
    part = scratch("ggml.part", scales.shape, U8)
    a = _scaled(group_bytes(blocks, 80, 1, "d", F32), np.bitwise_and(scales, np.uint8(0x0F), out=part), "a")
    b = _scaled(group_bytes(blocks, 82, 1, "dmin", F32), np.right_shift(scales, np.uint8(4), out=part), "b", negate=True)
    return a, b


def _q3_k(blocks: np.ndarray) -> Groups:
    lead = blocks.shape[:-1]
    low = _bit_planes(block_field(blocks, 32, 64, "qs").reshape(*lead, 2, 32), 2, "codes").reshape(*lead, 256)
    high = _bit_planes(block_field(blocks, 0, 32, "hmask")[..., None, :], 1, "high", at=2).reshape(*lead, 256)
    codes = _or(low, high)
    codes -= np.uint8(4)                      # q = low - 4 (1 - high bit), as gguf: wraps, read as int8
    return _values(codes).view(np.int8), _q3_k_scales(blocks), None


def _q3_k_scales(blocks: np.ndarray) -> np.ndarray:
    """Q3_K's a = d * (s6 - 32) per group of 16, [G, R]: 16 6-bit scales, the low nibbles in bytes 0-7,
    their top two bits in bytes 8-11 (bits 2j, 2j+1 of each byte: scales 4j .. 4j+3)."""
    lead = blocks.shape[:-1]
    packed = group_bytes(blocks, 96, 12, "scales")                                  # [nb, 12, R]
    scales = scratch("ggml.part", (lead[1], 16, lead[0]), U8)                     # 16 6-bit scales
    np.bitwise_and(packed[:, :8], np.uint8(0x0F), out=scales[:, :8])
    np.right_shift(packed[:, :8], np.uint8(4), out=scales[:, 8:])
    high_bits = scratch("ggml.part2", (lead[1], 4, lead[0]), U8)
    for j in range(4):                        # bits 2j, 2j+1 of bytes 8..11 are the top bits of scales 4j..4j+3
        np.right_shift(packed[:, 8:], np.uint8(2 * j), out=high_bits)
        high_bits &= np.uint8(3)
        high_bits *= np.uint8(16)
        scales[:, 4 * j:4 * j + 4] |= high_bits
    signed = scales.view(np.int8)
    signed -= np.int8(32)                                                         # -32..31
    return _scaled(group_bytes(blocks, 108, 1, "d", F32), signed, "a")


def _q4_k(blocks: np.ndarray) -> Groups:
    codes = _nibbles(block_field(blocks, 16, 128, "qs").reshape(*blocks.shape[:-1], 4, 32))   # [R, nb, 4, 2, 32]
    return (_values(codes), *_k_scales(blocks))


def _q5_k(blocks: np.ndarray) -> Groups:
    lead = blocks.shape[:-1]
    low = _nibbles(block_field(blocks, 48, 128, "qs").reshape(*lead, 4, 32)).reshape(*lead, 256)
    high = _bit_planes(block_field(blocks, 16, 32, "qh")[..., None, :], 1, "high", at=4)   # bit j of byte k: value 32 j + k
    return (_values(_or(low, high.reshape(*lead, 256))), *_k_scales(blocks))


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's a = d * s6 and b = -dmin * m6 per group of 32, [G, R] each (k_scale_codes)."""
    scales, minimums = k_scale_codes(blocks)
    a = _scaled(group_bytes(blocks, 0, 1, "d", F32), scales, "a")
    return a, _scaled(group_bytes(blocks, 2, 1, "dmin", F32), minimums, "b", negate=True)


def k_scale_codes(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 6-bit s6 and m6 [nb, 8, R] (uint8) from the 12 scale bytes.

    Bytes 0-3 hold s6[0..3] in their low 6 bits, 4-7 m6[0..3]; bytes 8-11 hold s6[4..7] (low nibble)
    and m6[4..7] (high nibble), whose top two bits are the top bits of bytes 0-3 and 4-7."""
    packed = group_bytes(blocks, 4, 12, "scales")                                   # [nb, 12, R]
    low, mins, high = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales, minimums = (scratch(f"ggml.{name}", (packed.shape[0], 8, packed.shape[2]), U8) for name in ("s6", "m6"))
    top = scratch("ggml.part", low.shape, U8)
    np.bitwise_and(low, np.uint8(0x3F), out=scales[:, :4])
    np.bitwise_and(high, np.uint8(0x0F), out=scales[:, 4:])
    scales[:, 4:] |= np.bitwise_and(np.right_shift(low, np.uint8(2), out=top), np.uint8(0x30), out=top)
    np.bitwise_and(mins, np.uint8(0x3F), out=minimums[:, :4])
    np.right_shift(high, np.uint8(4), out=minimums[:, 4:])
    minimums[:, 4:] |= np.bitwise_and(np.right_shift(mins, np.uint8(2), out=top), np.uint8(0x30), out=top)
    return scales, minimums


def _q6_k(blocks: np.ndarray) -> Groups:
    lead = blocks.shape[:-1]
    low = _nibbles(block_field(blocks, 0, 128, "ql").reshape(*lead, 2, 64)).reshape(*lead, 256)   # half i: 64 low, 64 high
    high = _bit_planes(block_field(blocks, 128, 64, "qh").reshape(*lead, 2, 32), 2, "high", at=4).reshape(*lead, 256)
    codes = _or(low, high)
    codes -= np.uint8(32)                                      # wraps: as int8 the bytes read q - 32
    return _values(codes).view(np.int8), _q6_k_scales(blocks), None


def _q6_k_scales(blocks: np.ndarray) -> np.ndarray:
    """Q6_K's a = d * s8 per group of 16, [G, R] (s8: 16 int8 scales)."""
    scales = group_bytes(blocks, 192, 16, "scales").view(np.int8)                    # [nb, 16, R]
    return _scaled(group_bytes(blocks, 208, 1, "d", F32), scales, "a")


# ---- the K-kinds in code order: blocks [R, nb, bytes] -> (planes, a, b) --------------------------------
#
# The fast path needs the codes of a group side by side, not in value order: a product q . x is the
# same in any order of the inputs, so x is put in the codes' order once per token (code_order) instead
# of every code in x's order. Each kind's bit fields are then taken out as planes [P, R, nb, L], with
# masks and shifts over whole contiguous fields and no interleaving of runs (_runs: ~40% of a
# groups() call for Q6_K, Q5_K, Q3_K). Two layouts, within a block of 256 values:
#   "fields"  (Q2_K, Q3_K, Q6_K): plane j (4), position t = 32 i + l  holds value 128 i + 32 j + l
#   "nibbles" (Q4_K, Q5_K):       plane h (2), position t = 32 j + l  holds value 64 j + 32 h + l
# a and b are returned in value order ([nb * groups, R], as the decoders above); a code offset
# (Q3_K's -4, Q6_K's -32) is left to b = -offset * a (fast.grouped_rows' sums of x). coded() then moves
# the planes' groups group-major, [G, R, g] (numerics.group_major): the layout the product wants.

def _q2_k_planes(blocks: np.ndarray) -> Groups:
    return (bit_planes(block_field(blocks, 16, 64, "qs"), 2, "codes"), *_q2_k_scales(blocks))


def _q3_k_planes(blocks: np.ndarray) -> Groups:
    low = bit_planes(block_field(blocks, 32, 64, "qs"), 2, "codes")                          # [4, R, nb, 64]
    hmask = block_field(blocks, 0, 32, "hmask")                                            # bit 4i + j: value 128 i + 32 j + l
    shifted = scratch("ggml.hmask4", hmask.shape, U8)
    np.right_shift(hmask.view(np.uint64), np.uint64(4), out=shifted.view(np.uint64))
    by_half = _runs([hmask, shifted], "hmask2").reshape(*hmask.shape[:-1], 64)        # [R, nb, 64]: i, l
    return _or(low, bit_planes(by_half, 1, "high", at=2, count=4)), _q3_k_scales(blocks), None


def _q4_k_planes(blocks: np.ndarray) -> Groups:
    return (bit_planes(block_field(blocks, 16, 128, "qs"), 4, "codes"), *_k_scales(blocks))


def _q5_k_planes(blocks: np.ndarray) -> Groups:
    low = bit_planes(block_field(blocks, 48, 128, "qs"), 4, "codes")                         # [2, R, nb, 128]
    qh = block_field(blocks, 16, 32, "qh")                                                 # bit m: value 32 m + l
    shifted = [qh] + [scratch(f"ggml.qh.{j}", qh.shape, U8) for j in range(1, 4)]
    for j in range(1, 4):
        np.right_shift(qh.view(np.uint64), np.uint64(2 * j), out=shifted[j].view(np.uint64))
    by_run = _runs(shifted, "qh4").reshape(*qh.shape[:-1], 128)                      # [R, nb, 128]: j, l
    return (_or(low, bit_planes(by_run, 1, "high", at=4, count=2)), *_k_scales(blocks))


def q6_k_planes(blocks: np.ndarray) -> Groups:
    rows, count = blocks.shape[:2]
    runs = np.dtype((np.void, 32))
    ql = scratch("ggml.ql", (2, rows, count, 2, 32), U8)                             # [jj, R, nb, i, l]
    items = blocks[..., :128].view(runs).reshape(rows, count, 2, 2)                  # run 2 i + jj
    for jj, out in enumerate(ql.view(runs)[..., 0]):
        out[...] = items[..., jj]
    low = bit_planes(ql.reshape(2, rows, count, 64), 4, "codes").reshape(4, rows, count, 64)   # j = 2 h + jj
    high = bit_planes(block_field(blocks, 128, 64, "qh"), 2, "high", at=4)                  # [4, R, nb, 64]
    return _or(low, high), _q6_k_scales(blocks), None


@dataclass(frozen=True)
class BlockKind:
    """One ggml block type: QK values in `size` bytes, groups of `group` values sharing a and b."""

    name: str                                   # ggml's name (gguf.GGMLQuantizationType[name])
    values: int                                 # QK
    size: int                                   # bytes per block
    group: int                                  # values per scale
    decode: Callable[[np.ndarray], Groups]
    planes: Callable[[np.ndarray], Groups] | None = None     # the codes in code order (above), if defined
    layout: str = ""                            # the planes' layout: "fields" | "nibbles"
    offset: int = 0                             # planes hold q + offset (b = -offset * a)


BLOCK_KINDS: dict[str, BlockKind] = {kind.name: kind for kind in [
    BlockKind("Q4_1", 32, 20, 32, _q4_1),
    BlockKind("Q5_0", 32, 22, 32, _q5_0),
    BlockKind("Q5_1", 32, 24, 32, _q5_1),
    BlockKind("Q2_K", 256, 84, 16, _q2_k, _q2_k_planes, "fields"),
    BlockKind("Q3_K", 256, 110, 16, _q3_k, _q3_k_planes, "fields", offset=4),
    BlockKind("Q4_K", 256, 144, 32, _q4_k, _q4_k_planes, "nibbles"),
    BlockKind("Q5_K", 256, 176, 32, _q5_k, _q5_k_planes, "nibbles"),
    BlockKind("Q6_K", 256, 210, 16, _q6_k, q6_k_planes, "fields", offset=32),
]}


@functools.cache
def code_order(layout: str, blocks: int) -> np.ndarray:
    """The value index (0 .. in-1) of each code of a row held in `layout` (see the planes above), read
    plane by plane: [P * blocks * L] int64, planes [P, R, blocks, L] being read as [R, P * blocks * L]."""
    if layout == "fields":                                    # plane j, position 32 i + k: value 128 i + 32 j + k
        j, i, k = np.ix_(range(4), range(2), range(32))
        within = (128 * i + 32 * j + k).reshape(4, 64)
    else:                                                     # plane h, position 32 j + k: value 64 j + 32 h + k
        h, j, k = np.ix_(range(2), range(4), range(32))
        within = (64 * j + 32 * h + k).reshape(2, 128)
    order = np.arange(blocks)[None, :, None] * 256 + within[:, None, :]       # [P, blocks, L]
    order.flags.writeable = False
    return order.reshape(-1)


@functools.cache
def group_order(layout: str, blocks: int, group: int) -> np.ndarray:
    """The value-order group (0 .. in/g - 1) of each group of codes in `layout`'s order."""
    return code_order(layout, blocks)[::group] // group


@dataclass(frozen=True)
class BlockRows:
    """A matrix [out, in] held as a GGUF stores it: each row's blocks, [out, in/QK, bytes] uint8 (a view of
    the memory-mapped file, or rows gathered from one). A numerics weight kind: indexing picks rows,
    groups() gives the codes and per-group a, b of those rows, widen() their FP32 values."""

    kind: str                                   # a BLOCK_KINDS name
    blocks: np.ndarray                          # uint8 [out, in/QK, bytes]

    dtype = np.dtype(np.uint8)

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.blocks.shape[:-2], self.blocks.shape[-2] * BLOCK_KINDS[self.kind].values)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def group(self) -> int:
        return BLOCK_KINDS[self.kind].group

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes

    def __getitem__(self, rows: Any) -> "BlockRows":
        return BlockRows(self.kind, self.blocks[rows])

    def groups(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(codes [rows, in], a [rows, in/g], b [rows, in/g] or None): w = a q + b, group by group. Views
        of this thread's scratch memory (numerics.scratch), valid until its next groups() call; a and b
        are transposed views of group-major arrays ([in/g, rows] contiguous)."""
        codes, a, b = BLOCK_KINDS[self.kind].decode(self.blocks.reshape(-1, *self.blocks.shape[-2:]))
        return codes, a.T, None if b is None else b.T

    def widen(self, out: np.ndarray) -> None:
        """The rows' FP32 values into out (their shape), bit for bit as gguf.quants.dequantize."""
        widen_groups(*self.groups(), out=out.reshape(-1, out.shape[-1]))

    @property
    def code_order(self) -> np.ndarray | None:
        """The value index of each input in coded()'s order; None: value order."""
        kind = BLOCK_KINDS[self.kind]
        return None if kind.planes is None else code_order(kind.layout, self.blocks.shape[-2])

    def coded(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(codes [G, rows, g] uint8/int8, a [G, rows] FP32, b [G, rows] or None): the codes of each row in
        code_order's order, as groups of g in that order (group-major), w = a q + b as in groups(), for the
        fast path (numerics.Grouped). Views of this thread's scratch memory, valid until its next call."""
        kind, blocks = BLOCK_KINDS[self.kind], self.blocks.reshape(-1, *self.blocks.shape[-2:])
        if kind.planes is None:
            codes, a, b = kind.decode(blocks)
            return group_major(codes[None], kind.group, "ggml.coded.codes"), a, b
        planes, a, b = kind.planes(blocks)                                  # [P, R, nb, L]; a, b in value order
        order = group_order(kind.layout, blocks.shape[1], kind.group)
        a = np.take(a, order, axis=0, out=scratch("ggml.coded.a", a.shape, F32))
        if b is not None:
            b = np.take(b, order, axis=0, out=scratch("ggml.coded.b", b.shape, F32))
        elif kind.offset:
            b = np.multiply(a, np.float32(-kind.offset), out=scratch("ggml.coded.b", a.shape, F32))
        return group_major(planes.reshape(*planes.shape[:2], -1), kind.group, "ggml.coded.codes"), a, b
