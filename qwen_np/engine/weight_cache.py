"""The FP32 weight cache: a checkpoint's weights upcast to FP32 once, written to a file in the user's
cache folder, and memory-mapped on every later `fp32` load.

Holding weights in FP32 means 4 bytes per parameter in memory. Converting them into fresh anonymous
memory on every load costs seconds when the page cache fills RAM (right after a download): the kernel
reclaims a page for each of the 600,000 pages of Qwen3-0.6B. A mapped file costs nothing of the sort
while its pages are in the page cache: the model's arrays are those pages. This is llama.cpp's
design (it memory-maps its GGUF). Measurements: bench/README.md.

Where: $QWEN_NP_CACHE, else $XDG_CACHE_HOME/qwen_np, else ~/.cache/qwen_np; QWEN_NP_CACHE=off turns
the cache off (fp32 loads then convert into memory as before). Never inside the checkpoint folder.
One folder per checkpoint folder (named after it and a hash of its resolved path) holds:

    fp32-<identity>.safetensors   the cache: every tensor as F32, in config.expected_tensors order
    fp32panels-<identity>.safetensors   the same for load_model's "auto" in a fast model: matrices
                                  as numerics.Panels' values [out/P, in, P] (each layout its own file)
    lock                          held (flock) while a process builds, so two builders never race
    *.tmp                         a file being written; renamed to its real name only when complete

The identity hashes what the values derive from: the resolved folder, each source file's name, size
and modification time, and this module's FORMAT_VERSION. A changed checkpoint therefore has a new
identity (the old cache file is stale: never opened, deleted on the next build). A cache file that
does not open as exactly the expected F32 tensors, or whose spot-checked values (both ends of every
tensor) differ from the source's, is damaged: rebuilt, never used. Values in between are not
checked (hashing 2.4 GB would cost the load it saves); the file is fsynced before it gets its name,
so only the disk itself could change them.

The file is a valid safetensors file (read back with checkpoint.read_header, which validates every
span), its data starting on a page boundary. Tensors keep the table's order, so a layer's q, k, v
and its gate, up lie back to back and the fast path multiplies them as one matrix each (fast._joined).
The mapping is copy-on-write (MAP_PRIVATE): writing to a loaded weight changes this process's copy
of that page, never the file. The weights are page-cache pages, clean ones: when RAM runs short the
kernel may drop them and read them back from the file when next used (anonymous weights, with no
swap, cannot be dropped), so a starved machine decodes at disk speed rather than killing the process.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import mmap
import os
import re
import secrets
import shutil
import struct
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

import numpy as np

from ..files.checkpoint import Checkpoint, read_header
from ..core.config import expected_tensors
from ..errors import QwenNPError
from ..numbers.numerics import panel_shape, panels, upcast
from .runtime import usable_cores

CACHE_ENV = "QWEN_NP_CACHE"
OFF = ("off", "0", "false", "no", "none")     # QWEN_NP_CACHE values that turn the cache off
FORMAT_VERSION = 1            # bump when the file's layout or the conversion changes
# Smaller models are converted in memory and never written to the user's cache folder: toy and test
# models (the bundled one is 39 MB in FP32 and converts in about 0.1 s), where every real Qwen3 is
# far above it (Qwen3-0.6B: 2.4 GB). Tests lower it to exercise the cache on tiny checkpoints.
MIN_BYTES = 256 * 1024 ** 2
ALIGN = mmap.PAGESIZE         # the data starts on a page boundary (safetensors allows header padding)
CHUNK_VALUES = 4 * 1024 ** 2  # values upcast per write while building (a 16 MiB FP32 scratch)
SPOT_VALUES = 16              # values compared with the source at each end of every tensor
FREE_MARGIN = 1024 ** 3       # never fill the cache's disk closer than this
PREFIX = {"rows": "fp32", "panels": "fp32panels"}   # the cache file's name by layout (load_fp32)


def cache_root() -> Path | None:
    """The cache folder, or None when QWEN_NP_CACHE turns the cache off."""
    value = os.environ.get(CACHE_ENV, "").strip()
    if value.lower() in OFF:
        return None
    if value:
        return Path(value).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qwen_np"


def cache_file(checkpoint: Checkpoint, layout: str = "rows") -> Path | None:
    """Where this checkpoint's FP32 cache in `layout` lives (it may not exist yet); None when the cache is off."""
    root = cache_root()
    if root is None:
        return None
    source = checkpoint.folder.resolve()
    name = source.parent.parent.name if source.parent.name == "snapshots" else source.name   # hub: models--Qwen--Qwen3-0.6B
    return root / f"{name}-{_digest(str(source))}" / f"{PREFIX[layout]}-{_digest(json.dumps(_identity(checkpoint)))}.safetensors"


