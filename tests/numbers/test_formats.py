"""Number formats: bit-exact against NumPy's float16, ml_dtypes' casts and llama.cpp's own NumPy quantizers."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from qwen_np import QwenNPError
from tests.conftest import FP16_FIELDS, block_bytes, random_blocks
from qwen_np.numbers.numerics import upcast
from qwen_np.numbers.names import FORMATS
from qwen_np.numbers.formats import (bits_per_weight, storage_bytes, dequantize_int8_rows, dequantize_q4_0, dequantize_q8_0,
                                     get_format, quantize_fp8_e4m3, quantize_int8_rows, quantize_mxfp4, quantize_q4_0,
                                     quantize_q8_0, round_trip)

SCALED = [f for f in FORMATS if f not in ("fp32", "fp16", "bf16")]
BLOCKED = ["q8_0", "q4_0", "mxfp4"]


@pytest.fixture
def gguf():
    """llama.cpp's Python package (the `test` extra): quants and the type enum."""
    return pytest.importorskip("gguf")


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal as FP32 bit patterns, except that any NaN equals any NaN."""
    nan = np.isnan(a)
    return bool(np.array_equal(nan, np.isnan(b)) and np.array_equal(a.view(np.uint32)[~nan], b.view(np.uint32)[~nan]))


def random_weights(rows: int = 64, cols: int = 256, seed: int = 0) -> np.ndarray:
    """Normal weights whose rows span six orders of magnitude (so scales differ row to row)."""
    rng = np.random.default_rng(seed)
    row_scale = 10.0 ** rng.uniform(-4, 2, size=(rows, 1))
    return (rng.standard_normal((rows, cols)) * row_scale).astype(np.float32)


def midpoints(values: np.ndarray) -> np.ndarray:
    """The exact midpoints between consecutive values (float64; exact in FP32 for FP16/FP8 grids)."""
    values = np.unique(values.astype(np.float64))
    return (values[:-1] + values[1:]) / 2


# ---- fp16, bf16 -------------------------------------------------------------------------------------

def test_fp16_matches_numpy_float16_on_ties_subnormals_and_overflow():
    every_half = np.arange(0, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)   # +0 .. 65504
    ties = midpoints(every_half).astype(np.float32)                  # includes subnormal ties
    assert np.array_equal(ties.astype(np.float64), midpoints(every_half))   # the ties really are exact
    special = np.array([65504, 65519.996, 65520, 1e6, np.inf, np.nan, -0.0, 2.0 ** -25, 2.0 ** -26, 1e-30],
                       dtype=np.float32)
    x = np.concatenate([ties, -ties, special, -special, random_weights().ravel()])
    got = round_trip(x, "fp16")
    with np.errstate(over="ignore"):
        assert same_bits(got, x.astype(np.float16).astype(np.float32))
    halves = got[: ties.size].astype(np.float16).view(np.uint16)
    assert not np.any(halves & 1)                                     # every tie went to the even neighbour
    assert got[ties.size * 2 + 1] == 65504 and np.isposinf(got[ties.size * 2 + 2])   # overflow -> inf
    assert np.isnan(got[ties.size * 2 + 5])                           # NaN propagates


def test_bf16_rounds_to_nearest_even_like_ml_dtypes_on_every_kind_of_float():
    rng = np.random.default_rng(1)
    words = rng.integers(0, 2 ** 32, size=200_000, dtype=np.uint64).astype(np.uint32)
    ties = (words & np.uint32(0xFFFF0000)) | np.uint32(0x8000)     # exactly halfway between two BF16s
    x = np.concatenate([words, ties]).view(np.float32)               # NaNs, infs, subnormals, huge values
    x = np.concatenate([x, np.array([3.3961e38, 3.4e38, np.inf, -np.inf, -0.0], dtype=np.float32)])
    with np.errstate(invalid="ignore"):                              # ml_dtypes warns on NaN
        assert same_bits(round_trip(x, "bf16"), x.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_bf16_round_trip_keeps_bf16_values_exactly():
    words = np.arange(0, 2 ** 16, dtype=np.uint32) << 16             # every BF16 value, as FP32
    x = words.view(np.float32)
    assert same_bits(round_trip(x, "bf16"), x)


# ---- fp8 ----------------------------------------------------------------------------------------------

FP8 = {"fp8_e4m3": (ml_dtypes.float8_e4m3fn, 448.0, False), "fp8_e5m2": (ml_dtypes.float8_e5m2, 57344.0, False),
       "fp8_e4m3_rows": (ml_dtypes.float8_e4m3fn, 448.0, True), "fp8_e5m2_rows": (ml_dtypes.float8_e5m2, 57344.0, True)}


def fp8_inputs(dtype: type, largest: float) -> np.ndarray:
    """Rows of exact FP8 ties (each row's amax is the format's max, so the scale is 1) plus random rows."""
    grid = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float64)
    grid = grid[np.isfinite(grid) & (grid >= 0)]
    ties = midpoints(grid).astype(np.float32)                        # includes FP8 subnormal ties
    tie_rows = np.resize(ties, (len(ties) // 31 + 1, 31))
    tie_rows = np.concatenate([tie_rows, np.full((len(tie_rows), 1), largest, np.float32)], axis=1)
    random = random_weights(cols=32)
    random[0, :4] = [1e-30, -1e-38, 0.0, 1e30]                      # huge dynamic range: tiny ones flush to 0
    return np.concatenate([tie_rows, -tie_rows, random, np.zeros((1, 32), np.float32)])


@pytest.mark.parametrize("fmt", list(FP8))
def test_fp8_matches_ml_dtypes_cast_after_scaling_and_clipping(fmt):
    dtype, largest, per_row = FP8[fmt]
    x = fp8_inputs(dtype, largest)
    amax = np.max(np.abs(x), axis=-1, keepdims=True) if per_row else np.max(np.abs(x))
    scale = np.where(amax > 0, amax / np.float32(largest), np.float32(1)).astype(np.float32)
    expected = np.clip(x / scale, -largest, largest).astype(dtype).astype(np.float32) * scale
    got = round_trip(x, fmt)
    assert same_bits(got, expected)
    assert np.isfinite(got).all()                                    # saturating: never NaN or inf


def test_fp8_e4m3_saturates_where_a_bare_ml_dtypes_cast_gives_nan():
    scaled = np.array([448.0, 464.0, 465.0, 1e6], dtype=np.float32)
    assert np.isnan(scaled.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)[2:]).all()   # the trap
    codes, scale = quantize_fp8_e4m3(np.concatenate([scaled, -scaled]), scale=1.0)    # a given scale
    assert codes.astype(np.float32).tolist() == [448.0] * 4 + [-448.0] * 4 and scale == 1.0
    with pytest.raises(QwenNPError, match="fp8_e4m3: scales must be positive and finite"):
        quantize_fp8_e4m3(scaled, scale=0.0)


@pytest.mark.parametrize("fmt", list(FP8))
def test_fp8_largest_value_of_each_group_survives_within_half_a_step(fmt):
    dtype, _, per_row = FP8[fmt]
    x = random_weights(cols=96, seed=3)
    got = round_trip(x, fmt)
    axis = -1 if per_row else None
    half_step = 2.0 ** -4 if dtype is ml_dtypes.float8_e4m3fn else 2.0 ** -3    # relative, at the top binade
    assert np.allclose(np.max(np.abs(got), axis=axis), np.max(np.abs(x), axis=axis), rtol=half_step, atol=0)


# ---- int8 per row -------------------------------------------------------------------------------------

def test_int8_rows_error_is_at_most_half_a_step_of_each_rows_scale():
    w = random_weights(seed=4)
    w[5] = 0.0
    q, scale = quantize_int8_rows(w)
    assert q.dtype == np.int8 and scale.shape == (w.shape[0],) and scale.dtype == np.float32
    assert np.abs(q).max() == 127 and q.min() >= -127
    assert np.array_equal(np.abs(q[np.arange(len(w)) != 5]).max(axis=1), np.full(len(w) - 1, 127))
    error = np.abs(round_trip(w, "int8") - w)
    assert np.all(error <= scale[:, None] * (0.5 + 1e-5))
    assert not round_trip(w, "int8")[5].any()


# ---- llama.cpp Q8_0 / Q4_0 against gguf ---------------------------------------------------------------

def q8_0_gguf_bytes(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Our (q [out, in], d [out, in/32]) in ggml's block layout: per block 2 bytes of d, 32 of q."""
    blocks = q.view(np.uint8).reshape(*d.shape, 32)
    return np.concatenate([d.view(np.uint8).reshape(*d.shape, 2), blocks], axis=-1).reshape(*d.shape[:-1], -1)


