"""Checkpoint files: the safetensors format, sharded folders, the HF tensor names, and the hub.

A Hugging Face checkpoint folder holds `config.json` and either one `model.safetensors` or several
shards listed by `model.safetensors.index.json` (`weight_map`: tensor name -> shard file).

A safetensors file is: 8 bytes little-endian u64 N | N bytes of JSON header | data buffer.
The header maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]}, offsets
relative to the data buffer. We parse the header ourselves and memory-map the data instead of using
the `safetensors` package: its NumPy API copies every tensor into fresh memory (and needs ml_dtypes
to return BF16 at all), while decoding an 8B model that does not fit in RAM as FP32 has to read the
BF16 bytes straight from the page cache on every token. Measured on this machine for the 1.2 GB BF16
Qwen3-8B embedding (page cache warm): mmap view 0.000 s and +0.00 GB RSS; safetensors.numpy.load_file
(with ml_dtypes) 1.3 s and +1.25 GB RSS.
The validation below follows the Rust reference (safetensors/src/tensor.rs) rule for rule.
Writing (test checkpoints, the bundled model, bench) goes through the safetensors package itself.
Nothing here ever unpickles: `.bin`/`.pt` checkpoints are refused.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import stat
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable, Mapping

import numpy as np

from ..core.defaults import BUNDLED   # `bundled`: the bundled model, wherever a model is taken
from ..core.config import EMBED_TOKENS, LAYER_TENSORS, LM_HEAD, Qwen3Config, expected_tensors
from ..errors import QwenNPError
from ..numbers.numerics import STORAGE_DTYPES, Weight, dtype_named, held

MAX_HEADER_BYTES = 100_000_000        # the Rust reader's MAX_HEADER_SIZE
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Every dtype the safetensors format defines; we can read the float ones in STORAGE_DTYPES.
KNOWN_DTYPES = {"BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2",
                "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64"}
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2,
               "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "C64": 8, "F64": 8,
               "I64": 8, "U64": 8}


LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")      # the i of a decoder layer's tensor name
BARE_PREFIX = "model."       # what Qwen3ForCausalLM's names add to a bare Qwen3Model's


# --- Reading safetensors -------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: its file, dtype, shape and byte span in the file."""

    path: Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int          # absolute byte offset in the file
    nbytes: int


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate one safetensors header; raises QwenNPError naming the file and tensor."""
    size = _file_size(path)
    if size < 8:
        raise QwenNPError(f"{path}: truncated safetensors file ({size} bytes; the 8-byte header length is missing)")
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > MAX_HEADER_BYTES:
            raise QwenNPError(f"{path}: header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit")
        if 8 + header_len > size:
            raise QwenNPError(f"{path}: header length {header_len} runs past the end of the {size}-byte file (truncated?)")
        raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as bad:     # RecursionError: [[[[...
        raise QwenNPError(f"{path}: header is not valid UTF-8 JSON ({bad})") from None
    if not isinstance(header, dict):
        raise QwenNPError(f"{path}: header is not a JSON object")
    header.pop("__metadata__", None)
    data_start, data_len = 8 + header_len, size - 8 - header_len
    infos = {name: _tensor_info(path, name, entry, data_start) for name, entry in header.items()}
    _check_spans(path, infos, data_start, data_len)
    return infos


def _tensor_info(path: Path, name: str, entry: object, data_start: int) -> TensorInfo:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise QwenNPError(f"{where}: entry must have dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in KNOWN_DTYPES:
        raise QwenNPError(f"{where}: unknown dtype {dtype!r}")
    if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
        raise QwenNPError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(n, int) for n in offsets)):
        raise QwenNPError(f"{where}: data_offsets must be [begin, end], got {offsets!r}")
    begin, end = offsets
    if begin < 0 or end < begin:
        raise QwenNPError(f"{where}: invalid data_offsets {offsets} (negative or end before begin)")
    if dtype in DTYPE_BYTES:   # sub-byte float types (F4, F6) have no whole-byte span rule we can read
        expected = math.prod(shape) * DTYPE_BYTES[dtype]
        if end - begin != expected:
            raise QwenNPError(f"{where}: byte span {end - begin} != prod(shape {shape}) x {DTYPE_BYTES[dtype]} = {expected}")
    return TensorInfo(path, name, dtype, tuple(shape), data_start + begin, end - begin)


def _check_spans(path: Path, infos: dict[str, TensorInfo], data_start: int, data_len: int) -> None:
    """Tensors must tile the data buffer exactly: no gap, no overlap, nothing past the end."""
    expected_begin = 0
    for info in sorted(infos.values(), key=lambda t: (t.start, t.nbytes)):
        begin = info.start - data_start
        if begin + info.nbytes > data_len:
            raise QwenNPError(f"{path}: tensor {info.name!r} data_offsets [{begin}, {begin + info.nbytes}] "
                              f"run past the {data_len}-byte data buffer (truncated file?)")
        if begin != expected_begin:
            problem = "overlaps the previous tensor" if begin < expected_begin else "leaves a gap before it"
            raise QwenNPError(f"{path}: tensor {info.name!r} at offset {begin} {problem} (expected {expected_begin})")
        expected_begin = begin + info.nbytes
    if expected_begin != data_len:
        raise QwenNPError(f"{path}: tensors cover {expected_begin} bytes but the data buffer holds {data_len}")


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        raise QwenNPError(f"{path}: file not found") from None


class Checkpoint:
    """A checkpoint folder's tensors, validated, read lazily from memory-mapped files.

    What the loader (engine/loading.py) asks of any checkpoint, so that it never asks which kind it holds
    (GGUFCheckpoint answers the same questions for a GGUF file): `cacheable`, `held_copies`,
    `source_views`, `source` and `release`, beside `held`, `read` and `held_bytes_per_value`.
    """

    # Whether the FP32 weight cache (engine/weight_cache.py) may keep this checkpoint's tensors.
    cacheable = True
    # Whether held() copies each tensor (a GGUF's repacked blocks) rather than returning a view of the file:
    # the loader then holds a layer's tensors on every core, their fresh pages faulting in at once.
    held_copies = False
    # Whether source() gives views of the mapped file (a GGUF's blocks) rather than reads into a buffer.
    source_views = False

    def __init__(self, folder: str | Path, config: Qwen3Config) -> None:
        self.folder = Path(folder)
        self.config = config
        self.tensors, self.bare = with_model_prefix(_index_tensors(self.folder))
        self._maps: dict[Path, mmap.mmap] = {}
        self._check_layer_count()
        self._check_against_config()

    def _check_layer_count(self) -> None:
        """config.json's layers must be the header's, checked before the tensors the config implies are
        listed: a num_hidden_layers of 10^9 would list 11 x 10^9 names (and allocate a cache for them), and
        one below the checkpoint's would run the model without its last layers."""
        layers = self.config.num_hidden_layers
        held = 1 + max((int(match[1]) for name in self.tensors if (match := LAYER_INDEX.match(name))), default=-1)
        where = f"{self.folder / 'config.json'}: num_hidden_layers is {layers} but the checkpoint's tensors hold {held} layers"
        if layers > held:
            raise QwenNPError(f"{where} (tensor {LAYER_TENSORS['input_layernorm'].name.format(i=held)!r} is missing)")
        if layers < held:
            extra = [name for name in self.tensors if (match := LAYER_INDEX.match(name)) and int(match[1]) >= layers]
            raise QwenNPError(f"{where} ({len(extra)} tensors config.json does not account for, from {extra[0]!r})")

    def _check_against_config(self) -> None:
        """Every tensor the config implies, with its shape and a dtype we read, and no other: transformers
        only warns about unused weights, but a model run without some of its file's weights is not the
        model the file holds."""
        expected = expected_tensors(self.config)
        extra = [name for name in self.tensors if name not in expected]
        if extra:
            raise QwenNPError(f"{self.folder}: {len(extra)} tensor(s) config.json does not account for, from "
                              f"{extra[0]!r} (a Qwen3 of this config has no such tensor)")
        for name, shape in expected.items():
            if name == LM_HEAD and self.bare:
                continue                     # a bare Qwen3Model has no head (tied or not): load_model sees that
            info = self.tensors.get(name)
            if info is None:
                raise QwenNPError(f"{self.folder}: tensor {name!r} is missing from the checkpoint")
            if info.shape != shape:
                raise QwenNPError(f"{info.path}: tensor {name!r} has shape {list(info.shape)} but config.json "
                                  f"implies {list(shape)}")
            if info.dtype not in STORAGE_DTYPES:
                raise QwenNPError(f"{info.path}: tensor {name!r} has dtype {info.dtype}; qwen_np reads BF16, F16 and F32")

    def held(self, name: str) -> Weight:
        """A tensor as the "bf16" memory mode holds it, "as stored": its mapped values (numerics.held)."""
        return held(self.mapped(name))

    def source(self, name: str, buffer: np.ndarray | None) -> Weight:
        """Tensor `name` as a mode that converts every weight once (int8, q8_0, q4_0) reads it: its stored
        values read into `buffer` (uint8, reused from tensor to tensor; None: a fresh array)."""
        return self.read(name, buffer)

    def release(self, name: str) -> None:
        """Tensor `name` has been converted into memory the model keeps: nothing to let go for a folder (its
        tensors were read with plain file I/O, never kept mapped)."""

    def held_bytes_per_value(self) -> float:
        """Bytes per weight of the tensors held as stored (the "bf16" plan's): the file's own widths."""
        return sum(info.nbytes for info in self.tensors.values()) / sum(math.prod(i.shape) for i in self.tensors.values())

    def mapped(self, name: str) -> np.ndarray:
        """A zero-copy, read-only view of a tensor's stored values (BF16 as ml_dtypes.bfloat16)."""
        info = self.tensors[name]
        if info.path not in self._maps:
            with open(info.path, "rb") as f:
                self._maps[info.path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        dtype = dtype_named(STORAGE_DTYPES[info.dtype])
        count = info.nbytes // dtype.itemsize
        return np.frombuffer(self._maps[info.path], dtype=dtype, count=count, offset=info.start).reshape(info.shape)

    def read(self, name: str, buffer: np.ndarray | None = None) -> np.ndarray:
        """A private in-memory copy of a tensor's stored values, read with plain file I/O (not kept mapped).

        buffer: bytes (uint8) to read into and return a view of, reused from tensor to tensor.
        """
        info = self.tensors[name]
        dtype = dtype_named(STORAGE_DTYPES[info.dtype])
        with open(info.path, "rb", buffering=0) as f:
            f.seek(info.start)
            if buffer is None:
                return np.fromfile(f, dtype=dtype, count=info.nbytes // dtype.itemsize).reshape(info.shape)
            view, done = buffer.data[:info.nbytes], 0
            while done < info.nbytes and (got := f.readinto(view[done:])):
                done += got
        if done < info.nbytes:
            raise QwenNPError(f"{info.path}: tensor {name!r} ends after {done} of its {info.nbytes} bytes")
        return buffer[:info.nbytes].view(dtype).reshape(info.shape)


def with_model_prefix(tensors: dict[str, TensorInfo]) -> tuple[dict[str, TensorInfo], bool]:
    """The tensors under Qwen3ForCausalLM's names, and whether they were a bare Qwen3Model's. A bare
    Qwen3Model (what Qwen3-Embedding ships, what transformers' Qwen3Model.save_pretrained writes) names
    its tensors without the "model." prefix (embed_tokens.weight, layers.0..., norm.weight) and has no
    lm_head: they get the prefix, as transformers adds it when it loads such a file into a causal LM."""
    bare = EMBED_TOKENS.removeprefix(BARE_PREFIX) in tensors and EMBED_TOKENS not in tensors
    if not bare:
        return tensors, False
    return {BARE_PREFIX + name: replace(info, name=BARE_PREFIX + name) for name, info in tensors.items()}, True


def _index_tensors(folder: Path) -> dict[str, TensorInfo]:
    """name -> TensorInfo across the single file or every shard named by the index."""
    index_path, single_path = folder / INDEX_FILE, folder / SINGLE_FILE
    if index_path.exists():
        return _sharded_tensors(index_path)
    if single_path.exists():
        return read_header(single_path)
    pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
    if pickles:
        raise QwenNPError(f"{folder}: only safetensors checkpoints are read (found {pickles[0]}; pickled "
                          "weights can run arbitrary code and are never loaded)")
    raise QwenNPError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE} found")


def _sharded_tensors(index_path: Path) -> dict[str, TensorInfo]:
    try:
        weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, KeyError, TypeError) as bad:
        raise QwenNPError(f"{index_path}: not a valid safetensors index ({bad!r})") from None
    tensors: dict[str, TensorInfo] = {}
    headers: dict[str, dict[str, TensorInfo]] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise QwenNPError(f"{index_path}: weight_map entry for {name!r} must be a file name, got {shard!r}")
        shard_path = index_path.parent / shard
        if shard not in headers:
            if not shard_path.is_file():
                raise QwenNPError(f"{index_path}: shard {shard!r} (holding {name!r}) does not exist")
            headers[shard] = read_header(shard_path)
        if name not in headers[shard]:
            raise QwenNPError(f"{shard_path}: tensor {name!r} is listed in {INDEX_FILE} but not in this shard")
        tensors[name] = headers[shard][name]
    return tensors