def load_fp32(checkpoint: Checkpoint, layout: str = "rows") -> dict[str, np.ndarray] | None:
    """Every tensor of the checkpoint as FP32, name -> a copy-on-write view of the cache file mapped
    in memory, building the file first when it is missing, stale or damaged. layout "panels": every
    matrix whose rows split into whole panels is numerics.Panels' values [out/P, in, P] (a file of its
    own beside the "rows" one, which holds every tensor in the checkpoint's shape).

    None when the cache is off, the model is below MIN_BYTES, or the cache folder cannot hold the
    file (unwritable, disk full): the caller then converts into memory. Each such case, and each
    build, is one line on stderr.
    """
    # Every tensor the config implies that the checkpoint holds (a headless one, Qwen3-Embedding, has no lm_head).
    shapes = {name: (panel_shape(shape) if layout == "panels" else None) or shape
              for name, shape in expected_tensors(checkpoint.config).items() if name in checkpoint.tensors}
    nbytes = 4 * sum(math.prod(shape) for shape in shapes.values())
    path = cache_file(checkpoint, layout)
    if path is None or nbytes < MIN_BYTES:
        return None
    weights = _open(path, checkpoint, shapes, quiet=True)
    if weights is not None:
        return weights
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.parent / "lock", "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:                 # another process is building it: wait, then use its file
                _note(f"waiting for another process to finish writing {path}")
                fcntl.flock(lock, fcntl.LOCK_EX)
            weights = _open(path, checkpoint, shapes, quiet=False)
            if weights is None:
                _build(path, checkpoint, shapes, nbytes)
                weights = _open(path, checkpoint, shapes, quiet=False)
    except OSError as error:
        _note(f"FP32 weight cache unavailable ({error}); converting in memory instead")
        return None
    return weights