def q4_0_gguf_bytes(nibbles: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Our (nibbles [out, in/2], d [out, in/32]) in ggml's block layout: 2 bytes of d, 16 of nibbles."""
    packed = nibbles.reshape(*d.shape, 16)
    return np.concatenate([d.view(np.uint8).reshape(*d.shape, 2), packed], axis=-1).reshape(*d.shape[:-1], -1)


def adversarial_blocks() -> np.ndarray:
    """Rows of one block each that stress rounding: exact ties, the roundf trap, FP16-subnormal scales."""
    k = np.arange(-15, 16, dtype=np.float32)
    rows = [
        np.append(k + 0.5, 127),                                   # d = 1: every value an exact .5 tie (q8_0)
        np.append(-(k + 0.5) / 16, -8),                            # d = 1 for q4_0 (m = -8): ties of w/d + 8.5
        np.append(np.full(31, 0.5 - 2 ** -25, np.float32), 127),   # trunc(v + 0.5) would round these up
        np.append(k, 0.0) * 1e-6,                                   # FP16 scale is subnormal
        np.zeros(32), np.full(32, -0.0),
        np.append([3.0, -3.0], np.linspace(-1, 1, 30)),            # two largest |values|: first one is m
        np.append([-3.0, 3.0], np.linspace(-1, 1, 30)),
        np.append(np.full(31, 1.0), 8_000_000.0),                   # just below q8_0's FP16 overflow
        np.append(np.full(31, -1.0), 524_000.0),                    # just below q4_0's
    ]
    return np.array(rows, dtype=np.float32)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_llama_cpp_blocks_match_gguf_bit_exactly(gguf, fmt):
    quantize, to_bytes, qtype = {"q8_0": (quantize_q8_0, q8_0_gguf_bytes, gguf.GGMLQuantizationType.Q8_0),
                                 "q4_0": (quantize_q4_0, q4_0_gguf_bytes, gguf.GGMLQuantizationType.Q4_0)}[fmt]
    for x in [random_weights(seed=5), adversarial_blocks(), np.float32(1e-3) * random_weights(8, 1024, seed=6)]:
        if fmt == "q4_0":
            x = x[np.abs(x).max(axis=1) < 524_160]                 # rows q4_0 refuses (scale overflows FP16)
        reference = gguf.quants.quantize(x, qtype)
        assert np.array_equal(to_bytes(*quantize(x)), reference)
        assert same_bits(round_trip(x, fmt), gguf.quants.dequantize(reference, qtype))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_dequantizing_views_of_a_files_blocks_matches_gguf_bit_exactly(gguf, fmt):
    """Codes and scales as strided views of ggml's block bytes (how a GGUF's tensors are held), every
    code and every finite FP16 scale, row slices too: the same bits as gguf's dequantizer."""
    qtype = gguf.GGMLQuantizationType.Q8_0 if fmt == "q8_0" else gguf.GGMLQuantizationType.Q4_0
    rows, blocks, size = 8, 64, {"q8_0": 34, "q4_0": 18}[fmt]
    raw = np.random.default_rng(3).integers(0, 256, size=(rows, blocks, size), dtype=np.uint8)
    scales = raw[..., :2].view(np.float16)[..., 0]                    # [rows, in/32], a strided view
    scales[~np.isfinite(scales)] = 1.0                                # a file's scales are finite
    codes = raw[..., 2:].view(np.int8) if fmt == "q8_0" else raw[..., 2:]
    reference = gguf.quants.dequantize(raw.reshape(rows, -1), qtype)  # [rows, in]
    dequantize = get_format(fmt).dequantize
    assert not codes.flags.c_contiguous
    assert same_bits(dequantize(codes, scales), reference)
    assert same_bits(dequantize(codes[2:5], scales[2:5], out=np.empty((3, 32 * blocks), np.float32)), reference[2:5])


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_all_subnormal_block_dequantizes_to_zero_where_gguf_overflows_its_reciprocal(gguf, fmt):
    x = np.full((1, 32), 1e-40, dtype=np.float32) * np.linspace(-1, 1, 32, dtype=np.float32)
    qtype = gguf.GGMLQuantizationType.Q8_0 if fmt == "q8_0" else gguf.GGMLQuantizationType.Q4_0
    with np.errstate(all="ignore"):                                # gguf: 1/d = inf, then inf -> int8
        reference = gguf.quants.dequantize(gguf.quants.quantize(x, qtype), qtype)
    assert not round_trip(x, fmt).any() and not reference.any()


@pytest.mark.parametrize("fmt, value", [("q8_0", 9e6), ("q4_0", 6e5)])
def test_block_scale_that_overflows_fp16_is_refused(fmt, value):
    x = np.ones((2, 64), dtype=np.float32)
    x[1, 40] = value
    with pytest.raises(QwenNPError, match=f"{fmt}: a block scale of .* overflows FP16"):
        round_trip(x, fmt)


def test_q4_0_stores_half_a_byte_per_weight_low_nibbles_first():
    x = np.tile(np.arange(-8, 8, dtype=np.float32), 2)[None]     # m = -8 -> d = 1, code = value + 8
    nibbles, d = quantize_q4_0(x)
    assert nibbles.shape == (1, 16) and d.tolist() == [[1.0]]
    assert nibbles[0, 0] == 0 | (0 << 4) and nibbles[0, 15] == 15 | (15 << 4)
    assert np.array_equal(dequantize_q4_0(nibbles, d), x)


# ---- MXFP4 against gguf ---------------------------------------------------------------------------------

def test_mxfp4_matches_gguf_except_that_element_ties_round_to_even(gguf):
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4, dtype=np.float32)   # 3 of 8 differ: .75 1.75 3.5
    x = np.concatenate([random_weights(seed=7).reshape(-1, 32), ties[None] * 2.0 ** -10, -ties[None]])
    _, e = quantize_mxfp4(x)
    reference = gguf.quants.quantize(x, gguf.GGMLQuantizationType.MXFP4).reshape(-1, 17)
    assert np.array_equal(e[:, 0], reference[:, 0])                # the E8M0 scales agree
    ours = round_trip(x, "mxfp4")
    theirs = gguf.quants.dequantize(reference, gguf.GGMLQuantizationType.MXFP4)
    differ = ours != theirs
    scaled = np.ldexp(x.astype(np.float64), 127 - e.astype(np.int64))    # x / X, exactly
    assert np.array_equal(np.abs(ours - x)[differ], np.abs(theirs - x)[differ])   # only exact ties differ
    assert not np.any(np.asarray(np.abs(ours / np.ldexp(1.0, e.astype(np.int64) - 127))[differ]
                                 ).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 1)  # ours went to even
    assert differ[-2:].sum() == 2 * 4 * 3 and differ[:-2].sum() < x.size / 1000 and np.abs(scaled).max() < 8


