"""Process-wide compute resources: the cores we may use, our worker threads, BLAS's threads, and the
anonymous memory that loading allocates.

FP32 products use BLAS's own threads. Products with a BF16 weight split the weight's rows between
our threads instead, each running single-threaded BLAS on its slice: NumPy's BF16 upcast is
single-threaded, and only with the rows split do all cores upcast. bench/README.md records why FP32
products are not split the same way (Python hand-offs cost more than they save on an idle machine).
"""

from __future__ import annotations

import functools
import math
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any, Callable

import numpy as np


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, e.g. a container's share), not the host's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


_threads = usable_cores()
_pool: ThreadPoolExecutor | None = None
_blas: Any = None        # threadpoolctl controller for the BLAS libraries, created on first use


def threads() -> int:
    """Threads the fast path splits work between (set_threads; default one per usable core)."""
    return _threads


def set_threads(count: int | None) -> None:
    """Use `count` threads for the matrix products (None: one per core); the CLI's --threads.

    Also sets the BLAS thread count, for every matrix product BLAS threads itself.
    """
    global _threads, _pool
    _threads = count or usable_cores()
    _controller().limit(limits=_threads, user_api="blas")
    if _pool is not None:
        _pool.shutdown()
        _pool = None


def blas_info() -> list[dict[str, Any]]:
    """The BLAS NumPy runs: internal_api, architecture (the kernel chosen), num_threads, version."""
    return [info for info in _controller().info() if info.get("user_api") == "blas"]


# OpenBLAS kernels that have a small-matrix GEMM path (for M*N*K <= 100^3 it multiplies without
# packing the operands first): the AVX-512 x86_64 ones. Haswell's (also Zen's) has none; there a
# product of a few rows goes to BLAS whole (fast.few_rows; measured: bench/README.md).
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


def single_threaded_blas() -> Any:
    """Context in which BLAS runs on the calling thread only (our threads split the work instead).

    A cached controller: threadpoolctl.threadpool_limits() rescans the loaded libraries, 0.5 ms.
    """
    return _controller().limit(limits=1, user_api="blas")


def blas_threads_for(weight: np.ndarray) -> Any:
    """Single-threaded BLAS while stored (BF16) weights are streamed by our threads; else BLAS's own."""
    return nullcontext() if weight.dtype == np.float32 else single_threaded_blas()


def _workers() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(_threads - 1, thread_name_prefix="qwen_np")
    return _pool


def split(n: int, parts: int, job: Callable[[slice], object]) -> None:
    """job(part) for `parts` consecutive slices of range(n) at once: the first on this thread, the
    others on the worker threads (NumPy releases the GIL inside its loops and BLAS calls)."""
    bounds = np.linspace(0, n, parts + 1).astype(int).tolist()
    pending = [_workers().submit(job, slice(a, b)) for a, b in zip(bounds[1:-1], bounds[2:])]
    job(slice(bounds[0], bounds[1]))
    for done in pending:
        done.result()


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
