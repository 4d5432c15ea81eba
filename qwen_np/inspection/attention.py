"""The attention view: one head's softmax weights over the prompt, as text bars, a grid and a PNG."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..errors import QwenNPError
from ..core.model import Qwen3Model
from .figures import save_attention_png
from .text import pad, token_text


def attention_weights(model: Qwen3Model, token_ids: Sequence[int], layer: int) -> np.ndarray:
    """The softmax weights [H, T, T] of one layer, from a forward pass over `token_ids`."""
    L, target = model.config.num_hidden_layers, f"model.layers.{layer}.self_attn.softmax"
    if not 0 <= layer < L:
        raise QwenNPError(f"{layer} out of range [0, {L})", "layer")
    captured: dict[str, np.ndarray] = {}

    def capture(name: str, value: np.ndarray) -> None:
        if name == target:
            captured[name] = value.copy()

    model.forward(token_ids, trace=capture)
    return captured[target]


def attention_view(model: Qwen3Model, token_ids: list[int], tokenizer: Any, layer: int, head: int,
                   png_path: str | None = None) -> str:
    """The last token's attention over the prompt for one layer and head, as a text heatmap (and a PNG)."""
    H = model.config.num_attention_heads
    if not 0 <= head < H:
        raise QwenNPError(f"{head} out of range [0, {H})", "head")
    weights = attention_weights(model, token_ids, layer)[head]                   # [T, T]
    texts = [token_text(tokenizer, int(t)) for t in token_ids]
    last = weights[-1]                                                           # [T]
    lines = [f"Attention of the last token {texts[-1]} (position {len(texts) - 1}) over the prompt: layer {layer}, "
             f"head {head} (reads KV head {head // model.config.group_size})",
             "  the weights sum to 1; bars are scaled to the largest weight",
             f"  {'pos':>4}  {'token':<15}{'weight':>7}"]
    for position, (text, w) in enumerate(zip(texts, last)):
        lines.append(f"  {position:>4}  {pad(text, 15)}{w:>7.3f}  {_bar(w / last.max())}")
    if len(texts) <= GRID_MAX_TOKENS:
        lines += ["", "  every query position (row) over every key position (column): "
                  f"{' '.join(f'{s}<={t:g}' for s, t in zip(SHADES, SHADE_LIMITS))}, · = future (masked)"]
        lines += [f"  {pad(text, 15)}{_shade_row(row, position)}".rstrip()
                  for position, (text, row) in enumerate(zip(texts, weights))]
    if png_path is not None:
        what = save_attention_png(png_path, weights, texts, f"layer {layer}, head {head}")
        lines.append(f"\n  wrote {png_path}: {what}")
    return "\n".join(lines)


BAR_WIDTH = 40
EIGHTHS = " ▏▎▍▌▋▊▉"
SHADES, SHADE_LIMITS = "░▒▓█", (0.25, 0.5, 0.75, 1.0)
GRID_MAX_TOKENS = 48


def _bar(fraction: float) -> str:
    """A horizontal bar of BAR_WIDTH characters at 1.0, drawn in eighths of a character."""
    eighths = int(round(fraction * BAR_WIDTH * 8))
    return "█" * (eighths // 8) + EIGHTHS[eighths % 8].strip()


def _shade_row(weights: np.ndarray, position: int) -> str:
    cells = [SHADES[min(int(np.searchsorted(SHADE_LIMITS, w)), len(SHADES) - 1)] * 2 for w in weights[:position + 1]]
    return "".join(cells) + "· " * (len(weights) - position - 1)

