"""GGUF files (llama.cpp, Ollama, LM Studio): a Qwen3's config, weights, tokenizer and chat template
in one file, read with ggml's own `gguf` package and written with its GGUFWriter.

Layout, as the reader and writer see it:
* Metadata is key/value pairs: `general.architecture` ("qwen3"), the shape under `qwen3.*`, the
  tokenizer under `tokenizer.ggml.*` and `tokenizer.chat_template`. The vocabulary size is the length
  of the token list; the LM head is tied when there is no `output.weight` tensor (llama.cpp then
  uses `token_embd.weight` for both, as transformers does with tie_word_embeddings).
* Tensor names are llama.cpp's (`blk.N.attn_q.weight`), mapped to the Hugging Face names of
  config.LAYER_TENSORS / MODEL_TENSORS by gguf's own TensorNameMap for the QWEN3 architecture.
* Dimensions are listed in ggml order, the contiguous axis first (ne[0]), i.e. reversed from the NumPy
  shape: an HF [out, in] matrix is stored with dims [in, out] and the same bytes, so it is read as
  the NumPy shape reversed(dims) with no transpose. Quantization blocks run along ne[0] (a row).
* Q and K rows are stored exactly as in the HF checkpoint: llama.cpp's convert_hf_to_gguf.py permutes
  them only in LlamaModel (conversion/llama.py), which Qwen3Model(Qwen2Model) does not inherit, and
  llama.cpp runs QWEN2/QWEN3 with NEOX RoPE, HF's rotate-half pairing (src/llama-model.cpp); so does
  transformers' GGUF loader, which un-permutes only "llama" (modeling_gguf_pytorch_utils.py).

Weights are held as the safetensors loader holds them: F32, F16 and BF16 tensors
are zero-copy views of the memory-mapped file, read through checkpoint.Checkpoint. Quantized tensors
kept as stored are zero-copy views too, dequantized block of rows by block of rows on use: Q8_0 and
Q4_0 as their blocks' scales and codes (formats.FormatRows), Q4_1, Q5_0, Q5_1 and the K-quants as
their blocks' bytes (ggml_blocks.BlockRows); but Q8_0, Q4_0, Q4_K and Q6_K, within a memory budget,
are repacked at load (ggml_blocks.RepackedRows: their parts taken apart once, not on every product).
The other types (the IQ kinds, ...) are dequantized to FP32 at load with gguf.quants.dequantize, so
they cost 4 bytes per weight in memory.
"""

from __future__ import annotations

import functools
import json
import math
import mmap
import os
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import jinja2
import numpy as np
import tokenizers
from gguf import GGMLQuantizationType as GGML
from gguf import GGUFReader, GGUFValueType, GGUFWriter, Keys, LlamaFileType, TokenType
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors

from .checkpoint import Checkpoint, TensorInfo
from ..core.defaults import GGUF_FILE_TYPES
from ..core.config import LAYER_TENSORS, MODEL_TENSORS, Qwen3Config, expected_tensors
from ..errors import QwenNPError
from ..numbers.formats import FormatRows
from ..numbers.ggml_blocks import (BLOCK_KINDS, EXPONENTS, FP16_FIELDS, REPACKINGS, BlockRows, RepackedRows,
                                   first_bad_scale, first_not_finite, repackable)
from ..numbers.numerics import Weight, upcast
from ..core.sampling import SamplingParams
from .tokenizer import Tokenizer

