"""Hostile GGUF tensor data: a block whose FP16 scale is NaN or Inf, a plain F32/F16/BF16 tensor holding one,
a file whose data ends mid-tensor, a tensor whose bytes do not fit its shape, a K-quant row that is not whole
blocks of 256. Each must be refused with one line naming the file and the tensor, by load_model and by the
CLI (exit 2): never loaded to serve NaN, never a traceback, never a silently wrong shape.

test_gguf_fuzz.py leaves the tensor data alone (a changed weight is a different model); these cases change
the data, or the tensor list, in the ways a reader can tell.
"""

from __future__ import annotations

import functools
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GGML
from gguf import GGUFReader

from tests.conftest import FP16_FIELDS, FORMAT_BLOCKS
from tests.files.test_gguf import PROMPT, block_gguf, export, logits, qwen, refused, rewrite, tiny_checkpoint

# Every block kind a GGUF holds as its blocks, with the byte offsets of its FP16 fields (conftest's table,
# written from ggml's block structs, not from qwen_np).
FIELDS = {**FP16_FIELDS, **{kind: (0,) for kind in FORMAT_BLOCKS}}
BAD_HALVES = {"nan": 0x7E00, "-inf": 0xFC00}          # +inf: the same exponent, sign aside
EMBEDDING = "token_embd.weight"