def test_mxfp4_ties_round_to_nearest_even_and_saturate_at_6():
    block = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.5] + [0.0] * 24, dtype=np.float32)
    assert round_trip(block[None], "mxfp4")[0, :8].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]


def test_mxfp4_scale_uses_exact_floor_log2_just_below_a_power_of_two(gguf):
    x = np.zeros((1, 32), dtype=np.float32)
    x[0, 0] = np.float32(2.0 ** 20) * np.float32(1 - 2.0 ** -24)    # float32 log2 of this rounds to 20.0
    _, e = quantize_mxfp4(x)
    assert e[0, 0] == 19 - 2 + 127
    assert gguf.quants.quantize(x, gguf.GGMLQuantizationType.MXFP4)[0, 0] == e[0, 0] + 1   # gguf: one more


# ---- shared behaviour ------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", BLOCKED)
def test_block_formats_name_the_shape_when_the_last_axis_is_not_a_multiple_of_32(fmt):
    with pytest.raises(QwenNPError, match=rf"{fmt}: the last axis must be a multiple of 32.*\(4, 40\)"):
        round_trip(np.ones((4, 40), dtype=np.float32), fmt)


@pytest.mark.parametrize("fmt", SCALED)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_scaled_formats_refuse_nan_and_inf(fmt, bad):
    x = np.ones((2, 64), dtype=np.float32)
    x[1, 3] = bad
    with pytest.raises(QwenNPError, match=f"{fmt}: cannot quantize non-finite values \\(1 NaN/inf"):
        round_trip(x, fmt)


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "bf16"])
def test_plain_casts_keep_nan_and_inf(fmt):
    got = round_trip(np.array([np.nan, np.inf, -np.inf, 1.0], dtype=np.float32), fmt)
    assert np.isnan(got[0]) and got[1] == np.inf and got[2] == -np.inf and got[3] == 1.0


