"""What `eval --compare` and `precision` both print: a model against itself in FP32, one row per number format."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from tqdm import tqdm

if TYPE_CHECKING:
    import numpy as np


def add_compare_argument(parser: argparse.ArgumentParser) -> None:
    """eval's --compare flag (the eval command checks it with check_formats before loading anything)."""
    parser.add_argument("--compare", nargs="+", metavar="FORMAT",
                        help="also score the model with its weights in each FORMAT (space- or comma-separated) against "
                             "itself in FP32 on the same windows: perplexity and its ratio to FP32, KL divergence of the "
                             "next-token distribution (mean, median, p99), same top-1, RMS dp (the formats "
                             "`precision --formats` takes, e.g. bf16 q8_0 q4_0)")


def format_names(given: Sequence[str]) -> list[str]:
    """The formats of --compare or --formats as given, space- or comma-separated alike: `bf16 q8_0`,
    `bf16,q8_0` and `bf16, q8_0` are the same two."""
    return [name.strip() for word in given for name in word.split(",") if name.strip()]


def progress_bar(unit: str = "tok") -> Any:
    """A progress bar on stderr (drawn only on a terminal) whose total arrives with the first update, as
    compare_formats' progress(fmt, n, total) reports it."""
    import sys

    bar = tqdm(total=None, desc="comparing", unit=unit, disable=None, file=sys.stderr, leave=False)

    def update(fmt: str, n: int, total: int) -> None:
        if bar.total is None:
            bar.total = total
        bar.set_postfix_str(fmt, refresh=False)
        bar.update(n)

    bar.report = update
    return bar


def format_comparison(folder: Path, docs: list[np.ndarray], context: int, formats: Sequence[str]) -> dict[str, dict[str, Any]]:
    """What `eval --compare` reports: every format against the FP32 model on eval's own documents and
    windows (a text shorter than one window is one window, as eval scores it)."""
    from ..precision import lab as precision
    with progress_bar() as bar:
        return precision.compare_formats(precision.load_reference(folder, context, "compare"), docs, formats,
                                         context, "compare", progress=bar.report)


def render_comparison(results: dict[str, dict[str, Any]]) -> str:
    """The per-format statistics as a table (what `eval --compare` prints)."""
    header = (f"{'format':<14}{'PPL':>12}{'PPL/FP32':>10}{'KLD mean':>11}{'median':>10}{'p99':>10}"
              f"{'same top':>10}{'RMS dp':>9}")
    lines = [header]
    for fmt, s in results.items():
        lines.append(f"{fmt:<14}{s['ppl_other']:>12.6g}{s['ppl_ratio']:>10.4f}{s['kld_mean']:>11.3g}"
                     f"{s['kld_median']:>10.3g}{s['kld_p99']:>10.3g}{s['same_top_percent']:>9.2f}%"
                     f"{s['delta_p_rms_percent']:>8.2f}%")
    first = next(iter(results.values()))
    lines.append(f"(FP32 perplexity {first['ppl_base']:.3f} over {int(first['positions'])} positions; KLD in nats; "
                 "same top: argmax agrees with FP32; RMS dp: of FP32's top token's probability)")
    return "\n".join(lines)