ARCHITECTURE = "qwen3"
# Held as stored (views of the file): ggml type -> the safetensors dtype name Checkpoint reads.
STORED_TYPES = {GGML.F32: "F32", GGML.F16: "F16", GGML.BF16: "BF16"}
# Held as their blocks when the weights are kept as stored (--memory bf16, or auto when FP32 does not fit):
# ggml type -> the formats.HELD_FORMATS name whose parts hold the same scales and codes.
BLOCK_FORMATS = {GGML.Q8_0: "q8_0", GGML.Q4_0: "q4_0"}
# Kept as stored, the tensors of the kinds ggml_blocks repacks (REPACKINGS: Q8_0, Q4_0, Q4_K, Q6_K) are held
# repacked while that adds at most this share to the bytes of the file's tensors (GGUFCheckpoint._repacked):
# speed for a bounded cost in memory. Q8_0, Q4_0 and Q4_K add 6-11%, Q6_K 30%: a Q4_K_M file (Qwen3-0.6B's
# tied Q6_K embedding included) gets all of them, an all-Q6_K file about two thirds.
REPACK_BUDGET = 0.2
# Qwen2's pre-tokenizer regex (tokenizer.ggml.pre = "qwen2"), as in llama.cpp's src/llama-vocab.cpp and
# in the Split of every Qwen2/Qwen3 tokenizer.json.
QWEN2_PRE = "qwen2"
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp also ends generation at these tokens whatever eos_token_id says (llama-vocab.cpp finds its
# end-of-generation set by token text); Qwen3's generation_config.json lists both too.
END_OF_GENERATION = ("<|im_end|>", "<|endoftext|>")


# --- Reading -------------------------------------------------------------------------------------

# Limits a file is held to before gguf's reader walks it. gguf trusts every count it reads and walks a
# metadata array entry by entry in Python, reading past the end of the file as empty values: a corrupt
# count had it loop for hours. So the layout is walked first with struct (no Python object per entry),
# each count and length checked against the bytes left, each tensor placed as ggml's gguf.cpp places it.
GGUF_VERSIONS = (2, 3)            # the versions gguf's reader and ggml read (version 1 is long gone)
MAX_DIMS = 4                      # GGML_MAX_DIMS
MAX_NAME_BYTES = 63               # GGML_MAX_NAME is 64 with the terminating NUL
# gguf holds about 250 bytes of Python objects per string entry it parses; this bounds one array to about
# 250 MB and a few seconds. A Qwen3 vocabulary is 151,936 tokens (and 151,387 merges).
MAX_ARRAY_ENTRIES = 1 << 20
SCALAR_BYTES: dict[int, int] = {int(kind): np.dtype(scalar).itemsize for kind, scalar in GGUFReader.gguf_scalar_to_np.items()}
# The smallest key/value pair (a 1-byte key, its type, a 1-byte value) and tensor entry (a 1-byte name,
# no dims, its type and offset): a count that many of could not fit in the bytes left is refused at once.
MIN_KV_BYTES, MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 1, 8 + 1 + 4 + 4 + 8


class _Cursor:
    """Reads a GGUF's little-endian fields in order, refusing any that would run past the end of the file."""

    def __init__(self, path: Path, data: mmap.mmap) -> None:
        self.path, self.data, self.offset = path, data, 0

    def left(self) -> int:
        return len(self.data) - self.offset

    def skip(self, size: int, what: str) -> int:
        """Step over `size` bytes of `what`; returns where they start."""
        if size > self.left():
            raise QwenNPError(f"{self.path}: {what} at byte {self.offset} takes {size} bytes but the file has "
                              f"{self.left()} left (a truncated or corrupt GGUF file)")
        self.offset += size
        return self.offset - size

    def number(self, fmt: str, what: str) -> int:
        return int(struct.unpack_from(fmt, self.data, self.skip(struct.calcsize(fmt), what))[0])

    def text(self, what: str) -> str:
        """A length-prefixed UTF-8 string (a key or tensor name)."""
        start = self.skip(self.number("<Q", f"the length of {what}"), what)
        try:
            return self.data[start:self.offset].decode("utf-8")
        except UnicodeDecodeError as bad:
            raise QwenNPError(f"{self.path}: {what} at byte {start} is not valid UTF-8 ({bad.reason})") from None

    def strings(self, count: int, what: str) -> None:
        """Step over `count` length-prefixed strings (a token list: one struct call each, no objects kept)."""
        data, offset, end = self.data, self.offset, len(self.data)
        for index in range(count):
            if offset + 8 > end or (offset := offset + 8 + struct.unpack_from("<Q", data, offset)[0]) > end:
                raise QwenNPError(f"{self.path}: entry {index} of {what} runs past the end of the file "
                                  "(a truncated or corrupt GGUF file)")
        self.offset = offset


def _check_layout(path: Path, data: mmap.mmap) -> None:
    """Walk the header, key/value pairs and tensor list as gguf's reader will, checking every count and
    length first; then check the tensors' data as ggml does: each tensor starts where the one before it
    ends (padded to the alignment), so no two share bytes and none runs past the end of the file."""
    cursor = _Cursor(path, data)
    if data[:4] != b"GGUF" or len(data) < 24:
        raise QwenNPError(f"{path}: not a valid GGUF file (no GGUF magic and 24-byte header)")
    cursor.skip(4, "the magic")
    version = cursor.number("<I", "the version")
    if version & 0xFFFF == 0:          # Checkpoint maps tensors as little-endian, as llama.cpp writes them
        raise QwenNPError(f"{path}: a big-endian GGUF; qwen_np reads little-endian files (llama.cpp's default)")
    if version not in GGUF_VERSIONS:
        raise QwenNPError(f"{path}: GGUF version {version}; qwen_np reads versions {GGUF_VERSIONS}")
    tensor_count, kv_count = cursor.number("<Q", "the tensor count"), cursor.number("<Q", "the key/value count")
    if kv_count * MIN_KV_BYTES + tensor_count * MIN_TENSOR_INFO_BYTES > cursor.left():
        raise QwenNPError(f"{path}: the header declares {kv_count} metadata keys and {tensor_count} tensors, more "
                          f"than the {len(data)}-byte file can hold (a truncated or corrupt GGUF file)")
    alignment = gguf.GGUF_DEFAULT_ALIGNMENT
    for index in range(kv_count):
        key = cursor.text(f"the name of metadata key #{index}")
        kind = cursor.number("<I", f"the type of metadata key {key!r}")
        if key == Keys.General.ALIGNMENT and kind == GGUFValueType.UINT32:   # gguf refuses any other type
            alignment = cursor.number("<I", f"metadata key {key!r}")
            if alignment == 0 or alignment & (alignment - 1):
                raise QwenNPError(f"{path}: {key} is {alignment}, not a power of two")
        else:
            _skip_value(cursor, key, kind)
    tensors = [_tensor_span(cursor, index) for index in range(tensor_count)]
    data_start, expected = -(-cursor.offset // alignment) * alignment, 0
    for number, tensor in enumerate(tensors):
        if tensor.offset != expected:
            after = f", the end of {tensors[number - 1].described()}" if number else ""
            raise QwenNPError(f"{path}: tensor {tensor.name!r} has data offset {tensor.offset} where ggml expects "
                              f"{expected}{after} (tensors lie back to back in file order, each padded to {alignment} "
                              "bytes: none may share bytes, and each takes the bytes its type and shape say)")
        if data_start + tensor.offset + tensor.size > len(data):
            raise QwenNPError(f"{path}: tensor {tensor.name!r} runs to byte {data_start + tensor.offset + tensor.size}, "
                              f"past the end of the {len(data)}-byte file (truncated? or its type or shape is wrong: "
                              f"{tensor.described()})")
        expected += -(-tensor.size // alignment) * alignment
    # The last tensor's data must end the file (padding aside): bytes after it are data its type or shape leaves
    # unread, e.g. a Q4_K tensor marked Q2_K, whose 84-byte blocks would load from the first 7/12 of its bytes.
    if tensors and len(data) > data_start + expected:
        end = data_start + tensors[-1].offset + tensors[-1].size
        raise QwenNPError(f"{path}: {len(data) - end} bytes follow the last {tensors[-1].described()}, which ends at "
                          f"byte {end}: its type or shape does not match its data (or the file is corrupt)")


class _TensorSpan(NamedTuple):
    """A tensor-info entry as _check_layout places it: its name, ggml kind, dims (ne[0] first), data offset, bytes."""

    name: str
    kind: GGML
    dims: list[int]
    offset: int
    size: int

    def described(self) -> str:
        return f"tensor {self.name!r} as {self.kind.name} of shape {self.dims[::-1]} ({self.size} bytes)"


def _skip_value(cursor: _Cursor, key: str, kind: int) -> None:
    """Step over one metadata value of type `kind`; an array's count is checked before any entry is read."""
    what = f"metadata key {key!r}"
    if kind in SCALAR_BYTES:
        cursor.skip(SCALAR_BYTES[kind], what)
    elif kind == GGUFValueType.STRING:
        cursor.skip(cursor.number("<Q", f"the length of {what}"), what)
    elif kind == GGUFValueType.ARRAY:
        item = cursor.number("<I", f"the entry type of {what}")
        count = cursor.number("<Q", f"the entry count of {what}")
        if count > MAX_ARRAY_ENTRIES:
            raise QwenNPError(f"{cursor.path}: {what} declares {count} entries; qwen_np reads arrays of at most "
                              f"{MAX_ARRAY_ENTRIES} (a truncated or corrupt GGUF file?)")
        if item == GGUFValueType.STRING:
            if 8 * count > cursor.left():       # each entry has at least its 8-byte length
                raise QwenNPError(f"{cursor.path}: {what} declares {count} strings but only {cursor.left()} bytes "
                                  "follow (a truncated or corrupt GGUF file)")
            cursor.strings(count, what)
        elif item in SCALAR_BYTES:
            cursor.skip(count * SCALAR_BYTES[item], f"the {count} entries of {what}")
        else:                                   # ggml's reader refuses arrays of arrays too
            raise QwenNPError(f"{cursor.path}: {what} is an array of entry type {item}, which GGUF does not define")
    else:
        raise QwenNPError(f"{cursor.path}: {what} has value type {kind}, which GGUF does not define")


def _tensor_span(cursor: _Cursor, index: int) -> _TensorSpan:
    """One tensor-info entry, checked as ggml's reader checks it."""
    name = cursor.text(f"the name of tensor #{index}")
    where = f"{cursor.path}: tensor {name!r}"
    if len(name.encode()) > MAX_NAME_BYTES:
        raise QwenNPError(f"{where}: its name is longer than ggml's {MAX_NAME_BYTES} bytes")
    n_dims = cursor.number("<I", f"the dimension count of tensor {name!r}")
    if n_dims > MAX_DIMS:
        raise QwenNPError(f"{where}: {n_dims} dimensions (ggml has at most {MAX_DIMS})")
    dims = [cursor.number("<Q", f"dimension {i} of tensor {name!r}") for i in range(n_dims)]
    raw_type = cursor.number("<I", f"the type of tensor {name!r}")
    try:
        kind = GGML(raw_type)
        block, type_bytes = gguf.GGML_QUANT_SIZES[kind]
    except (ValueError, KeyError):
        raise QwenNPError(f"{where}: unknown ggml type {raw_type}") from None
    if math.prod(dims) >= 2 ** 63:            # ggml counts elements in an int64 (a dimension over 2^63 is negative)
        raise QwenNPError(f"{where}: dimensions {dims} hold more elements than ggml can count")
    if dims and dims[0] % block:
        raise QwenNPError(f"{where}: rows of {dims[0]} values are not whole {kind.name} blocks of {block}")
    offset = cursor.number("<Q", f"the data offset of tensor {name!r}")
    return _TensorSpan(name, kind, dims, offset, math.prod(dims) * type_bytes // block)


class _Reader(GGUFReader):
    """gguf's reader, run on a file whose layout _check_layout has checked, parsing a plain ndarray view of
    the file rather than the np.memmap itself: the reader slices the map once or twice per string, and
    np.memmap's bookkeeping on every slice was 4/5 of parsing Qwen3's 151,936 tokens and 151,387 merges
    (measured: 10.5 s -> 2.9 s on this machine). Its data property is gguf's (>= 0.19) internal one."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as file:
            if os.fstat(file.fileno()).st_size == 0:
                raise QwenNPError(f"{path}: not a valid GGUF file (it is empty)")
            with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
                _check_layout(path, data)
        super().__init__(path)

    @property                                   # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._bytes

    @data.setter
    def data(self, mapped: np.memmap) -> None:
        self._bytes = mapped.view(np.ndarray)   # the same pages; the view keeps the map alive
        self._map: mmap.mmap = mapped._mmap     # type: ignore[attr-defined]

    def release(self, start: int, nbytes: int) -> None:
        """Drop the whole pages of bytes [start, start + nbytes) from this process's memory (the page cache
        keeps them; a later read maps them again): a tensor copied out of the file would otherwise count
        twice in the process's resident memory, as its copy and as the file's pages it was read from."""
        first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (start + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > first and hasattr(mmap, "MADV_DONTNEED"):
            try:
                self._map.madvise(mmap.MADV_DONTNEED, first, end - first)
            except OSError:                     # a kernel that refuses it: the pages merely stay resident
                pass


def open_reader(path: str | Path) -> _Reader:
    """The parsed file; parsed once per file version (the config, tokenizer and weights all read it)."""
    path = Path(path).expanduser()
    stat = path.stat()
    return _parse(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _parse(path: Path, size: int, mtime_ns: int) -> _Reader:
    try:
        return _Reader(path)
    except (ValueError, KeyError) as bad:       # what gguf checks itself: keys or tensor names given twice, ...
        raise QwenNPError(f"{path}: not a valid GGUF file ({bad})") from None


def _get(reader: _Reader, key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    """Metadata value `key`, checked to be of `kind`; `default` when absent (absent and no default: error)."""
    field = reader.get_field(key)
    if field is None:
        if default is ...:
            raise QwenNPError(f"{reader.path}: metadata key {key!r} is missing")
        return default
    try:
        value = field.contents()
    except UnicodeDecodeError as bad:           # GGUF strings are UTF-8; a flipped bit can break one
        raise QwenNPError(f"{reader.path}: metadata key {key!r} is not valid UTF-8 ({bad})") from None
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise QwenNPError(f"{reader.path}: metadata key {key!r} has the wrong type ({value!r:.60})")
    return value


def _arch(name: str) -> str:
    return name.format(arch=ARCHITECTURE)


# Every qwen3.* key qwen_np knows: those read_config reads, and two it checks against them (vocab_size, the
# token list's length; rope.dimension_count, head_dim: Qwen3 rotates whole heads). Any other key of the
# architecture could change the network (RoPE scaling factors, a sliding window, ...), and a misspelt one
# would leave its setting at a default: a file with one is refused rather than run without it.
ARCH_KEYS = frozenset(_arch(key) for key in (
    Keys.LLM.BLOCK_COUNT, Keys.LLM.CONTEXT_LENGTH, Keys.LLM.EMBEDDING_LENGTH, Keys.LLM.FEED_FORWARD_LENGTH,
    Keys.LLM.VOCAB_SIZE, Keys.Attention.HEAD_COUNT, Keys.Attention.HEAD_COUNT_KV, Keys.Attention.KEY_LENGTH,
    Keys.Attention.VALUE_LENGTH, Keys.Attention.LAYERNORM_RMS_EPS, Keys.Rope.FREQ_BASE, Keys.Rope.DIMENSION_COUNT,
    Keys.Rope.SCALING_TYPE))
LAYER_INDEX = re.compile(r"blk\.(\d+)\.")        # the N of a llama.cpp layer tensor name (blk.N.attn_q.weight)


def read_config(path: str | Path) -> Qwen3Config:
    """The Qwen3Config a GGUF's metadata describes (llama.cpp's convert_hf_to_gguf.py wrote it from config.json),
    checked against the tensors the file holds."""
    reader = open_reader(path)
    source = str(reader.path)
    architecture = _get(reader, Keys.General.ARCHITECTURE, str)
    if architecture != ARCHITECTURE:
        raise QwenNPError(f"{source}: general.architecture is {architecture!r}; qwen_np runs only dense "
                          f"{ARCHITECTURE!r} models (Qwen3-MoE, Qwen2, Llama and others are different networks)")
    unknown = sorted(key for key in reader.fields if key.startswith(f"{ARCHITECTURE}.") and key not in ARCH_KEYS)
    if unknown:
        raise QwenNPError(f"{source}: metadata key {unknown[0]!r} is not a {ARCHITECTURE} setting qwen_np knows "
                          "(it may change the network, so the file is refused rather than run without it)")
    scaling = _get(reader, _arch(Keys.Rope.SCALING_TYPE), str, "none")
    if scaling != "none":
        raise QwenNPError(f"{source}: {_arch(Keys.Rope.SCALING_TYPE)} is {scaling!r}; only default RoPE is supported")
    heads = _get(reader, _arch(Keys.Attention.HEAD_COUNT), int)
    hidden = _get(reader, _arch(Keys.LLM.EMBEDDING_LENGTH), int)
    head_dim = _get(reader, _arch(Keys.Attention.KEY_LENGTH), int, hidden // max(heads, 1))   # llama.cpp's default
    tokens = _get(reader, Keys.Tokenizer.LIST, list)
    eos = _end_of_generation(reader, tokens)
    for key, value in ((Keys.Attention.VALUE_LENGTH, head_dim), (Keys.Rope.DIMENSION_COUNT, head_dim),
                       (Keys.LLM.VOCAB_SIZE, len(tokens))):
        if (given := _get(reader, _arch(key), int, value)) != value:
            raise QwenNPError(f"{source}: {_arch(key)} is {given}, not {value} "
                              "(Qwen3 has one head_dim for keys, values and RoPE, and a logit per token of the list)")
    config = Qwen3Config(
        vocab_size=len(tokens),
        hidden_size=hidden,
        intermediate_size=_get(reader, _arch(Keys.LLM.FEED_FORWARD_LENGTH), int),
        num_hidden_layers=_layer_count(reader),
        num_attention_heads=heads,
        num_key_value_heads=_get(reader, _arch(Keys.Attention.HEAD_COUNT_KV), int, heads),
        head_dim=head_dim,
        rms_norm_eps=_f32_decimal(_get(reader, _arch(Keys.Attention.LAYERNORM_RMS_EPS), (int, float))),
        rope_theta=_f32_decimal(_get(reader, _arch(Keys.Rope.FREQ_BASE), (int, float), 10000.0)),   # llama.cpp's default
        max_position_embeddings=_get(reader, _arch(Keys.LLM.CONTEXT_LENGTH), int),
        tie_word_embeddings=_gguf_name(MODEL_TENSORS["lm_head"].name) not in _tensors_by_name(reader),
        bos_token_id=_token_id(reader, Keys.Tokenizer.BOS_ID, tokens),
        eos_token_id=eos[0] if len(eos) == 1 else eos or None,
        torch_dtype="float32",     # what a GGUF's weights compute in here, whatever they are stored as
    )
    config.validate(source)
    return config


def _layer_count(reader: _Reader) -> int:
    """block_count, which must be the number of layers the tensors hold (checked before anything lists a
    layer's tensors: a block_count of 2^32 would have 11 x 2^32 names listed; one below the file's layers
    would run the model without its last layers)."""
    key = _arch(Keys.LLM.BLOCK_COUNT)
    declared = _get(reader, key, int)
    held = 1 + max((int(match[1]) for tensor in reader.tensors if (match := LAYER_INDEX.match(tensor.name))), default=-1)
    if declared > held:
        missing = _gguf_name(LAYER_TENSORS["input_layernorm"].name.format(i=held), held + 1)
        raise QwenNPError(f"{reader.path}: {key} is {declared} but the file's tensors hold {held} layers "
                          f"(tensor {missing!r} is missing)")
    if declared < held:
        extra = [tensor.name for tensor in reader.tensors
                 if (match := LAYER_INDEX.match(tensor.name)) and int(match[1]) >= max(declared, 0)]
        raise QwenNPError(f"{reader.path}: {key} is {declared} but the file holds tensors of {held} layers "
                          f"({len(extra)} tensors the metadata does not account for, from {extra[0]!r})")
    return declared


def _token_id(reader: _Reader, key: str, tokens: list[str]) -> int | None:
    """A token id key (absent: None), which must index the token list."""
    token_id = _get(reader, key, int, None)
    if token_id is not None and not 0 <= token_id < len(tokens):
        raise QwenNPError(f"{reader.path}: {key} {token_id} is not a token id (the vocabulary has {len(tokens)})")
    return token_id


def _f32_decimal(value: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it: GGUF stores eps, freq_base and
    the sampling settings as f32, so config.json's 1e-6 comes back as 9.999999974752427e-07 (the same
    float32, which is what the forward pass adds) and top_p 0.95 as 0.949999988; this gives 1e-06 and 0.95."""
    with np.errstate(over="ignore"):            # a float64 value past float32's range becomes inf (config refuses it)
        return float(str(np.float32(value)))


def _end_of_generation(reader: _Reader, tokens: list[str]) -> list[int]:
    """eos_token_id (and an EOT id, if any), then the END_OF_GENERATION tokens the vocabulary has."""
    ids = [_token_id(reader, key, tokens) for key in (Keys.Tokenizer.EOS_ID, Keys.Tokenizer.EOT_ID)]
    by_text = {token: i for i, token in enumerate(tokens) if token in END_OF_GENERATION}
    return list(dict.fromkeys([i for i in ids if i is not None] + [by_text[t] for t in END_OF_GENERATION if t in by_text]))


@functools.lru_cache(maxsize=1)
def _name_map(layers: int) -> gguf.TensorNameMap:
    return gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, layers)


def _gguf_name(hf_name: str, layers: int = 1) -> str:
    """The llama.cpp name of a Hugging Face tensor name (model.layers.3.mlp.up_proj.weight -> blk.3.ffn_up.weight)."""
    name = _name_map(layers).get_name(hf_name, try_suffixes=(".weight",))
    if name is None:     # every name of config's tensor table has one (tests/test_gguf.py checks)
        raise QwenNPError(f"gguf: no GGUF name for tensor {hf_name!r}")
    return name


def _tensors_by_name(reader: _Reader) -> dict[str, Any]:
    return {tensor.name: tensor for tensor in reader.tensors}


def _held_as_blocks(tensor: Any) -> bool:
    """Whether a quantized tensor is kept as its blocks when the weights are kept as stored: Q8_0 and Q4_0
    (formats.FormatRows) and ggml_blocks.BLOCK_KINDS; the IQ kinds and the rest are dequantized at load."""
    return tensor.tensor_type in BLOCK_FORMATS or tensor.tensor_type.name in BLOCK_KINDS


class GGUFCheckpoint(Checkpoint):
    """A GGUF's tensors under their Hugging Face names, read as Checkpoint reads safetensors.

    F32/F16/BF16 tensors are described by the same TensorInfo (file, dtype, absolute byte span), so
    Checkpoint.mapped / read serve them unchanged. Quantized ones are described as the F32 tensor
    they become, and read/mapped dequantize them (a new FP32 array each call; read's buffer is not
    used for them, since gguf.quants.dequantize allocates its result).
    """

    # A GGUF is never cached: the cache's spot check re-reads every tensor, i.e. dequantizes it again.
    cacheable = False
    held_copies = True      # repacked tensors (REPACK_BUDGET) are copies of the file's blocks
    source_views = True

    def __init__(self, path: str | Path) -> None:   # no super().__init__: that one indexes a folder of safetensors
        self.folder = Path(path).expanduser()
        self.config = read_config(self.folder)
        self._maps = {}
        self._quantized: dict[str, Any] = {}
        self.tensors = self._index()
        self._check_values()
        self.repacked = self._repacked()           # names held as ggml_blocks.RepackedRows

    def _index(self) -> dict[str, TensorInfo]:
        reader = open_reader(self.folder)
        stored = _tensors_by_name(reader)
        tensors = {}
        for name, shape in expected_tensors(self.config).items():
            gguf_name = _gguf_name(name, self.config.num_hidden_layers)
            tensor = stored.get(gguf_name)
            if tensor is None:
                raise QwenNPError(f"{self.folder}: tensor {gguf_name!r} ({name}) is missing")
            numpy_shape = tuple(reversed([int(n) for n in tensor.shape]))      # ggml lists ne[0] first
            if numpy_shape != shape:
                raise QwenNPError(f"{self.folder}: tensor {gguf_name!r} has shape {list(numpy_shape)} (NumPy order) "
                                  f"but the metadata implies {list(shape)}")
            dtype = STORED_TYPES.get(tensor.tensor_type)
            if dtype is None:
                self._quantized[name] = tensor
            tensors[name] = TensorInfo(self.folder, name, dtype or "F32", shape, int(tensor.data_offset),
                                       int(tensor.n_bytes) if dtype else 4 * math.prod(shape))
        # llama.cpp refuses a file with more tensors than its metadata implies; running without them would
        # be running a different network than the file holds.
        used = {_gguf_name(name, self.config.num_hidden_layers) for name in tensors}
        extra = [name for name in stored if name not in used]
        if extra:
            raise QwenNPError(f"{self.folder}: {len(extra)} tensor(s) the metadata does not account for, from "
                              f"{extra[0]!r} (a Qwen3 of this shape has no such tensor)")
        return tensors

    def _check_values(self) -> None:
        """Refuse a tensor with an inf or NaN where its values come from: any block's FP16 scales (every kind's
        d, m and dmin: ggml_blocks.FP16_FIELDS) or an F32/F16/BF16 tensor's values. A start-up forward pass
        reads the embedding rows of its own tokens only, so a bad row of an untied embedding would load and
        serve NaN. Each tensor's pages are let go once checked (release): a view maps them again on use. The
        kinds gguf dequantizes at load are checked once dequantized (_dequantized)."""
        for name, info in self.tensors.items():
            tensor = self._quantized.get(name)
            if tensor is None:
                found = first_not_finite(self._plain_bits(name), info.dtype)
                where = None if found is None else f"row {found[0]}, column {found[1]} is {found[2]}"
            elif tensor.tensor_type.name in FP16_FIELDS:
                bad = first_bad_scale(tensor.tensor_type.name, self._block_bytes(name))
                where = None if bad is None else f"block {bad[2]} of row {bad[1]} has {bad[0]} = {bad[3]}"
            else:
                continue
            self.release(name)
            if where is not None:
                raise self._not_finite(name, where)

    def _plain_bits(self, name: str) -> np.ndarray:
        """An F32/F16/BF16 tensor's values as unsigned integers of their width, [rows, columns] (a 1-D one as one
        row): a view of the mapped file."""
        info = self.tensors[name]
        data = open_reader(self.folder).data[info.start:info.start + info.nbytes]
        return data.view(EXPONENTS[info.dtype][0]).reshape(-1, info.shape[-1])

    def _not_finite(self, name: str, where: str) -> QwenNPError:
        return QwenNPError(f"{self.folder}: tensor {_gguf_name(name, self.config.num_hidden_layers)!r} ({name}) is not "
                           f"finite: {where} (a damaged file: its values would be NaN)")

    def dequantization_note(self) -> str | None:
        """What holding the tensors no weight kind holds (the IQ kinds, ...) as FP32 costs, against their size
        in the file (None: there are none; Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants are held as their
        blocks unless --memory asks for another form)."""
        dequantized = {name: t for name, t in self._quantized.items() if not _held_as_blocks(t)}
        if not dequantized:
            return None
        kinds = "/".join(sorted({tensor.tensor_type.name for tensor in dequantized.values()}))
        fp32 = sum(self.tensors[name].nbytes for name in dequantized)
        stored = sum(int(tensor.n_bytes) for tensor in dequantized.values())
        return (f"{self.folder}: its {kinds} tensors are dequantized to FP32 at load: {fp32 / 2 ** 30:.3f} GiB in "
                f"memory for {stored / 2 ** 30:.3f} GiB in the file")

    def held(self, name: str) -> Weight:
        """Q8_0 and Q4_0 tensors as their blocks (formats.FormatRows: the file's scales and codes as two
        strided views of its memory-mapped blocks), the other block kinds as their blocks' bytes
        (ggml_blocks.BlockRows, a view of the file), those of repacked() with their parts taken apart
        (ggml_blocks.RepackedRows, the file's pages then let go); the rest as Checkpoint holds them (IQ
        kinds dequantized to FP32)."""
        if name in self.repacked:
            tensor = self._quantized[name]
            repacked = RepackedRows.from_blocks(tensor.tensor_type.name, self._block_bytes(name))
            self.release(name)
            return repacked
        blocks = self._blocks(name)
        return super().held(name) if blocks is None else blocks

    def release(self, name: str) -> None:
        """Let go of the file's pages of tensor `name` once it has been copied out of them (_Reader.release):
        repacked, dequantized, or requantized by the loader (--memory int8, q8_0, q4_0)."""
        tensor, info = self._quantized.get(name), self.tensors[name]
        start, nbytes = (info.start, info.nbytes) if tensor is None else (int(tensor.data_offset), int(tensor.n_bytes))
        open_reader(self.folder).release(start, nbytes)

    def source(self, name: str, buffer: np.ndarray | None) -> Weight:
        """A converting mode (int8, q8_0, q4_0) quantizes a GGUF's tensors as stored (views of the file gguf's
        reader maps anyway; its blocks widened a block of rows at a time): no FP32 copy, and no buffer."""
        return self.as_stored(name)

    def as_stored(self, name: str) -> Weight:
        """Tensor `name` as the file stores it, views of its mapped bytes: quantized ones as their blocks
        (FormatRows, BlockRows: never repacked), the rest as Checkpoint holds them."""
        blocks = self._blocks(name)
        return super().held(name) if blocks is None else blocks

    def _repacked(self) -> frozenset[str]:
        """The tensors held repacked (ggml_blocks.REPACKINGS), the cheapest in extra bytes per byte first,
        while together they add at most REPACK_BUDGET to the bytes the file's tensors hold. An untied
        model's token embedding is not: only the prompt's rows of it are ever read."""
        budget = REPACK_BUDGET * sum(int(t.n_bytes) for t in _tensors_by_name(open_reader(self.folder)).values())
        lookup_only = set() if self.config.tie_word_embeddings else {MODEL_TENSORS["embed_tokens"].name}
        candidates = [(self._held_bytes(name, repacked=True) / int(tensor.n_bytes), name)
                      for name, tensor in self._quantized.items()
                      if repackable(tensor.tensor_type.name, self.tensors[name].shape[-1]) and name not in lookup_only]
        chosen = []
        for _, name in sorted(candidates):
            extra = self._held_bytes(name, repacked=True) - int(self._quantized[name].n_bytes)
            if extra <= budget:
                budget -= extra
                chosen.append(name)
        return frozenset(chosen)

    def _held_bytes(self, name: str, repacked: bool) -> int:
        """The bytes tensor `name` takes held as stored: the file's bytes as blocks; repacked, what
        ggml_blocks.Repacking.held_bytes counts; 4 a value dequantized to FP32."""
        tensor = self._quantized.get(name)
        if tensor is None or not _held_as_blocks(tensor):
            return self.tensors[name].nbytes
        if not repacked:
            return int(tensor.n_bytes)
        return REPACKINGS[tensor.tensor_type.name].held_bytes(math.prod(self.tensors[name].shape))

    def _block_bytes(self, name: str) -> np.ndarray:
        """A quantized tensor's blocks, [out, in/QK, bytes] uint8: a view of the mapped file."""
        tensor = self._quantized[name]
        rows, columns = self.tensors[name].shape
        block_values, _ = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
        return np.asarray(tensor.data, dtype=np.uint8).reshape(rows, columns // block_values, -1)

    def _blocks(self, name: str) -> Weight | None:
        """A quantized tensor held as blocks (FormatRows or BlockRows, views of the file), else None."""
        tensor = self._quantized.get(name)
        if tensor is None or not _held_as_blocks(tensor):
            return None
        blocks, columns = self._block_bytes(name), self.tensors[name].shape[1]          # [out, in/QK, bytes]
        fmt = BLOCK_FORMATS.get(tensor.tensor_type)
        if fmt is None:
            return BlockRows(tensor.tensor_type.name, blocks)
        scales = blocks[..., :2].view(np.float16)[..., 0]                                  # [out, in/32] FP16
        # Views of the mapped file, never copies: a copy of the codes would sit in memory beside the file's
        # pages, which the scales keep mapped (Qwen3-32B in Q4_0: 16 GiB of codes next to an 18 GiB file).
        codes = blocks[..., 2:]                                # [out, in/32, 32 | 16]: q8_0 int8, q4_0 nibbles
        return FormatRows(fmt, (codes.view(np.int8) if fmt == "q8_0" else codes, scales), columns)

    def file_summary(self) -> dict[str, Any]:
        """The file as `inspect` describes it, plain data: its path and size, its tensors' count and bytes per ggml
        kind (the most bytes first), their bytes in all, and the bytes they take held as stored (held_bytes_per_value:
        the repacked kinds' parts, the kinds dequantized to FP32)."""
        kinds: dict[str, dict[str, int]] = {}
        for name, info in self.tensors.items():
            tensor = self._quantized.get(name)
            kind = kinds.setdefault(info.dtype if tensor is None else tensor.tensor_type.name, {"tensors": 0, "bytes": 0})
            kind["tensors"] += 1
            kind["bytes"] += info.nbytes if tensor is None else int(tensor.n_bytes)
        values = sum(math.prod(info.shape) for info in self.tensors.values())
        return {"path": str(self.folder), "file_bytes": self.folder.stat().st_size,
                "kinds": dict(sorted(kinds.items(), key=lambda item: -item[1]["bytes"])),
                "tensor_bytes": sum(kind["bytes"] for kind in kinds.values()),
                "held_bytes": round(self.held_bytes_per_value() * values)}

    def held_bytes_per_value(self) -> float:
        """As held "as stored": the file's bytes for F32/F16/BF16 and the tensors held as their blocks, the
        repacked ones' parts, 4 a value for the tensors dequantized to FP32 (_held_bytes)."""
        values = sum(math.prod(info.shape) for info in self.tensors.values())
        return sum(self._held_bytes(name, name in self.repacked) for name in self.tensors) / values

    def mapped(self, name: str) -> np.ndarray:
        return self._dequantized(name) if name in self._quantized else super().mapped(name)

    def read(self, name: str, buffer: np.ndarray | None = None) -> np.ndarray:
        return self._dequantized(name) if name in self._quantized else super().read(name, buffer)

    def _dequantized(self, name: str) -> np.ndarray:
        """A quantized tensor in FP32: its blocks widened (the same bits as gguf.quants.dequantize, ~50x
        faster) where it is held as blocks, else gguf's dequantizer."""
        tensor = self._quantized[name]
        blocks = self._blocks(name)
        if blocks is not None:
            values = upcast(blocks)
            self.release(name)           # the copy replaces the file's pages
            return values
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise QwenNPError(f"{self.folder}: tensor {tensor.name!r} is {tensor.tensor_type.name}, which "
                              "gguf.quants cannot dequantize") from None
        shape = self.tensors[name].shape
        values = values.astype(np.float32, copy=False).reshape(shape)
        found = first_not_finite(values.view(np.uint32).reshape(-1, shape[-1]), "F32")
        if found is not None:                   # a kind _check_values cannot read the scales of
            raise self._not_finite(name, f"row {found[0]}, column {found[1]} dequantizes to {found[2]}")
        return values


def read_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer and chat template of a GGUF, giving the same ids as the Hugging Face tokenizer it came from.

    `tokenizer.huggingface.json` (the whole tokenizer.json, written by export for tokenizers that are not
    Qwen2's) is used as is when present; otherwise the byte-level BPE is rebuilt from tokenizer.ggml.*
    the way transformers' GGUF loader does (CONTROL tokens special, USER_DEFINED ones plain added tokens),
    with Qwen2's pre-tokenizer.
    """
    reader = open_reader(path)
    source = reader.path
    tokens = _get(reader, Keys.Tokenizer.LIST, list)
    embedded = _get(reader, Keys.Tokenizer.HF_JSON, str, None)
    if embedded is not None:
        try:
            backend = tokenizers.Tokenizer.from_str(embedded)
        except Exception as bad:                # the binding raises plain Exception for JSON and schema errors
            raise QwenNPError(f"{source}: metadata key {Keys.Tokenizer.HF_JSON!r} is not a tokenizer.json "
                              f"tokenizers can read ({_first_line(bad)})") from None
    else:
        model = _get(reader, Keys.Tokenizer.MODEL, str)
        pre = _get(reader, Keys.Tokenizer.PRE, str, None)
        if model != "gpt2" or pre != QWEN2_PRE:
            raise QwenNPError(f"{source}: tokenizer.ggml.model {model!r} with tokenizer.ggml.pre {pre!r} is not "
                              f"supported (qwen_np rebuilds only Qwen2's byte-level BPE: 'gpt2' with {QWEN2_PRE!r})")
        types = _get(reader, Keys.Tokenizer.TOKEN_TYPE, list)
        if len(types) != len(tokens):
            raise QwenNPError(f"{source}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
        backend = _qwen2_backend(source, tokens, types, _get(reader, Keys.Tokenizer.MERGES, list))
    names = {"bos_token": Keys.Tokenizer.BOS_ID, "eos_token": Keys.Tokenizer.EOS_ID, "pad_token": Keys.Tokenizer.PAD_ID}
    special = {name: tokens[token_id] for name, key in names.items()
               if (token_id := _token_id(reader, key, tokens)) is not None}
    try:
        return Tokenizer(backend, special, _get(reader, Keys.Tokenizer.CHAT_TEMPLATE, str, None))
    except jinja2.TemplateSyntaxError as bad:
        raise QwenNPError(f"{source}: metadata key {Keys.Tokenizer.CHAT_TEMPLATE!r} does not compile as a chat "
                          f"template (line {bad.lineno}: {bad.message})") from None


def _first_line(error: Exception) -> str:
    """An exception's message as one line (a library's may span several)."""
    return next(iter(str(error).splitlines()), type(error).__name__)


def _qwen2_backend(source: Path, tokens: list[str], types: list[int], merges: list[str]) -> tokenizers.Tokenizer:
    """Qwen2's tokenizer.json, rebuilt: byte-level BPE, NFC (GGUF has no normalizer key, and Qwen's
    tokenizer.json applies NFC), Qwen2's split regex; CONTROL tokens become special added tokens,
    USER_DEFINED ones plain added tokens (e.g. <think>), UNUSED padding ([PAD151669]...) is left out. A token
    listed twice or a merge of tokens not in the list is refused (the file is damaged, or not Qwen2's BPE)."""
    vocab: dict[str, int] = {}
    for i, (token, kind) in enumerate(zip(tokens, types)):
        if kind != TokenType.UNUSED and vocab.setdefault(token, i) != i:
            raise QwenNPError(f"{source}: {Keys.Tokenizer.LIST} holds {token!r} twice (ids {vocab[token]} and {i})")
    pairs = [(left, right) for left, _, right in (merge.partition(" ") for merge in merges)]
    try:
        bpe = models.BPE(vocab, pairs, dropout=None, unk_token=None, continuing_subword_prefix="",
                         end_of_word_suffix="", fuse_unk=False, byte_fallback=False)
    except Exception as bad:                    # the binding raises plain Exception ("Token `x` out of vocabulary")
        raise QwenNPError(f"{source}: {Keys.Tokenizer.MERGES} does not fit {Keys.Tokenizer.LIST} "
                          f"({_first_line(bad)})") from None
    backend = tokenizers.Tokenizer(bpe)
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    added = {kind: [AddedToken(token, special=kind == TokenType.CONTROL, normalized=False)
                    for token, token_kind in zip(tokens, types) if token_kind == kind]
             for kind in (TokenType.CONTROL, TokenType.USER_DEFINED)}
    backend.add_special_tokens(added[TokenType.CONTROL])
    backend.add_tokens(added[TokenType.USER_DEFINED])
    return backend


def read_sampling(path: str | Path) -> dict[str, Any]:
    """The general.sampling.* defaults as generation_config.json keys (absent keys left out)."""
    reader = open_reader(path)
    keys = {"temperature": Keys.General.SAMPLING_TEMP, "top_k": Keys.General.SAMPLING_TOP_K,
            "top_p": Keys.General.SAMPLING_TOP_P, "min_p": Keys.General.SAMPLING_MIN_P,
            "repetition_penalty": Keys.General.SAMPLING_PENALTY_REPEAT}
    raw = {name: _get(reader, key, (int, float), None) for name, key in keys.items()}
    raw = {name: value if isinstance(value, int) else _f32_decimal(value) for name, value in raw.items() if value is not None}
    if "temperature" in raw:
        raw["do_sample"] = raw["temperature"] > 0
    return raw


# --- Writing -------------------------------------------------------------------------------------

# --type -> (the ggml type of every matrix, llama.cpp's general.file_type). Norm weights (1-D) are always
# F32, as llama.cpp's converter writes them.
FILE_TYPES = dict(zip(GGUF_FILE_TYPES, [(GGML.F32, LlamaFileType.ALL_F32), (GGML.F16, LlamaFileType.MOSTLY_F16),
                                        (GGML.BF16, LlamaFileType.MOSTLY_BF16), (GGML.Q8_0, LlamaFileType.MOSTLY_Q8_0),
                                        (GGML.Q4_0, LlamaFileType.MOSTLY_Q4_0)], strict=True))   # the names: --help's
# The types GGUFWriter takes as NumPy element arrays; it takes every other type as bytes.
PLAIN_NUMPY: dict[GGML, np.dtype] = {GGML.F32: np.dtype(np.float32), GGML.F16: np.dtype(np.float16)}


def write_gguf(path: str | Path, checkpoint: Checkpoint, tokenizer: Tokenizer, sampling: SamplingParams,
               file_type: str = "f16", name: str = "qwen3") -> list[str]:
    """Write the checkpoint as a GGUF llama.cpp loads: metadata, tokenizer, chat template, tensors
    (streamed: one tensor converted at a time). Atomic: written under a temporary name in the same
    folder and renamed at the end, so an error leaves no file at `path`. Returns notes for the user."""
    def encoded(hf: str, gguf_name: str, shape: tuple[int, ...], kind: GGML) -> np.ndarray:
        return _encoded(upcast(checkpoint.read(hf)), kind, gguf_name)

    return write_gguf_tensors(path, checkpoint.config, tokenizer, sampling, encoded, file_type, name)


# (Hugging Face name, GGUF name, NumPy shape, ggml type) -> the tensor's data as GGUFWriter takes it: an
# F32/F16 array of that shape, or for a quantized type the uint8 array of gguf.quants.quant_shape_to_byte_shape.
TensorData = Callable[[str, str, tuple[int, ...], GGML], np.ndarray]


@dataclass(frozen=True)
class Mix:
    """A file type whose matrices differ in type, as llama.cpp's K-quant mixes choose per tensor (Q4_K_M:
    Q4_K, with Q6_K for the output and some layers' attn_v and ffn_down): the general.file_type it
    declares, and each matrix's type by its GGUF name."""

    file_type: LlamaFileType
    matrix_type: Callable[[str], GGML]


def write_gguf_tensors(path: str | Path, config: Qwen3Config, tokenizer: Tokenizer, sampling: SamplingParams,
                       tensor_data: TensorData, file_type: str | Mix = "f16", name: str = "qwen3") -> list[str]:
    """write_gguf with each tensor's data from tensor_data(...), called once per tensor in file order and
    written at once (so the model never has to be in memory: bench/big_models.py writes random blocks).
    file_type: a FILE_TYPES name, or a Mix (bench/gguf_kinds.py's random K-quant files)."""
    path = Path(path)
    if isinstance(file_type, Mix):
        llama_file_type, matrix_type = file_type.file_type, file_type.matrix_type
    else:
        kind, llama_file_type = FILE_TYPES[file_type]
        matrix_type = lambda gguf_name: kind                                          # noqa: E731
    layout = {hf: (gguf_name, shape, _tensor_type(shape, matrix_type(gguf_name)))
              for hf, shape in expected_tensors(config).items()
              for gguf_name in [_gguf_name(hf, config.num_hidden_layers)]}
    notes = [f"{gguf_name} stays F16: its rows ({shape[-1]} values) are not whole {matrix_type(gguf_name).name} blocks"
             for gguf_name, shape, kind in layout.values() if len(shape) == 2 and kind != matrix_type(gguf_name)]
    temporary = path.with_name(f".{path.name}.{os.getpid()}.partial")
    writer = GGUFWriter(temporary, ARCHITECTURE)
    try:
        _add_metadata(writer, config, llama_file_type, name, sampling)
        notes += _add_vocabulary(writer, tokenizer, config)
        for gguf_name, shape, kind in layout.values():
            writer.add_tensor_info(gguf_name, *_stored_layout(shape, kind), raw_dtype=kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for hf, (gguf_name, shape, kind) in layout.items():
            writer.write_tensor_data(tensor_data(hf, gguf_name, shape, kind))
        writer.close()
        os.replace(temporary, path)
    finally:
        writer.close()
        temporary.unlink(missing_ok=True)
    return notes


def _encoded(values: np.ndarray, kind: GGML, name: str) -> np.ndarray:
    """FP32 values in `kind` (gguf.quants.quantize), refusing F16 overflow: a cast past 65504 would write inf."""
    with np.errstate(over="ignore"):
        encoded = gguf.quants.quantize(values, kind)
    if kind == GGML.F16 and not np.isfinite(encoded).all() and np.isfinite(values).all():
        raise QwenNPError(f"export: tensor {name!r} has values beyond F16's largest (65504, it holds "
                          f"{float(np.max(np.abs(values))):.4g}); use --type bf16 or f32")
    return encoded


def _tensor_type(shape: tuple[int, ...], matrix_type: GGML) -> GGML:
    """F32 for 1-D tensors; the asked type for matrices, or F16 where a row is not whole blocks of the
    quantized type (llama.cpp's converter falls back to F16 the same way)."""
    if len(shape) == 1:
        return GGML.F32
    block, _ = gguf.GGML_QUANT_SIZES[matrix_type]
    return matrix_type if shape[-1] % block == 0 else GGML.F16


def _stored_layout(shape: tuple[int, ...], kind: GGML) -> tuple[Sequence[int], np.dtype, int]:
    """(shape, dtype, bytes) as GGUFWriter.add_tensor_info takes them: elements for F32/F16, bytes for the rest."""
    if kind in PLAIN_NUMPY:
        return shape, PLAIN_NUMPY[kind], math.prod(shape) * PLAIN_NUMPY[kind].itemsize
    byte_shape = gguf.quants.quant_shape_to_byte_shape(shape, kind)
    return byte_shape, np.dtype(np.uint8), math.prod(byte_shape)


def _add_metadata(writer: GGUFWriter, config: Qwen3Config, file_type: int, name: str, sampling: SamplingParams) -> None:
    """The keys llama.cpp's convert_hf_to_gguf.py writes for Qwen3 (TextModel.set_gguf_parameters), plus
    the sampling defaults (general.sampling.*, which llama.cpp reads as its defaults)."""
    writer.add_name(name)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_sampling_temp(sampling.temperature)
    writer.add_sampling_top_k(sampling.top_k)
    writer.add_sampling_top_p(sampling.top_p)
    writer.add_sampling_min_p(sampling.min_p)
    writer.add_sampling_penalty_repeat(sampling.repetition_penalty)


def _add_vocabulary(writer: GGUFWriter, tokenizer: Tokenizer, config: Qwen3Config) -> list[str]:
    """tokenizer.ggml.* as llama.cpp's converter writes a byte-level BPE (get_vocab_base): the token list
    padded to the model's vocab_size with [PAD{i}] (UNUSED), merges as "A B", the special ids and the
    chat template. A tokenizer that is not Qwen2's also gets its whole tokenizer.json (returns a note)."""
    spec = json.loads(tokenizer.backend.to_str())
    added = {entry["id"]: entry for entry in spec["added_tokens"]}
    by_id = {i: token for token, i in spec["model"]["vocab"].items()} | {i: e["content"] for i, e in added.items()}
    if max(by_id) >= config.vocab_size:
        raise QwenNPError(f"export: the tokenizer has token id {max(by_id)} but the model only {config.vocab_size} embeddings")
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(config.vocab_size)]
    types = [_token_type(i, by_id, added) for i in range(config.vocab_size)]
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in spec["model"]["merges"]]
    qwen2 = _is_qwen2(spec)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(QWEN2_PRE if qwen2 else "gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for token_id, add in ((_special_id(tokenizer, "bos_token", config.bos_token_id), writer.add_bos_token_id),
                          (_special_id(tokenizer, "eos_token", next(iter(config.eos_token_ids), None)), writer.add_eos_token_id),
                          (_special_id(tokenizer, "pad_token", None), writer.add_pad_token_id)):
        if token_id is not None:
            add(token_id)
    writer.add_add_bos_token(False)              # Qwen3 adds no BOS (tokenizer_config.json: add_bos_token false)
    if tokenizer.chat_template is not None:
        writer.add_chat_template(tokenizer.chat_template)
    if qwen2:
        return []
    writer.add_string(Keys.Tokenizer.HF_JSON, tokenizer.backend.to_str())
    return ["the tokenizer is not Qwen2's: llama.cpp will split text with GPT-2's regex (tokenizer.ggml.pre "
            "'gpt-2'); qwen_np reads the exact tokenizer back from tokenizer.huggingface.json"]


def _token_type(token_id: int, by_id: dict[int, str], added: dict[int, Any]) -> int:
    """NORMAL, UNUSED padding, or for an added token CONTROL when it is special or looks like <|...|>
    (llama.cpp's does_token_look_special), else USER_DEFINED (Qwen3's <think>, <tool_call>)."""
    if token_id not in by_id:
        return TokenType.UNUSED
    if token_id not in added:
        return TokenType.NORMAL
    token = by_id[token_id]
    special = added[token_id]["special"] or token.startswith("<|") and token.endswith("|>")
    return TokenType.CONTROL if special else TokenType.USER_DEFINED


def _special_id(tokenizer: Tokenizer, name: str, fallback: int | None) -> int | None:
    """The id of a named special token, else the config's id (Qwen3 names no bos_token: config.json's
    bos_token_id is used, as llama.cpp's converter does)."""
    token = tokenizer.special_token(name)
    return fallback if token is None else tokenizer.token_to_id(token)


def _is_qwen2(spec: dict[str, Any]) -> bool:
    """Whether tokenizer.json is Qwen2's byte-level BPE: NFC, then Split on QWEN2_PATTERN, then ByteLevel."""
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    return (spec.get("normalizer") == {"type": "NFC"} and len(steps) == 2
            and steps[0].get("pattern") == {"Regex": QWEN2_PATTERN} and steps[1].get("type") == "ByteLevel")