def test_unknown_format_lists_the_known_ones():
    with pytest.raises(QwenNPError, match="unknown number format 'int3'; expected one of fp32, fp16, bf16"):
        round_trip(np.ones(32), "int3")


@pytest.mark.parametrize("fmt", FORMATS)
def test_bits_per_weight_is_what_the_quantized_parts_occupy(fmt):
    x = random_weights(16, 1024, seed=9)
    stored_bits = 8 * sum(part.nbytes for part in get_format(fmt).quantize(x))
    per_row_scales = 32 * x.shape[0] / x.size                      # fp8_*_rows and int8 keep an FP32 per row
    assert 0 <= stored_bits / x.size - bits_per_weight(fmt) <= per_row_scales


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(16, 1024), (3, 5, 64)])
def test_storage_bytes_counts_every_part_quantize_keeps(fmt, shape):
    x = np.random.default_rng(12).standard_normal(shape).astype(np.float32)
    assert storage_bytes(shape, fmt) == sum(part.nbytes for part in get_format(fmt).quantize(x))


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_returns_fp32_of_the_same_shape_and_leaves_the_input_alone(fmt):
    x = random_weights(4, 64, seed=10).astype(np.float64)
    before = x.copy()
    got = round_trip(x, fmt)
    assert got.dtype == np.float32 and got.shape == x.shape and np.array_equal(x, before)
    assert np.allclose(got, x, rtol=0.3, atol=0.3 * np.abs(x).max(axis=1, keepdims=True).max())