# --- Writing safetensors (test checkpoints, benchmarks, the bundled model) -----------------------

def save_safetensors(path: str | Path, tensors: Mapping[str, np.ndarray], dtype: str = "BF16") -> None:
    """Write arrays as one safetensors file in `dtype`, through the safetensors package's own writer.

    FP32 values are rounded to `dtype` (a STORAGE_DTYPES name; BF16: to nearest even); arrays already in it are
    written as they are.
    """
    from safetensors.numpy import save_file   # runtime dependency, imported where used

    target = dtype_named(STORAGE_DTYPES[dtype])
    stored = {name: np.ascontiguousarray(value if value.dtype == target else value.astype(np.float32).astype(target))
              for name, value in ((name, np.asarray(value)) for name, value in tensors.items())}
    write_atomically(path, lambda tmp: save_file(stored, tmp, metadata={"format": "pt"}))


def write_atomically(path: str | Path, write: Callable[[Path], None]) -> None:
    """write(a temporary file in the same folder), then give it the name `path` as safetensors' and
    huggingface_hub's atomic writers do: the file's bytes fsynced to the disk first, then os.replace
    (atomic: a reader sees the previous file or the new one), then the folder fsynced, so the rename
    itself is on the disk too. Without the first fsync a power loss can leave the new name on an empty
    or partly written file (the rename reaches the disk before the data). A crash, a full disk or a
    power loss leaves the previous file or the new one, never half of one. A failed write (the
    safetensors writer reports a full disk as its own error, not an OSError) is a QwenNPError naming
    the file. The file gets the mode a file created here gets (0666 less the umask, as the JSON files beside
    it): the safetensors writer makes its files 0600, which another account or a container cannot read."""
    from safetensors import SafetensorError

    path = Path(path)
    tmp = path.with_name(f"{path.name}.partial")
    try:
        mode = _created_mode(tmp)
        write(tmp)                                  # the writer has closed the file: its bytes are flushed
        os.chmod(tmp, mode)
        _fsync(tmp)
        os.replace(tmp, path)
    except (OSError, SafetensorError) as bad:
        tmp.unlink(missing_ok=True)
        raise QwenNPError(f"{path}: could not be written ({_reason(bad)}); the file it was to replace is left as "
                          "it was") from None
    try:
        _fsync(path.parent)
    except OSError as bad:
        raise QwenNPError(f"{path}: written, but its folder could not be synced to the disk ({_reason(bad)})") from None


