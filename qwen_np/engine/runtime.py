"""Process-wide compute resources: the cores we may use, our worker threads, BLAS's threads, and the
anonymous memory that loading allocates.

FP32 products use BLAS's own threads. Products with a BF16 weight split the weight's rows between
our threads instead, each running single-threaded BLAS on its slice: NumPy's BF16 upcast is
single-threaded, and only with the rows split do all cores upcast. bench/README.md records why FP32
products are not split the same way (Python hand-offs cost more than they save on an idle machine).
"""

from __future__ import annotations

import contextlib
import functools
import math
import mmap
import os
import resource
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ..core.defaults import usable_cores   # there, so that --help shows the cores without NumPy


SYSFS_CPU = Path("/sys/devices/system/cpu")


def cache_size_bytes(text: str) -> int:
    """A sysfs cache size, "32K" / "1024K" / "32M", in bytes."""
    units = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


@functools.cache
def l2_bytes(cpu_root: Path = SYSFS_CPU) -> int | None:
    """One core's L2 cache (of the first CPU this process may use), as sysfs gives it; None where it does not."""
    usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    for index in sorted((cpu_root / f"cpu{usable[0]}" / "cache").glob("index*")):
        try:
            level, kind, size = ((index / name).read_text().strip() for name in ("level", "type", "size"))
            if level == "2" and kind in ("Data", "Unified"):
                return cache_size_bytes(size)
        except (OSError, ValueError, IndexError):
            continue
    return None


_threads = usable_cores()          # the most threads we may use (set_threads, the CLI's --threads)
_active = _threads                 # the threads we use now: fewer while other processes want the cores
_pool: ThreadPoolExecutor | None = None
_blas: Any = None        # threadpoolctl controller for the BLAS libraries, created on first use
_job = threading.local()           # .running: this thread runs one of independent_jobs' jobs


def threads() -> int:
    """Threads the fast path splits work between now (at most set_threads'; see adapt_to_load); 1 inside
    one of independent_jobs' jobs, which are already spread over the threads."""
    return 1 if getattr(_job, "running", False) else _active


def threads_wanted() -> int:
    """The most threads we may use: set_threads' (the CLI's --threads), else one per usable core."""
    return _threads


def set_threads(count: int | None) -> None:
    """Use at most `count` threads for the matrix products (None: one per core); the CLI's --threads.

    Also sets the BLAS thread count, for every matrix product BLAS threads itself.
    """
    global _threads, _pool
    _threads = count or usable_cores()
    _use(_threads)
    if _pool is not None:
        _pool.shutdown()
        _pool = None


def _use(count: int) -> None:
    global _active
    _active = count
    _controller().limit(limits=count, user_api="blas")


# --- sharing a busy machine --------------------------------------------------------------------------
# Our threads work in lockstep: a product's slices (ours, or OpenBLAS's own) must all finish before the
# next step starts, and OpenBLAS's idle threads spin rather than sleep. When other processes want the
# cores too, the scheduler takes a core away from one of our threads at a time, and every step then
# waits for that thread while the others spin: on 2 cores with one busy neighbour, 2 threads decoded at
# 0.41x their idle speed, with three neighbours at 0.12-0.15x, where one thread kept 0.49x. So before
# each forward pass we count the runnable tasks that are not ours and use only the cores they leave.
LOAD_CHECK_SECONDS = 0.05        # how often the load is read (~50 us with a few threads)
LOAD_SAMPLES = 4                 # threads drop after this many busy readings in a row, not after one spike
_load_checked = 0.0
_busy_readings: list[int] = []
_adaptive = True                 # False inside steady_threads()


def threads_for_load(most: int, cores: int, others_running: list[int]) -> int:
    """Threads to use when other processes had `others_running` runnable tasks at the latest readings.

    All `most` on a quiet machine; else the cores left over by the least busy of those readings, at
    least 1: a short spike of activity does not cost us our threads, a steady neighbour does."""
    others = min(others_running) if others_running else 0
    return most if others == 0 else max(1, min(most, cores - others))


def _others_running() -> int | None:
    """Runnable tasks on the machine that are not this process's threads; None where unknown (not Linux)."""
    try:
        with open("/proc/loadavg", "rb") as f:
            running = int(f.read().split()[3].split(b"/")[0])       # "0.52 0.31 0.20 3/412 5051"
        ours = 0
        for task in os.listdir("/proc/self/task"):                   # our threads, spinning BLAS ones too
            with contextlib.suppress(OSError):                       # a thread may end while we look
                with open(f"/proc/self/task/{task}/stat", "rb") as f:
                    stat = f.read()
                ours += stat[stat.rindex(b")") + 2:][:1] == b"R"     # "pid (name) R ...": the state
    except (OSError, IndexError, ValueError):
        return None
    return max(0, running - ours)