@pytest.mark.parametrize("quantize, dequantize", [(quantize_int8_rows, dequantize_int8_rows),
                                                  (quantize_q8_0, dequantize_q8_0),
                                                  (quantize_q4_0, dequantize_q4_0)])
def test_dequantizing_blocks_of_rows_into_one_buffer_equals_the_whole(quantize, dequantize):
    w = random_weights(40, 128, seed=11)
    parts = quantize(w)
    whole = dequantize(*parts)
    buffer = np.empty((16, w.shape[1]), dtype=np.float32)
    for start in range(0, len(w), 16):
        rows = [part[start:start + 16] for part in parts]
        block = dequantize(*rows, out=buffer[:len(rows[0])])
        assert block.base is buffer or block is buffer
        assert np.array_equal(block, whole[start:start + 16])


def test_dequantize_refuses_a_buffer_of_the_wrong_shape():
    q, scale = quantize_int8_rows(np.ones((4, 32), dtype=np.float32))
    with pytest.raises(QwenNPError, match=r"out must be a C-contiguous float32 array of shape \(4, 32\)"):
        dequantize_int8_rows(q, scale, out=np.empty((4, 64), dtype=np.float32)[:, :32])


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_vector_round_trips_as_one_row_of_a_matrix(fmt: str) -> None:
    """x [in] is one row: the same values as round_trip of x [1, in] (int8 and the row formats once
    failed on the 0-d scale of a vector)."""
    x = np.random.default_rng(5).standard_normal(96).astype(np.float32)
    got = round_trip(x, fmt)
    assert got.shape == x.shape and got.dtype == np.float32
    np.testing.assert_array_equal(got, round_trip(x[None, :], fmt)[0])
    np.testing.assert_array_equal(round_trip(np.zeros(64, np.float32), fmt), np.zeros(64, np.float32))


