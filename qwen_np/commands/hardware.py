"""`python -m qwen_np hardware`: this machine's cores and caches, and its read rate against working-set size."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from ..core.config import preset
from ..errors import QwenNPError

if TYPE_CHECKING:
    from ..inspection import hardware

MODELS = ("qwen3-0.6b", "qwen3-8b")


def hardware_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = ("The CPU's topology as the OS describes it (cores, SMT siblings, L1/L2/L3, NUMA, governor) and "
                          "a matrix-vector product's read rate from 16 KiB to 1 GiB, whose steps line up with the caches; "
                          "the decode limits they imply.")
    parser.add_argument("--quick", action="store_true", help="fewer sizes, up to 64 MiB (a few seconds less)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument("--png", metavar="FILE", help="also draw the read rate against size, the caches marked "
                                                      "(needs matplotlib: pip install 'qwen_np[plot]')")
    parser.set_defaults(run=run)


PARSERS = {"hardware": hardware_parser}      # cli.py builds the command's parser with it


def run(args: argparse.Namespace) -> int:
    from ..inspection import hardware     # here: --help needs none of it (nor NumPy)
    if args.png:
        _require_matplotlib()
    topology = hardware.read_topology()
    sizes = hardware.QUICK_SIZES if args.quick else hardware.SIZES
    threads = sorted({1, len(topology.usable)})
    rates = hardware.read_rates(sizes, threads)
    ram = rates[threads[-1]][-1]
    limits = {name: hardware.decode_limits(preset(name), ram) for name in MODELS}
    if args.json:
        print(json.dumps({"topology": topology.as_dict(), "sizes": sizes,
                          "read_gbs": {str(n): r for n, r in rates.items()}, "decode_limits": limits}, indent=2))
    else:
        print(render(topology, sizes, rates, limits))
    if args.png:
        draw(args.png, topology, sizes, rates)
    return 0


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise QwenNPError("--png: needs matplotlib (pip install 'qwen_np[plot]')") from None


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}"
        n /= 1024
    return ""


def render(topology: hardware.Topology, sizes: list[int], rates: dict[int, list[float]],
           limits: dict[str, dict[str, float]]) -> str:
    t = topology
    smt = max((len(s) for s in t.siblings), default=1)
    lines = [f"machine: {t.model or 'unknown model'}; {len(t.usable)} logical CPUs usable "
             f"({','.join(map(str, t.usable))}), {t.sockets or '?'} socket(s), {t.cores or '?'} core(s), "
             + (f"{smt} threads per core (SMT siblings: {t.siblings})" if smt > 1 else "no SMT"),
             "caches (as CPU 0 sees them):"]
    for cache in t.caches:
        shared = f"shared by CPUs {cache.shared_by}" if len(cache.shared_by) > 1 else "one core's own"
        lines.append(f"  {cache.name:<4}{_size(cache.size_bytes):>9}  {shared}"
                     + (f", {cache.line_bytes}-byte lines" if cache.line_bytes else ""))
    lines.append(f"NUMA nodes: {t.numa_nodes or '?'}; frequency governor: {t.governor or '?'}")
    if t.unknown:
        lines.append("the OS does not say: " + "; ".join(t.unknown))
    lines += ["", "read rate of a matrix-vector product against the matrix's size (GB/s, best of 5):",
              "  size      " + "".join(f"{f'{n} thread' + ('s' if n > 1 else ''):>12}" for n in rates)]
    data_caches = [c for c in t.caches if c.kind != "Instruction"]
    for i, size in enumerate(sizes):
        fits = next((c.name for c in data_caches if size <= c.size_bytes), "RAM")
        lines.append(f"  {_size(size):<10}" + "".join(f"{r[i]:>12.1f}" for r in rates.values()) + f"   fits in {fits}")
    lines += ["", f"decode limits if every weight is read at the largest size's rate ({max(rates)} thread(s)):"]
    for name, limit in limits.items():
        lines.append(f"  {name}: FP32 weights {limit['fp32']:.3g} tok/s, BF16 weights {limit['bf16']:.3g} tok/s")
    return "\n".join(lines)


def draw(path: str, topology: hardware.Topology, sizes: list[int], rates: dict[int, list[float]]) -> None:
    import matplotlib.pyplot as plt

    fig = figure(topology.caches, sizes, rates)
    fig.savefig(path)
    plt.close(fig)


def figure(caches: list[hardware.Cache], sizes: list[int], rates: dict[int, list[float]], title: str = "") -> Any:
    """The read rate against working-set size, one line per thread count, each data cache's size marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100, constrained_layout=True)
    for n, r in rates.items():
        ax.plot(sizes, r, marker="o", label=f"{n} thread{'s' * (n > 1)}")
    top = ax.get_ylim()[1]
    for cache in caches:
        if cache.kind != "Instruction":
            ax.axvline(cache.size_bytes, color="grey", linestyle=":")
            ax.text(cache.size_bytes, top * 0.95, f" {cache.name} {_size(cache.size_bytes)}", color="grey", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [_size(s) for s in sizes], rotation=45, fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel("working set: the matrix's size")
    ax.set_ylabel("read rate (GB/s)")
    ax.set_title(title or "matrix-vector product: read rate against the matrix's size", fontsize=9)
    ax.legend(loc="lower left")
    return fig