def adapt_to_load() -> None:
    """Use fewer threads while other processes keep cores busy, all of them again when they stop.

    Called at the start of every forward pass and training step; reads the load at most every
    LOAD_CHECK_SECONDS. Logits agree with any other thread count's up to the rounding of BLAS sums (as
    tests/engine/test_fast_path.py checks); work that must repeat bit for bit runs inside steady_threads()."""
    global _load_checked
    now = time.monotonic()
    if not _adaptive or _threads == 1 or now - _load_checked < LOAD_CHECK_SECONDS:
        return
    _load_checked = now
    others = _others_running()
    if others is None:
        return
    _busy_readings.append(others)
    del _busy_readings[:-LOAD_SAMPLES]
    wanted = threads_for_load(_threads, usable_cores(), _busy_readings if len(_busy_readings) == LOAD_SAMPLES else [0])
    if wanted != _active:
        _use(wanted)


@contextlib.contextmanager
def steady_threads() -> Iterator[None]:
    """All set_threads' threads, whatever the load, inside: for work that must repeat bit for bit on
    a rerun (training, whose resumed run must equal the run never stopped)."""
    global _adaptive
    before, _adaptive = _adaptive, False
    _use(_threads)
    try:
        yield
    finally:
        _adaptive = before


def blas_info() -> list[dict[str, Any]]:
    """The BLAS NumPy runs: internal_api, architecture (the kernel chosen), num_threads, version."""
    return [info for info in _controller().info() if info.get("user_api") == "blas"]


# OpenBLAS kernels that have a small-matrix GEMM path (for M*N*K <= 100^3 it multiplies without
# packing the operands first): the AVX-512 x86_64 ones. Haswell's (also Zen's) has none; there a
# product of a few rows is a GEMV per row over slices of W that stay in L2 (fast.few_rows; measured:
# bench/README.md).
SMALL_MATRIX_KERNELS = ("skylakex", "cooperlake", "sapphirerapids")


@functools.cache
def blas_has_small_matrix_kernel() -> bool:
    """Whether the BLAS NumPy runs is an OpenBLAS kernel with a small-matrix GEMM path."""
    return any(str(info.get("architecture", "")).lower() in SMALL_MATRIX_KERNELS for info in blas_info())


def _controller() -> Any:
    global _blas
    if _blas is None:
        from threadpoolctl import ThreadpoolController   # runtime dependency, imported where used

        _blas = ThreadpoolController().select(user_api="blas")
    return _blas


def single_threaded_blas() -> contextlib.AbstractContextManager[None]:
    """Context in which BLAS runs on the calling thread only (our threads split the work instead)."""
    return blas_threads(1)


@contextlib.contextmanager
def blas_threads(count: int) -> Iterator[None]:
    """Context in which BLAS runs on `count` threads; the count does not adapt to the load inside
    (adapt_to_load would give BLAS its threads back).

    A cached controller: threadpoolctl.threadpool_limits() rescans the loaded libraries, 0.5 ms.
    """
    global _adaptive
    before, _adaptive = _adaptive, False
    try:
        with _controller().limit(limits=count, user_api="blas"):
            yield
    finally:
        _adaptive = before


def blas_threads_for(weight: object) -> Any:
    """Single-threaded BLAS while weights not held in FP32 are streamed by our threads; else BLAS's own."""
    return nullcontext() if isinstance(weight, np.ndarray) else single_threaded_blas()


def _workers() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max(1, _threads - 1), thread_name_prefix="qwen_np")
    return _pool


def split(n: int, parts: int, job: Callable[[slice], object]) -> None:
    """job(part) for `parts` consecutive slices of range(n) at once: the first on this thread, the
    others on the worker threads (NumPy releases the GIL inside its loops and BLAS calls)."""
    if parts <= 1:                               # one part: no hand-off, no bounds to compute
        job(slice(0, n))
        return
    bounds = np.linspace(0, n, parts + 1).astype(int).tolist()
    pending = [_workers().submit(job, slice(a, b)) for a, b in zip(bounds[1:-1], bounds[2:])]
    job(slice(bounds[0], bounds[1]))
    for done in pending:
        done.result()