def _identity(checkpoint: Checkpoint) -> dict[str, object]:
    """What the cached values derive from: the folder, its files (name, size, mtime) and the format."""
    files = sorted({info.path for info in checkpoint.tensors.values()})
    index = checkpoint.folder / "model.safetensors.index.json"
    stats = [(p.name, (s := p.stat()).st_size, s.st_mtime_ns) for p in files + ([index] if index.exists() else [])]
    return {"format": FORMAT_VERSION, "folder": str(checkpoint.folder.resolve()), "files": stats}


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _open(path: Path, checkpoint: Checkpoint, shapes: dict[str, tuple[int, ...]],
          quiet: bool) -> dict[str, np.ndarray] | None:
    """The cache file mapped copy-on-write as name -> FP32 array, its pages faulted in; None when it
    is missing or damaged (damage is reported unless quiet: the caller rebuilds under the lock)."""
    if not path.exists():
        return None
    try:
        infos = read_header(path)
        start = min(info.start for info in infos.values())
        expected, offset = {}, start
        for name, shape in shapes.items():
            expected[name] = ("F32", shape, offset)
            offset += 4 * math.prod(shape)
        if {name: (i.dtype, i.shape, i.start) for name, i in infos.items()} != expected:
            raise QwenNPError(f"{path}: holds other tensors than the checkpoint's, or in another order")
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except (QwenNPError, OSError, ValueError) as error:
        if not quiet:
            _note(f"FP32 weight cache damaged, rebuilding it ({error})")
        return None
    flat = np.frombuffer(mapped, np.float32, count=(offset - start) // 4, offset=start)
    weights, begin = {}, 0
    for name, shape in shapes.items():
        weights[name] = flat[begin:begin + math.prod(shape)].reshape(shape)
        begin += math.prod(shape)
    if not all(_agrees(weights[name], checkpoint.mapped(name)) for name in shapes):
        if not quiet:
            _note(f"FP32 weight cache damaged, rebuilding it ({path}: values differ from the checkpoint's)")
        return None
    _fault_in(mapped)
    return weights


def _agrees(cached: np.ndarray, stored: np.ndarray) -> bool:
    """The first and last SPOT_VALUES of a tensor (of its first and last row for a matrix) equal the
    stored ones upcast (NaN equal to NaN); `cached` may be a matrix's Panels values."""
    return all(np.array_equal(mine, upcast(theirs), equal_nan=True) for mine, theirs in zip(_ends(cached), _ends(stored)))


def _ends(tensor: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The first SPOT_VALUES of a tensor and its last: of its first and last row for a matrix, read from
    Panels' values [out/P, in, P] where panel 0's column 0 is row 0."""
    if tensor.ndim == 3:
        return tensor[0, :SPOT_VALUES, 0], tensor[-1, -SPOT_VALUES:, -1]
    rows = tensor.reshape(-1, tensor.shape[-1]) if tensor.ndim else tensor.reshape(1, 1)
    return rows[0, :SPOT_VALUES], rows[-1, -SPOT_VALUES:]


def _fault_in(mapped: mmap.mmap) -> None:
    """Map every page of the file into this process now, reading one byte per page from one thread
    per core, rather than one fault at a time during the first token. Reads never break copy-on-write."""
    first_bytes = np.frombuffer(mapped, np.uint8)[::mmap.PAGESIZE]
    workers = usable_cores()
    bounds = np.linspace(0, len(first_bytes), workers + 1).astype(int).tolist()
    with ThreadPoolExecutor(workers) as pool:     # NumPy releases the GIL while it reads
        list(pool.map(lambda lo, hi: int(first_bytes[lo:hi].max(initial=0)), bounds[:-1], bounds[1:]))


def _build(path: Path, checkpoint: Checkpoint, shapes: dict[str, tuple[int, ...]], nbytes: int) -> None:
    """Write the cache file under a temporary name, then rename it: a crash leaves no half cache under
    the real name. Called with the folder's lock held, so every *.tmp there is a dead builder's leftover."""
    folder = path.parent
    for leftover in folder.glob("*.tmp"):
        leftover.unlink(missing_ok=True)
    free = shutil.disk_usage(folder).free
    if free < nbytes + FREE_MARGIN:
        raise OSError(f"{folder} has {free / 1024 ** 3:.1f} GiB free; the cache needs {nbytes / 1024 ** 3:.2f} GiB "
                      f"and {FREE_MARGIN / 1024 ** 3:.0f} GiB to spare")
    _note(f"converting {checkpoint.folder} to FP32 once: writing {nbytes / 1024 ** 3:.2f} GiB to {path} "
          f"(later loads map it; {CACHE_ENV}=off turns this off)")
    temporary = folder / f"{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
    try:
        with open(temporary, "wb") as f:
            _write(f, checkpoint, shapes, nbytes)
            f.flush()
            os.fsync(f.fileno())      # the data is on disk before the name says it is complete
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    prefix = path.name.rsplit("-", 1)[0]
    for stale in folder.glob(f"{prefix}-*.safetensors"):   # this layout's caches of earlier versions of the checkpoint
        if stale != path and re.fullmatch(rf"{prefix}-[0-9a-f]{{16}}\.safetensors", stale.name):
            stale.unlink(missing_ok=True)


def _write(f: BinaryIO, checkpoint: Checkpoint, shapes: dict[str, tuple[int, ...]], nbytes: int) -> None:
    """A safetensors file of F32 tensors in `shapes` order, streamed: a chunk at a time is upcast into
    a reused scratch and written, so building never holds the model in memory.

    Written by hand: the safetensors package's writer takes every tensor in memory at once and orders
    them by name (k_proj before q_proj), which would split the fused q|k|v layout this file exists for.
    """
    from tqdm import tqdm      # runtime dependency, imported where used

    header: dict[str, object] = {"__metadata__": {"format": f"qwen_np fp32 cache v{FORMAT_VERSION}",
                                                  "source": str(checkpoint.folder.resolve())}}
    offset = 0
    for name, shape in shapes.items():
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + 4 * math.prod(shape)]}
        offset += 4 * math.prod(shape)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % ALIGN)       # pad so the data starts on a page boundary
    f.write(struct.pack("<Q", len(text)) + text)
    scratch = np.empty(CHUNK_VALUES, np.float32)
    with tqdm(total=nbytes, unit="B", unit_scale=True, desc="FP32 cache", file=sys.stderr, leave=False,
              disable=not sys.stderr.isatty(), delay=1.0) as bar:
        for name, shape in shapes.items():
            stored = checkpoint.mapped(name)
            if len(shape) == 3:                   # Panels' values: whole panels of rows at a time
                rows = max(shape[2], CHUNK_VALUES // shape[1] // shape[2] * shape[2])
                for begin in range(0, stored.shape[0], rows):
                    part = stored[begin:begin + rows]
                    f.write(panels(part, out=scratch[:part.size].reshape(-1, *shape[1:])).values.data)
                    bar.update(4 * part.size)
                continue
            stored = stored.reshape(-1)
            for begin in range(0, stored.size, CHUNK_VALUES):
                part = stored[begin:begin + CHUNK_VALUES]
                f.write(upcast(part, out=scratch[:part.size]).data)
                bar.update(4 * part.size)


def _note(message: str) -> None:
    print(f"qwen_np: {message}", file=sys.stderr, flush=True)
