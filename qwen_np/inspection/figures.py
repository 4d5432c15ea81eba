"""Attention heatmaps as labelled figures: token labels on both axes and a colour bar, one panel per head.

matplotlib (the `plot` extra) draws them when it is installed; `generate --attention-png` then saves a
labelled picture, else the bare grid of png.py. The walkthrough draws its per-head figure with the
same function, so the two cannot disagree about what a heatmap shows.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from .png import write_png

# Frame colours of the KV groups (matplotlib's tab10, light enough not to hide the heatmap's edge).
GROUP_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
PNG_SIDE = 720          # pixels: the labelled PNG is square, a multiple of T on a side (as the bare grid)


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def attention_figure(weights: np.ndarray, labels: Sequence[str], titles: Sequence[str], title: str,
                     columns: int = 4, figsize: tuple[float, float] | None = None,
                     groups: Sequence[int] | None = None) -> Any:
    """A matplotlib Figure: one heatmap per panel of weights [P, T, T], queries down, keys across.

    The future (above the diagonal) is masked: drawn grey, not as a weight of 0. groups: the KV head each
    panel's query head reads (grouped-query attention); panels of one KV head get frames of one colour.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels, T = weights.shape[0], weights.shape[-1]
    cols = min(columns, panels)
    rows = math.ceil(panels / cols)
    figsize = figsize or (3.2 * cols + 1.2, 3.2 * rows + 0.6)
    fig, axes = plt.subplots(rows, cols, figsize=figsize, dpi=100, squeeze=False, constrained_layout=True)
    cmap = matplotlib.colormaps["Blues"].with_extremes(bad="#e1e1e1")
    future = np.triu(np.ones((T, T), dtype=bool), 1)
    images = []
    for index, ax in enumerate(axes.flat):
        if index >= panels:
            ax.axis("off")
            continue
        images.append(ax.imshow(np.ma.masked_array(weights[index], future), cmap=cmap, vmin=0.0, vmax=1.0))
        if groups is not None:
            for spine in ax.spines.values():
                spine.set_edgecolor(GROUP_COLOURS[groups[index] % len(GROUP_COLOURS)])
                spine.set_linewidth(3)
        ax.set_title(titles[index], fontsize=9)
        ax.set_xticks(range(T), labels, rotation=90, fontsize=7)
        ax.set_yticks(range(T), labels, fontsize=7)
        ax.set_xlabel("key", fontsize=8)
        ax.set_ylabel("query", fontsize=8)
    fig.colorbar(images[0], ax=axes, shrink=0.8, label="attention weight")
    fig.suptitle(title, fontsize=10)
    return fig


def heatmap_pixels(weights: np.ndarray, cell: int | None = None) -> np.ndarray:
    """RGB image [T*cell, T*cell, 3] of a [T, T] attention grid: white 0 -> dark blue 1, masked cells grey."""
    T = weights.shape[0]
    cell = cell or max(4, min(32, 512 // T))
    white, blue, grey = np.array([255, 255, 255.0]), np.array([8, 48, 107.0]), np.array([225, 225, 225.0])
    colors = white + weights[..., None].astype(np.float64) * (blue - white)       # [T, T, 3]
    colors[np.triu(np.ones((T, T), dtype=bool), 1)] = grey
    return np.repeat(np.repeat(colors.round().astype(np.uint8), cell, axis=0), cell, axis=1)


def save_attention_png(path: str, weights: np.ndarray, labels: Sequence[str], title: str) -> str:
    """Save one head's [T, T] weights as a PNG; returns what was written, in words.

    With matplotlib: a labelled heatmap, rendered square to a multiple of T pixels and written by
    png.py (RGB, three chunks); without it: png.py's bare grid.
    """
    T = weights.shape[0]
    if not have_matplotlib():
        write_png(path, heatmap_pixels(weights))
        return f"the full {T} x {T} grid, darker = more weight (pip install 'qwen_np[plot]' for token labels)"
    import matplotlib.pyplot as plt

    side = T * math.ceil(PNG_SIDE / T)
    fig = attention_figure(weights[None], labels, [title], "", figsize=(side / 100, side / 100))
    fig.canvas.draw()
    rgb = np.asarray(fig.canvas.buffer_rgba())[..., :3]                          # [side, side, 3]
    plt.close(fig)
    write_png(path, rgb)
    return f"the full {T} x {T} grid with the tokens on both axes and a colour bar"