def take_turns(job: Callable[[Any], object], items: Sequence[Any]) -> None:
    """job(item) for every item, on up to threads() threads (this one and the workers), each thread taking
    the next item as it finishes one, and each job's own products on its thread alone (threads() is 1 inside).

    For a step's independent pieces too small to split each (a mixture-of-experts layer's experts: one
    hand-off for the layer, not one per product); a core that other processes keep busy then takes fewer
    items instead of holding up every product's other half. The order in which items finish is not
    fixed: a job writes its own part of the result."""
    count = min(threads(), len(items))
    if count <= 1:
        for item in items:
            job(item)
        return
    queue = iter(items)                     # shared: next() on a list iterator is atomic under the GIL

    def turns(_: slice) -> None:
        before, _job.running = getattr(_job, "running", False), True
        try:
            for item in queue:
                job(item)
        finally:
            _job.running = before

    split(count, count, turns)


def independent_jobs(job: Callable[[Any], Any], items: Sequence[Any], most: int | None = None) -> list[Any]:
    """[job(item) for item in items], the items shared out between up to `most` threads (None: all of
    set_threads', whatever the load), each thread taking the next item as it finishes one, every job
    single-threaded (its products on one core, BLAS too).

    For work made of independent pieces (eval's windows): no thread waits for another, so when the
    scheduler takes a core away from one, the others go on taking items, where splitting each product
    in fixed halves makes every product wait for the slowest half (see "sharing a busy machine").
    Results come in the items' order, so a sum over them rounds the same for any thread count."""
    count = min(threads_wanted() if most is None else most, len(items))
    if count <= 1:
        return [job(item) for item in items]

    def run(item: Any) -> Any:
        _job.running = True
        return job(item)

    with single_threaded_blas(), ThreadPoolExecutor(count, thread_name_prefix="qwen_np-job") as pool:
        return list(pool.map(run, items))


def peak_rss_bytes() -> int:
    """Peak resident memory of this process so far."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024   # macOS reports bytes, Linux KiB


def allocate(shape: tuple[int, ...], dtype: np.dtype | type = np.float32) -> np.ndarray:
    """An uninitialised array in its own private anonymous mapping, its pages faulted in up front by
    one thread per core. For the weights loading keeps, and its reused read buffer.

    When the page cache fills RAM (as right after reading a checkpoint) the kernel must reclaim
    memory for every new page, and faulting pages from several threads at once is the fastest way
    through that (bench/README.md has the measurements against NumPy's allocation and MAP_POPULATE).
    """
    count = math.prod(shape)
    if not hasattr(mmap, "MAP_ANONYMOUS"):        # not a POSIX system: NumPy's own allocation
        return np.empty(shape, dtype)
    buffer = mmap.mmap(-1, max(count * np.dtype(dtype).itemsize, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    first_bytes = np.frombuffer(buffer, np.uint8)[::mmap.PAGESIZE]     # one byte in every page
    workers = usable_cores() if len(buffer) >= PARALLEL_FAULT_BYTES else 1
    bounds = np.linspace(0, len(first_bytes), workers + 1).astype(int).tolist()
    with ThreadPoolExecutor(workers) as pool:     # NumPy releases the GIL while it writes
        list(pool.map(lambda lo, hi: first_bytes[lo:hi].fill(0), bounds[:-1], bounds[1:]))
    return np.frombuffer(buffer, dtype, count=count).reshape(shape)    # unmapped when the array goes


PARALLEL_FAULT_BYTES = 64 * 1024 ** 2   # below this, starting threads costs more than they save


@dataclass
class ResidentPeak:
    """This process's resident memory from a moment on: the RSS then (`start`) and the most since (`peak`).

    Linux's high-water mark (VmHWM in /proc/self/status) is restarted at that moment (writing 5 to
    /proc/self/clear_refs), so an earlier peak (a tokenizer's parse, say) is not taken for the one watched.
    Where that is not possible (not Linux) `peak` is peak_rss_bytes, the process's whole-life peak,
    and `restarted` says so."""

    start: int
    restarted: bool

    @classmethod
    def begin(cls) -> "ResidentPeak":
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            restarted = True
        except OSError:
            restarted = False
        return cls(_status_bytes("VmRSS") or peak_rss_bytes(), restarted)

    @property
    def peak(self) -> int:
        return (_status_bytes("VmHWM") if self.restarted else None) or peak_rss_bytes()


def _status_bytes(field: str) -> int | None:
    """A memory field of /proc/self/status (VmRSS, VmHWM) in bytes; None where there is no such file."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
    except (OSError, StopIteration, ValueError):
        return None