# ---- GGUF's other block kinds (ggml_blocks.BlockRows) against gguf's dequantizer ---------------------

# FP16 scales at the edges: largest, smallest subnormal and normal, zero of both signs, one.
EDGE_HALVES = np.array([65504, -65504, 2.0 ** -24, -(2.0 ** -24), 2.0 ** -14, 0.0, -0.0, 1.0], np.float16)


def edge_blocks(kind: str) -> np.ndarray:
    """Blocks whose FP16 fields are EDGE_HALVES (each with each, as the kind has one or two) and whose
    codes and packed scales are all zero bits, all one bits, or random."""
    size, fields = block_bytes(kind)
    fillings = [np.zeros(size, np.uint8), np.full(size, 255, np.uint8),
                np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8)]
    pairs = [(a, b) for a in EDGE_HALVES for b in EDGE_HALVES] if len(fields) == 2 else [(a,) for a in EDGE_HALVES]
    blocks = []
    for filling in fillings:
        for halves in pairs:
            block = filling.copy()
            for at, half in zip(fields, halves):
                block[at:at + 2] = np.array([half], np.float16).view(np.uint8)
            blocks.append(block)
    return np.array(blocks)[:, None, :]                                 # one block per row


# The kinds a GGUF kept as stored may hold: each BlockRows kind, and those repacked at load (RepackedRows).
HELD_BLOCK_KINDS = [*FP16_FIELDS, "Q4_K-repacked", "Q6_K-repacked", "Q8_0-repacked", "Q4_0-repacked"]
# The byte offsets of the FP16 fields of Q8_0's and Q4_0's blocks (d, the first two bytes).
FORMAT_FP16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,)}


def block_rows(kind: str, raw: np.ndarray):
    """`raw` blocks as `kind` holds them: BlockRows, or for "KIND-repacked" RepackedRows.from_blocks."""
    from qwen_np.numbers.ggml_blocks import BlockRows
    from qwen_np.numbers.ggml_repacked import RepackedRows

    name, _, repacked = kind.partition("-")
    return RepackedRows.from_blocks(name, raw) if repacked else BlockRows(name, raw)