@functools.cache
def kind_file(kind: str, folder: Path) -> Path:
    """An untied tiny Qwen3 (rows of 256 and 512 values) whose matrices are all blocks of `kind`."""
    source = tiny_checkpoint(folder / f"ckpt-{kind}", hidden_size=256, intermediate_size=512,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    return block_gguf(source, folder / f"{kind}.gguf", kinds=[kind])


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hostile-blocks")


def tensor_of(path: Path, name: str) -> gguf.ReaderTensor:
    return next(tensor for tensor in GGUFReader(path).tensors if tensor.name == name)


def with_bytes(path: Path, out: Path, offset: int, data: bytes) -> Path:
    raw = bytearray(path.read_bytes())
    raw[offset:offset + len(data)] = data
    out.write_bytes(bytes(raw))
    return out


def bad_block(path: Path, out: Path, name: str, row: int, block: int, at: int, half: int) -> Path:
    """A copy of `path` whose tensor `name` has the FP16 at byte `at` of block `block` of row `row` set to `half`."""
    tensor = tensor_of(path, name)
    values, size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
    per_row = int(tensor.shape[0]) // values
    return with_bytes(path, out, int(tensor.data_offset) + (row * per_row + block) * size + at, struct.pack("<H", half))


# --- A non-finite scale in a block --------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("bad", BAD_HALVES)
@pytest.mark.parametrize("kind, at", [(kind, at) for kind, fields in FIELDS.items() for at in fields])
def test_a_block_whose_fp16_scale_is_not_finite_is_refused_naming_the_tensor_row_and_block(
        folder: Path, tmp_path: Path, kind: str, at: int, bad: str) -> None:
    """The probe's case: an untied model's embedding, whose rows only a prompt reads (a check of the first token's
    logits at start-up never sees row 17), with one block's d, m or dmin NaN or Inf."""
    good = kind_file(kind, folder)
    last = 256 // gguf.GGML_QUANT_SIZES[GGML[kind]][0] - 1            # the row's last block (rows of 256 values)
    path = bad_block(good, tmp_path / "bad.gguf", EMBEDDING, 17, last, at, BAD_HALVES[bad])
    text = refused(path, f"tensor {EMBEDDING!r}")
    assert f"block {last} of row 17" in text and "not finite" in text, text


def test_a_non_finite_scale_in_a_repacked_matrix_is_refused_too(folder: Path, tmp_path: Path) -> None:
    """A Q4_K matrix the loader repacks (its parts copied out of the file at load) is checked as well."""
    path = bad_block(kind_file("Q4_K", folder), tmp_path / "bad.gguf", "blk.1.ffn_up.weight", 300, 0, 2, 0x7C00)
    text = refused(path, "tensor 'blk.1.ffn_up.weight'")
    assert "row 300" in text and "dmin" in text, text


def test_blocks_with_finite_scales_load_as_before(folder: Path) -> None:
    """Subnormal, zero and negative FP16 scales are finite: the check refuses only inf and NaN."""
    good = kind_file("Q4_K", folder)
    tensor = tensor_of(good, EMBEDDING)
    raw = bytearray(good.read_bytes())
    start = int(tensor.data_offset)
    for i, half in enumerate((0x0000, 0x8000, 0x0001, 0xFBFF)):       # +0, -0, the smallest subnormal, -65504
        raw[start + 144 * i:start + 144 * i + 2] = struct.pack("<H", half)
    path = good.with_name("finite.gguf")
    path.write_bytes(bytes(raw))
    assert logits(path).shape == (len(PROMPT), 2048)


# --- A non-finite value in a plain tensor -------------------------------------------------------------------

PLAIN_BAD = {"F32": (4, struct.pack("<f", float("nan"))), "F16": (2, struct.pack("<H", 0x7C00)),
             "BF16": (2, struct.pack("<H", 0xFF80))}


@pytest.mark.parametrize("file_type", ["f32", "f16", "bf16"])
def test_a_plain_tensor_holding_a_nan_or_inf_is_refused_naming_it(tmp_path: Path, file_type: str) -> None:
    good = export(tiny_checkpoint(tmp_path / "ckpt"), tmp_path / f"{file_type}.gguf", file_type)
    tensor = tensor_of(good, "blk.1.attn_k.weight")
    width, data = PLAIN_BAD[tensor.tensor_type.name]
    columns = int(tensor.shape[0])
    path = with_bytes(good, tmp_path / "bad.gguf", int(tensor.data_offset) + width * (5 * columns + 3), data)
    text = refused(path, "tensor 'blk.1.attn_k.weight'")
    assert "row 5" in text and "not finite" in text, text


def test_a_norm_weight_holding_a_nan_is_refused(tmp_path: Path) -> None:
    good = export(tiny_checkpoint(tmp_path / "ckpt"), tmp_path / "q8_0.gguf", "q8_0")
    tensor = tensor_of(good, "output_norm.weight")
    path = with_bytes(good, tmp_path / "bad.gguf", int(tensor.data_offset) + 4 * 7, struct.pack("<f", float("nan")))
    refused(path, "tensor 'output_norm.weight'")


def test_an_iq_kind_dequantized_at_load_is_refused_when_a_scale_is_not_finite(tmp_path: Path) -> None:
    """The kinds gguf dequantizes at load (IQ4_NL here): their values are checked once widened."""
    good = export(tiny_checkpoint(tmp_path / "ckpt", hidden_size=256), tmp_path / "f32.gguf", "f32")
    blocks = np.random.default_rng(0).integers(0, 256, size=(64, 8, 18), dtype=np.uint8)   # q_proj: 64 rows of 256
    blocks[..., :2] = np.array([1e-3], np.float16).view(np.uint8)
    blocks[9, 2, :2] = np.array([np.inf], np.float16).view(np.uint8)
    path = rewrite(good, tmp_path / "iq4_nl.gguf", replace={"blk.0.attn_q.weight": (blocks.reshape(64, -1), GGML.IQ4_NL)})
    text = refused(path, "tensor 'blk.0.attn_q.weight'")
    assert "row 9" in text, text


# --- The command line ---------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("command", [["generate", "--no-chat", "-n", "2", "hi"], ["inspect"]])
def test_a_gguf_with_a_nan_scale_is_one_error_line_and_exit_2_on_the_cli(
        folder: Path, tmp_path: Path, command: list[str]) -> None:
    path = bad_block(kind_file("Q4_K", folder), tmp_path / "bad.gguf", EMBEDDING, 17, 0, 0, 0x7E00)
    result = qwen(*command[:1], "--model", str(path), *command[1:])
    lines = result.stderr.decode().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr.decode()
    assert lines[0].startswith(f"error: {path}: tensor {EMBEDDING!r}") and "not finite" in lines[0]


# --- Blocks that do not fit the file or the shape ----------------------------------------------------------

def info_field(path: Path, name: str, part: int) -> int:
    """Where part `part` of tensor `name`'s entry in the tensor list starts (0 the name's length, 1 the name,
    2 the dimension count, 3 the dimensions, 4 the type, 5 the data offset)."""
    tensor = tensor_of(path, name)
    return tensor.field.offset + sum(int(p.nbytes) for p in tensor.field.parts[:part])


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("name", [EMBEDDING, "blk.0.attn_q.weight", "blk.1.ffn_down.weight", "output.weight"])
def test_a_k_quant_file_cut_inside_a_tensor_is_refused_naming_that_tensor(
        folder: Path, tmp_path: Path, kind: str, name: str) -> None:
    good = kind_file(kind, folder)
    tensor = tensor_of(good, name)
    path = tmp_path / "cut.gguf"
    for cut in (1, int(tensor.n_bytes) // 2 + 7, int(tensor.n_bytes) - 1):       # within its first, middle, last block
        path.write_bytes(good.read_bytes()[:int(tensor.data_offset) + cut])
        refused(path, f"tensor {name!r} runs to byte")


@pytest.mark.parametrize("dims", [(128, 512), (384, 170), (255, 256), (257, 256)])
def test_a_k_quant_row_that_is_not_whole_blocks_of_256_is_refused_naming_the_tensor(
        folder: Path, tmp_path: Path, dims: tuple[int, int]) -> None:
    good = kind_file("Q4_K", folder)
    path = with_bytes(good, tmp_path / "rows.gguf", info_field(good, "blk.0.attn_q.weight", 3), struct.pack("<QQ", *dims))
    refused(path, f"tensor 'blk.0.attn_q.weight': rows of {dims[0]} values are not whole Q4_K blocks of 256")


def test_whole_blocks_in_another_shape_are_refused_not_loaded_as_that_shape(folder: Path, tmp_path: Path) -> None:
    """[256, 256] as [128, 512]: the same blocks and bytes, rows of 512 values (whole blocks): the shape the
    metadata implies is held against it."""
    good = kind_file("Q4_K", folder)
    path = with_bytes(good, tmp_path / "shape.gguf", info_field(good, "blk.0.attn_q.weight", 3), struct.pack("<QQ", 512, 128))
    refused(path, "tensor 'blk.0.attn_q.weight' has shape [128, 512] (NumPy order) but the metadata implies [256, 256]")


@pytest.mark.parametrize("kind", [GGML.Q5_K, GGML.Q6_K, GGML.Q2_K, GGML.Q3_K])
@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "output.weight"])
def test_a_tensor_whose_type_does_not_fit_its_bytes_is_refused_naming_it(
        folder: Path, tmp_path: Path, name: str, kind: GGML) -> None:
    """A Q4_K tensor's type set to a kind of other block bytes: its data, by its shape, ends before or after the
    next tensor's (or the file's end, for the last one). The error names the tensor whose bytes do not fit,
    not only its neighbour: a last tensor that ends early (Q2_K, Q3_K) left the rest of the file unread and
    loaded (its random blocks, unless a scale happened to be NaN)."""
    good = kind_file("Q4_K", folder)
    path = with_bytes(good, tmp_path / "type.gguf", info_field(good, name, 4), struct.pack("<I", kind))
    refused(path, f"tensor {name!r} as {kind.name} of shape [")
