"""A rough memory-bandwidth probe for `inspect`'s decode-speed estimate (bench/ measures properly)."""

from __future__ import annotations

import time

import numpy as np


def measure_bandwidth(seconds: float = 0.5, nbytes: int = 256 * 1024 ** 2) -> float:
    """Memory bandwidth in bytes/s, measured here: repeated NumPy copies of a 256 MiB array.

    Each copy reads and writes every byte, so it moves 2 x nbytes. One thread, far bigger than any
    CPU cache: a rough stand-in for how fast decode can stream weights, not a benchmark.
    """
    source = np.ones(nbytes // 8)
    target = np.empty_like(source)
    np.copyto(target, source)          # first touch: make the OS actually allocate the pages
    copies, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or copies == 0:
        np.copyto(target, source)
        copies += 1
    return 2 * nbytes * copies / elapsed
