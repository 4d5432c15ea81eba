"""llama.cpp's blocks repacked at load (RepackedRows): a block's parts taken apart once, for Q8_0, Q4_0,
Q4_K and Q6_K (REPACKINGS).

Taking a block's parts apart on every product (its bit fields, FP16 scales, packed 6-bit scales) cost
about as much as the product itself for the kinds GGUFs mostly hold. One token, [3072, 1024] x 12
weights, two threads, an AVX2-only EPYC, ns a weight, as blocks / repacked: Q4_K 1.28 / 0.82, and Q6_K
1.9x / 1.0x BF16's time (bench/README.md, "Repacked at load"). So a GGUF kept as stored has these kinds'
tensors repacked when it is loaded (gguf_file decides which, within a memory budget): the codes as
contiguous bytes in code order, each group's integer scale (and minimum) a byte in the same order, each
block's d (and dmin) as FP32; every part exact, so the values are the blocks' bit for bit
(as ggml_blocks.BlockRows widens them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .ggml_blocks import (F32, U8, group_bytes, every_byte, block_field, group_order, k_scale_codes, bit_planes,
                          q6_k_planes, code_order)
from .numerics import scratch, widen_groups

# A step of rows' parts, taken out of their blocks: (runs of codes [n, G', L] in code order, the runs'
# bytes; each group's integer scale [G, n] in value order or None; its minimum likewise; -dmin [nb, n] FP32
# or None). RepackedRows.from_blocks puts them in place.
Parts = tuple[np.ndarray, np.ndarray | None, np.ndarray | None, np.ndarray | None]


def _q8_0_parts(part: np.ndarray) -> Parts:
    return block_field(part, 2, 32, "repack.qs").view(np.int8), None, None, None                  # [n, nb, 32]


def _q4_0_parts(part: np.ndarray) -> Parts:
    return _pair_blocks(block_field(part, 2, 16, "repack.qs")), None, None, None                  # [n, nb / 2, 32]


def _q4_k_parts(part: np.ndarray) -> Parts:
    runs = block_field(part, 16, 128, "repack.qs").reshape(len(part), -1, 32)                      # [n, nb * 4, 32]
    s6, m6 = k_scale_codes(part)                                                               # [nb, 8, n]
    dmin = np.negative(group_bytes(part, 2, 1, "repack.dmin", F32)[:, 0])
    return runs, s6.reshape(-1, len(part)), m6.reshape(-1, len(part)), dmin


def _q6_k_parts(part: np.ndarray) -> Parts:
    planes = q6_k_planes(part)[0]                                                              # [4, n, nb, 64]: q + 32
    runs = scratch("repack.q", (len(part), 4, planes[0, 0].size), np.int8)
    np.subtract(planes.reshape(4, len(part), -1).transpose(1, 0, 2), 32, out=runs, casting="unsafe")
    scales = group_bytes(part, 192, 16, "repack.scales").view(np.int8)                            # [nb, 16, n]
    return runs.reshape(len(part), -1, 16), scales.reshape(-1, len(part)), None, None         # [n, G, 16]


@dataclass(frozen=True)
class Repacking:
    """How a kind's parts are held once repacked: QK values a block (`values`), g a group, `bits` a code
    (8: a byte a code; 4: two, the "nibbles" layout: a byte's low nibble in plane 0, its high one in plane
    1), the codes' order (`layout`, "" for value order), the offset the codes keep (held as q + offset,
    unpacked as q), the byte offset of each block's FP16 d, and the function taking a step of rows' other
    parts out of their blocks."""

    values: int
    group: int
    bits: int
    layout: str
    d_at: int
    parts: Callable[[np.ndarray], Parts]
    offset: int = 0
    scales: bool = False                        # a = d s per group (else a = d: one group a block)
    minimums: bool = False                      # b = -dmin m per group

    def held_bytes(self, values: int) -> int:
        """Bytes a [out, in] matrix of `values` takes repacked: codes, integer scales and minimums, FP32 d, dmin."""
        groups, blocks = values // self.group, values // self.values
        return (values * self.bits // 8 + groups * (self.scales + self.minimums)
                + 4 * blocks * (1 + self.minimums))


# Q4_0 pairs its blocks (block 2p's codes the low nibbles of 32 bytes, block 2p + 1's the high ones):
# Q4_K's "nibbles" layout, so a row needs a multiple of 256 values (repackable). Q6_K's codes are unpacked
# to a byte each (its 6-bit fields in groups of 16 are the dearest to take apart: 1.30x its blocks' bytes).
REPACKINGS = {"Q8_0": Repacking(32, 32, 8, "", 0, _q8_0_parts),
              "Q4_0": Repacking(32, 32, 4, "nibbles", 0, _q4_0_parts, offset=8),
              "Q4_K": Repacking(256, 32, 4, "nibbles", 0, _q4_k_parts, scales=True, minimums=True),
              "Q6_K": Repacking(256, 16, 8, "fields", 208, _q6_k_parts, scales=True)}
REPACK_VALUES = 1024 ** 2                     # values repacked per step: the scratch stays near L2


def repackable(kind: str, columns: int) -> bool:
    """Whether a [out, columns] matrix of ggml kind `kind` can be held as RepackedRows."""
    return kind in REPACKINGS and (REPACKINGS[kind].layout == "" or columns % 256 == 0)


@dataclass(frozen=True)
class RepackedRows:
    """A matrix [out, in] of a REPACKINGS kind with its blocks' parts taken apart. Its codes group-major, in
    code_order's order: int8 q itself [G, out, g] for Q8_0 and Q6_K; for Q4_0 and Q4_K two groups' nibbles
    (0..15) in each of [G/2, out, 32] (the low nibbles group h = 0 of that run, the high ones h = 1:
    code-order group h G/2 + run). For a kind with scales their integers s [G, out] in that order, and each
    block's d FP32 [in/QK, out], so that a = d s per group (exact in FP32: 11 + 8 bits); without scales d
    is a itself [G, out] in code order; with minimums m [G, out] and -dmin [in/QK, out], b = -dmin m. The
    values BlockRows gives, bit for bit (tests/numbers/test_formats.py). A numerics.Grouped weight kind."""

    kind: str
    codes: np.ndarray
    d: np.ndarray
    scales: np.ndarray | None = None
    dmin: np.ndarray | None = None              # negated
    mins: np.ndarray | None = None

    @staticmethod
    def from_blocks(kind: str, blocks: np.ndarray) -> "RepackedRows":
        """A GGUF's blocks [out, in/QK, bytes] of `kind` repacked (repackable), REPACK_VALUES at a time."""
        packing = REPACKINGS[kind]
        rows, count = blocks.shape[:2]
        columns = count * packing.values
        order = (np.arange(columns // packing.group) if not packing.layout
                 else group_order(packing.layout, columns // 256, packing.group))
        run = 32 if packing.bits == 4 else packing.group                     # bytes a run of codes
        codes = np.empty((columns * packing.bits // 8 // run, rows, run), np.int8 if packing.bits == 8 else U8)
        per_group = packing.values == packing.group
        d = np.empty((len(order) if per_group else count, rows), F32)
        held: dict[str, np.ndarray] = {}                                     # scales, mins, dmin: as the kind has them
        step = max(1, REPACK_VALUES // columns)
        item = np.dtype((np.void, run))
        for start in range(0, rows, step):
            part, at = blocks[start:start + step], slice(start, start + step)
            d_part = group_bytes(part, packing.d_at, 1, "repack.d", F32)[:, 0]                    # [nb, n]
            d[:, at] = d_part[order] if per_group else d_part
            runs, part_scales, part_mins, part_dmin = packing.parts(part)
            codes[:, at].view(item)[..., 0] = runs.view(item)[..., 0].T                       # group-major
            for name, integers in (("scales", part_scales), ("mins", part_mins)):         # into code order
                if integers is not None:
                    if name not in held:
                        held[name] = np.empty((len(order), rows), integers.dtype)
                    np.take(integers, order, axis=0, out=held[name][:, at])
            if part_dmin is not None:
                if "dmin" not in held:
                    held["dmin"] = np.empty((count, rows), F32)
                held["dmin"][:, at] = part_dmin
        return RepackedRows(kind, codes, d, held.get("scales"), held.get("dmin"), held.get("mins"))

    @property
    def dtype(self) -> np.dtype:
        return self.codes.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        runs, rows, run = self.codes.shape
        return (rows, runs * run * 8 // REPACKINGS[self.kind].bits)

    @property
    def ndim(self) -> int:
        return 2

    @property
    def group(self) -> int:
        return REPACKINGS[self.kind].group

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in (self.codes, self.d, self.scales, self.dmin, self.mins) if part is not None)

    def __getitem__(self, rows: Any) -> "RepackedRows":
        def picked(part: np.ndarray | None) -> np.ndarray | None:
            return None if part is None else part[:, rows]
        return RepackedRows(self.kind, self.codes[:, rows], self.d[:, rows], picked(self.scales), picked(self.dmin),
                            picked(self.mins))

    @property
    def code_order(self) -> np.ndarray | None:
        """The value index of each input in coded()'s order; None: value order (Q8_0)."""
        layout = REPACKINGS[self.kind].layout
        return code_order(layout, self.shape[1] // 256) if layout else None

    def _per_group(self, per_block: np.ndarray, integers: np.ndarray, name: str) -> np.ndarray:
        """per_block [in/QK, rows] (FP32) times each group's integer [G, rows] (code order) -> FP32 [G, rows],
        into this thread's scratch."""
        packing = REPACKINGS[self.kind]
        block_of_group = group_order(packing.layout, self.shape[1] // 256, packing.group) // (packing.values // packing.group)
        out = np.take(per_block, block_of_group, axis=0, out=scratch(name, integers.shape, F32))
        out *= integers
        return out

    def coded(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(codes [G, rows, g], a [G, rows] FP32, b [G, rows] or None), as BlockRows.coded(), but the codes are
        q itself (int8; Q4_0's offset taken off as they are unpacked: no b to apply), as gguf's dequantizer has
        them (so widen() rounds as it does). The codes a view of this matrix's (8 bits) or of this thread's
        scratch (4 bits), a and b of d or of the scratch: valid until the thread's next call."""
        packing, codes = REPACKINGS[self.kind], self.codes
        if packing.bits == 4:
            codes = bit_planes(codes, 4, "repacked.codes").reshape(-1, codes.shape[1], 32)     # [2 * runs, rows, 32]
            if packing.offset:              # Q4_0: the planes are this thread's scratch
                codes = _less(codes, packing.offset)
        a = self.d if self.scales is None else self._per_group(self.d, self.scales, "repacked.a")
        if self.mins is None:
            return codes, a, None
        assert self.dmin is not None
        return codes, a, self._per_group(self.dmin, self.mins, "repacked.b")

    def groups(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(codes [rows, in], a [rows, in/g], b [rows, in/g] or None) in value order, as BlockRows.groups():
        each code-order group moved to its place in value order as one void item."""
        order = self.code_order
        codes, a, b = self.coded()
        G, rows, g = codes.shape
        by_value = np.arange(G) if order is None else np.argsort(order[::g] // g)    # code-order group of each value group
        item = np.dtype((np.void, g))
        values = scratch("repacked.values", (rows, G, g), codes.dtype)
        values.view(item)[..., 0] = np.take(codes.view(item)[..., 0], by_value, axis=0).T
        value_a = np.take(a, by_value, axis=0, out=scratch("repacked.value_a", a.shape, F32))
        value_b = None if b is None else np.take(b, by_value, axis=0, out=scratch("repacked.value_b", b.shape, F32))
        return values.reshape(rows, -1), value_a.T, None if value_b is None else value_b.T

    def widen(self, out: np.ndarray) -> None:
        """The rows' FP32 values into out (their shape), bit for bit as gguf.quants.dequantize."""
        widen_groups(*self.groups(), out=out.reshape(-1, out.shape[-1]))


def _less(codes: np.ndarray, offset: int) -> np.ndarray:
    """codes - offset as int8, in place, for byte codes 0 <= q < 128 + offset: each byte of a uint64 lane plus
    128 - offset (no carry leaves a byte), then its top bit flipped (minus 128, modulo 256)."""
    lanes = codes.view(np.uint64)
    lanes += every_byte(128 - offset)
    lanes ^= every_byte(0x80)
    return codes.view(np.int8)


def _pair_blocks(codes: np.ndarray) -> np.ndarray:
    """Q4_0's nibbles [n, nb, 16] (value k: byte k's low nibble, value 16 + k: its high one) -> runs [n, nb/2, 32]
    of the "nibbles" layout: for each pair of blocks, byte k holds block 2p's value k low and 2p + 1's high
    (this thread's scratch)."""
    n, count = codes.shape[:2]
    lanes = codes.reshape(n, count // 2, 2, 16).view(np.uint64)                     # [n, pairs, 2 blocks, 2 lanes]
    out = scratch("ggml.paired", (n, count // 2, 32), U8)
    paired = out.reshape(n, count // 2, 2, 16).view(np.uint64)                     # [n, pairs, half, 2 lanes]
    low_mask = every_byte(0x0F)
    first, second = lanes[:, :, 0], lanes[:, :, 1]
    # byte k of half 0 (values 0..15): block 2p's low nibble | block 2p+1's low nibble << 4
    np.bitwise_or(first & low_mask, (second & low_mask) << np.uint64(4), out=paired[:, :, 0])
    # byte k of half 1 (values 16..31): their high nibbles
    np.bitwise_or((first >> np.uint64(4)) & low_mask, second & ~low_mask, out=paired[:, :, 1])
    return out
