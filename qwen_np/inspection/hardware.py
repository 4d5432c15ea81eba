"""The machine qwen_np runs on: its cores and caches as the OS describes them, and what they do, measured.

Decode reads every weight once per token, so its speed is set by how fast the cores can read memory,
and that depends on where the bytes are: a core's own L1 and L2, the L3 it shares with the others, or
RAM. `read_topology` reads the OS's description (Linux: /sys/devices/system/cpu and /proc/cpuinfo);
`read_rates` measures a matrix-vector product's read rate against the size of the matrix, from
cache-sized to far beyond the last cache, so the steps of the curve can be held against the cache
sizes the OS gave; `decode_limits` turns the RAM-sized rate into tokens per second for a model.
This is why layers.linear widens a weight a block of rows at a time: a block small enough to stay in
cache between being written and being multiplied (fast.BLOCK_BYTES, measured in bench/README.md).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ..engine import runtime
from ..core.config import Qwen3Config

SYSFS_CPU = runtime.SYSFS_CPU
SYSFS_NODE = Path("/sys/devices/system/node")
KiB = 1024
# Working-set sizes of the read-rate curve: 16 KiB (inside any L1) to 1 GiB (far beyond any L3), x4 steps.
SIZES = [16 * KiB * 4 ** k for k in range(9)]
QUICK_SIZES = [16 * KiB * 16 ** k for k in range(4)]      # 16 KiB .. 64 MiB
COLUMNS = 256                 # the product's width: a [rows, 256] FP32 matrix times a vector


@dataclass
class Cache:
    level: int
    kind: str                 # "Data", "Instruction" or "Unified"
    size_bytes: int
    line_bytes: int | None
    shared_by: list[int]      # the logical CPUs that share this cache

    @property
    def name(self) -> str:
        return f"L{self.level}" + {"Data": "d", "Instruction": "i"}.get(self.kind, "")


@dataclass
class Topology:
    model: str | None
    usable: list[int]                         # logical CPUs this process may run on (its affinity)
    sockets: int | None
    cores: int | None                         # physical cores among the usable CPUs
    siblings: list[list[int]]                 # logical CPUs that share one core (SMT), per core
    caches: list[Cache]                       # as CPU 0 sees them
    numa_nodes: int | None
    governor: str | None                      # the cpufreq governor, where the OS exposes one
    unknown: list[str] = field(default_factory=list)   # what the OS did not say

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"caches": [asdict(c) | {"name": c.name} for c in self.caches]}


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cpu_list(text: str) -> list[int]:
    """The OS's CPU list syntax, "0-3,8,10-11", as numbers."""
    cpus: list[int] = []
    for part in filter(None, text.split(",")):
        low, _, high = part.partition("-")
        cpus.extend(range(int(low), int(high or low) + 1))
    return cpus


def read_topology(cpu_root: Path = SYSFS_CPU, node_root: Path = SYSFS_NODE,
                  cpuinfo: Path = Path("/proc/cpuinfo")) -> Topology:
    """The machine as the OS describes it; what it does not describe is listed in `unknown`."""
    usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    unknown: list[str] = []
    info = _read(cpuinfo) or ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), None)
    if model is None:
        unknown.append("CPU model (/proc/cpuinfo)")
    packages, cores, siblings = set(), set(), []
    for cpu in usable:
        topology = cpu_root / f"cpu{cpu}" / "topology"
        package, core, shared = (_read(topology / name) for name in ("physical_package_id", "core_id", "thread_siblings_list"))
        if package is None or core is None or shared is None:
            continue
        packages.add(package)
        if (package, core) not in cores:
            cores.add((package, core))
            siblings.append(cpu_list(shared))
    if not cores:
        unknown.append("sockets, cores and SMT siblings (/sys/devices/system/cpu/cpuN/topology)")
    caches = []
    for index in sorted((cpu_root / f"cpu{usable[0]}" / "cache").glob("index*")):
        level, kind, size = (_read(index / name) for name in ("level", "type", "size"))
        if level is None or kind is None or size is None:
            continue
        line, shared = _read(index / "coherency_line_size"), _read(index / "shared_cpu_list")
        caches.append(Cache(int(level), kind, runtime.cache_size_bytes(size), int(line) if line else None,
                            cpu_list(shared) if shared else []))
    if not caches:
        unknown.append("cache sizes (/sys/devices/system/cpu/cpuN/cache)")
    nodes = len(list(node_root.glob("node[0-9]*"))) or None
    if nodes is None:
        unknown.append("NUMA nodes (/sys/devices/system/node)")
    governor = _read(cpu_root / f"cpu{usable[0]}" / "cpufreq" / "scaling_governor")
    if governor is None:
        unknown.append("frequency governor (no cpufreq: often a virtual machine)")
    return Topology(model, usable, len(packages) or None, len(cores) or None, siblings, caches, nodes, governor, unknown)


def read_rate(nbytes: int, threads: int, reads: int = 256 * KiB ** 2, repeats: int = 5) -> float:
    """GB/s that a matrix-vector product reads from a [rows, COLUMNS] FP32 matrix of about `nbytes`.

    Trap: one product of a cache-sized matrix takes microseconds, less than Python's call. So the matrix
    is read again and again inside one call: a batch of `reads // nbytes` products over the same
    memory (a stride-0 batch axis, no copies), and the best of `repeats` calls counts."""
    rows = max(1, nbytes // (4 * COLUMNS))
    matrix = np.random.default_rng(0).standard_normal((rows, COLUMNS), dtype=np.float32)
    times = max(1, reads // matrix.nbytes)
    batch = as_strided(matrix, shape=(times, rows, COLUMNS), strides=(0, *matrix.strides), writeable=False)
    x, out = np.ones(COLUMNS, np.float32), np.empty((times, rows), np.float32)
    before = runtime.threads()
    runtime.set_threads(threads)
    try:
        best = min(_seconds(lambda: np.matmul(batch, x, out=out)) for _ in range(repeats))
    finally:
        runtime.set_threads(before)
    return times * matrix.nbytes / best / 1e9


def _seconds(job: Any) -> float:
    start = time.perf_counter()
    job()
    return time.perf_counter() - start


def read_rates(sizes: list[int], threads: list[int]) -> dict[int, list[float]]:
    """threads -> the read rate (GB/s) at each working-set size."""
    with runtime.steady_threads():
        return {n: [read_rate(size, n) for size in sizes] for n in threads}


def decode_limits(config: Qwen3Config, ram_gbs: float) -> dict[str, float]:
    """Tokens per second a decode step cannot beat when the weights it reads come from RAM at `ram_gbs`:
    FP32 weights (4 bytes each) and BF16 ones (2). The bytes a step reads are `inspect`'s, one rule
    (counts.weight_bytes_read_per_token): every weight but the embedding table, of which a step reads only its
    token's row (an untied model's table is 1.2 GB of Qwen3-8B's 16.4 in BF16, never streamed)."""
    from .counts import weight_bytes_read_per_token      # here: the probes above need no model code

    return {name: ram_gbs * 1e9 / weight_bytes_read_per_token(config, width) for name, width in (("fp32", 4), ("bf16", 2))}