def _created_mode(path: Path) -> int:
    """The permission bits open() gives a new file at `path` (0666 less the process's umask, less what a
    default ACL takes away), found by creating it: reading the umask means setting it, for every thread at
    once. A leftover at `path` is removed first, so that its mode is not taken for the new file's."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        return stat.S_IMODE(os.fstat(fd).st_mode)
    finally:
        os.close(fd)


def _fsync(path: Path) -> None:
    """Wait until the file's (or the folder's) data is on the disk, through a descriptor of its own: fsync
    writes out every dirty page of the file, whichever descriptor wrote it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _reason(bad: Exception) -> str:
    return bad.strerror if isinstance(bad, OSError) and bad.strerror else str(bad)


def save_checkpoint(folder: str | Path, config_json: Mapping[str, object],
                    shards: Iterable[Mapping[str, np.ndarray]], dtype: str = "BF16") -> Path:
    """Write config.json and the given shards (one shard -> model.safetensors, more -> with an index)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shard_list = list(shards)
    weight_map, total = {}, 0
    for number, tensors in enumerate(shard_list, start=1):
        name = SINGLE_FILE if len(shard_list) == 1 else f"model-{number:05d}-of-{len(shard_list):05d}.safetensors"
        save_safetensors(folder / name, tensors, dtype)
        weight_map.update({tensor: name for tensor in tensors})
        total += sum(t.size for t in tensors.values()) * DTYPE_BYTES[dtype]
    if len(shard_list) > 1:
        write_index(folder, weight_map, total)
    (folder / "config.json").write_text(json.dumps(dict(config_json), indent=2, sort_keys=True))
    return folder


def write_index(folder: Path, weight_map: Mapping[str, str], total_size: int) -> None:
    """model.safetensors.index.json: tensor name -> shard file, and the total bytes of all tensors."""
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2))


# --- Local folder or hub id ----------------------------------------------------------------------

HUB_FILE_PATTERNS = ["*.safetensors", "*.json", "tokenizer*", "vocab.json", "merges.txt", "*.jinja"]


# A hub id as the hub spells one (huggingface_hub's validate_repo_id, with the owner required): a string that
# is not one and names nothing on disk is a missing path, said so, not looked up on the hub.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
GGUF_MAGIC = b"GGUF"              # the first 4 bytes of a GGUF file (gguf_reader.py reads the rest)


def is_gguf(path: str | Path) -> bool:
    """A file that starts with the GGUF magic (Ollama's blobs have no .gguf suffix)."""
    path = Path(path).expanduser()
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def resolve_model_path(model: str | Path, param: str = "model") -> Path:
    """A local checkpoint folder or GGUF file, the bundled model (BUNDLED, from any folder), or a hub id
    ('Qwen/Qwen3-8B') fetched into the HF cache; `param` names the caller's parameter it came from in the
    error (QwenNPError.param). The one place that says what a model argument means."""
    if str(model) == BUNDLED:
        return bundled_model(param)
    path = Path(model).expanduser()
    if path.is_dir() or is_gguf(path):
        return path
    text = str(model)
    if path.exists():
        raise QwenNPError(f"{text!r} is a file but not a GGUF file (a model is a checkpoint folder, a GGUF file "
                          "or a hub id like 'Qwen/Qwen3-8B')", param)
    if not HUB_ID.fullmatch(text):         # OWNER/NAME and nothing else: any other string is a path
        raise QwenNPError(f"{text!r} does not exist (a model is a checkpoint folder, a GGUF file or a hub id "
                          "like 'Qwen/Qwen3-8B')", param)
    return download(text)


def bundled_model(param: str = "model") -> Path:
    """The bundled model's folder, checked to be there (a wheel built without weights/ has none)."""
    folder = bundled_model_path()
    if not (folder / "config.json").is_file():
        raise QwenNPError(f"the bundled model is not at {folder} (reinstall qwen_np, or pass a hub id like "
                          "Qwen/Qwen3-0.6B or a checkpoint folder)", param)
    return folder


def bundled_model_path() -> Path:
    """The folder of the bundled model: inside the package where a wheel installed it (qwen_np/weights,
    pyproject.toml maps the top-level weights/ there), else the top-level weights/ of the source
    checkout this package runs from (an editable install, or `python -m qwen_np` in the repository).

    A plain path, not an importlib.resources Traversable: the weights are memory-mapped, which needs a
    real file, and pip always unpacks a wheel to files.
    """
    package = Path(__file__).resolve().parents[1]          # qwen_np/, above files/
    installed = package / "weights"
    return installed if (installed / "config.json").is_file() else package.parent / "weights"


def download(repo_id: str) -> Path:
    """Fetch safetensors, json and tokenizer files of a hub repo (cached; honours HF_HUB_OFFLINE)."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.utils import HfHubHTTPError, LocalEntryNotFoundError   # also in older releases
    except ImportError:  # pragma: no cover - huggingface_hub is a runtime dependency
        raise QwenNPError("hub ids need the huggingface_hub package (pip install huggingface_hub)", "model") from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILE_PATTERNS))
    except LocalEntryNotFoundError:
        raise QwenNPError(f"hub id {repo_id!r}: not in the Hugging Face cache and the hub cannot be reached; "
                          f"run `python -m qwen_np download {repo_id}` with network access, or pass a local folder") from None
    except (HfHubHTTPError, OSError, ValueError) as bad:
        first_line = str(bad).strip().splitlines()[0] if str(bad).strip() else type(bad).__name__
        raise QwenNPError(f"hub id {repo_id!r}: could not fetch it from the hub ({first_line})") from None