def blocks_of(kind: str, raw: np.ndarray) -> np.ndarray:
    """`raw` [rows, count, bytes] as rows `kind` can hold: repacked Q4_0 pairs blocks within 256 values, so its
    rows are made 8 blocks long, at least 6 of them (the blocks in order, repeated from the first to fill)."""
    if kind != "Q4_0-repacked":
        return raw
    flat = raw.reshape(-1, raw.shape[-1])
    return np.resize(flat, (max(48, -(-len(flat) // 8) * 8), flat.shape[1])).reshape(-1, 8, flat.shape[1])


def test_the_block_kinds_have_ggufs_block_sizes(gguf) -> None:
    from qwen_np.numbers.ggml_blocks import BLOCK_KINDS

    for name, kind in BLOCK_KINDS.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]] == (kind.values, kind.size), name


@pytest.mark.parametrize("kind", HELD_BLOCK_KINDS)
def test_every_block_kind_widens_bit_for_bit_as_ggufs_dequantizer(gguf, kind: str) -> None:
    """Random blocks (every byte value, any finite FP16 scale) and edge blocks (the largest, subnormal and
    zero scales with codes all 0 or all 1): the same FP32 bits as gguf.quants.dequantize, for the whole
    matrix, a slice of its rows widened into part of a larger buffer, and gathered rows."""
    name = kind.partition("-")[0]
    qtype = gguf.GGMLQuantizationType[name]
    for raw in (blocks_of(kind, random_blocks(name, 12, 5, seed=1)), blocks_of(kind, edge_blocks(name))):
        reference = gguf.quants.dequantize(raw.reshape(len(raw), -1), qtype)       # [rows, in]
        assert np.isfinite(reference).all()
        held = block_rows(kind, raw)
        assert held.shape == reference.shape
        widened = np.empty(reference.shape, np.float32)
        held.widen(widened)
        assert same_bits(widened, reference)
        buffer = np.full((8, reference.shape[1]), np.nan, np.float32)
        held[2:5].widen(buffer[1:4])
        assert same_bits(buffer[1:4], reference[2:5]) and np.isnan(buffer[[0, 4]]).all()
        picked = np.array([4, 0, 4, 1])
        assert same_bits(upcast(held[picked]), reference[picked])


@pytest.mark.parametrize("kind", ["Q4_1", "Q5_0", "Q5_1"])
def test_blocks_quantized_by_gguf_widen_to_its_dequantization(gguf, kind: str) -> None:
    """The legacy kinds gguf can quantize, from real weights (rows over six orders of magnitude)."""
    from qwen_np.numbers.ggml_blocks import BlockRows

    qtype = gguf.GGMLQuantizationType[kind]
    blocks = gguf.quants.quantize(random_weights(16, 256, seed=12), qtype)
    reference = gguf.quants.dequantize(blocks, qtype)
    assert same_bits(upcast(BlockRows(kind, blocks.reshape(16, 8, -1))), reference)


@pytest.mark.parametrize("kind", [*HELD_BLOCK_KINDS, "q8_0", "q4_0"])
def test_groups_are_codes_scales_and_offsets_whose_widening_is_the_weight(kind: str) -> None:
    """What the fast path multiplies: w = a q + b per group, q small integers, a and b [rows, in/g]."""
    from qwen_np.numbers.formats import FormatRows
    from qwen_np.numbers.numerics import Grouped

    if kind in HELD_BLOCK_KINDS:
        held: Grouped = block_rows(kind, blocks_of(kind, random_blocks(kind.partition("-")[0], 6, 2, seed=3)))
    else:
        held = FormatRows(kind, get_format(kind).quantize(random_weights(6, 512, seed=3)), 512)
    codes, a, b = held.groups()
    rows, columns = held.shape
    assert isinstance(held, Grouped) and codes.shape == (rows, columns) and codes.dtype in (np.int8, np.uint8)
    assert a.shape == (rows, columns // held.group) and (b is None or b.shape == a.shape)
    by_group = codes.reshape(rows, -1, held.group).astype(np.float64) * a[..., None] + (0 if b is None else b[..., None])
    assert np.allclose(by_group.reshape(rows, columns), upcast(held), rtol=1e-6, atol=0)


@pytest.mark.parametrize("kind", [*HELD_BLOCK_KINDS, "q8_0", "q4_0"])
def test_coded_codes_are_the_groups_codes_in_code_order(kind: str) -> None:
    """coded(), the fast path's unpacking: the same codes as groups(), read in code_order (the value index of
    each input), group-major [G, rows, g], and a, b per group of that order; the values a q + b are the weight's."""
    from qwen_np.numbers.formats import FormatRows
    from qwen_np.numbers.numerics import Grouped

    if kind in HELD_BLOCK_KINDS:
        held: Grouped = block_rows(kind, blocks_of(kind, random_blocks(kind.partition("-")[0], 6, 2, seed=5)))
    else:
        held = FormatRows(kind, get_format(kind).quantize(random_weights(6, 512, seed=5)), 512)
    rows, columns = held.shape
    order = np.arange(columns) if held.code_order is None else held.code_order
    assert sorted(order) == list(range(columns))
    planes, a, b = (None if part is None else np.array(part) for part in held.coded())
    assert planes.shape == (columns // held.group, rows, held.group)
    codes = np.moveaxis(planes, 0, 1).reshape(rows, columns)                       # [rows, in] in code order
    assert a.shape == (columns // held.group, rows) and (b is None or b.shape == a.shape)
    values = codes.reshape(rows, -1, held.group).astype(np.float64) * a.T[..., None] + (0 if b is None else b.T[..., None])
    assert np.allclose(values.reshape(rows, columns), upcast(held)[:, order], rtol=1e-6, atol=0)
