"""The logit lens: what the final norm + lm_head would predict from the residual stream after each layer."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..core import layers
from ..core.model import Qwen3Model
from .text import pad, token_text


def lens_probabilities(model: Qwen3Model, token_ids: Sequence[int]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(row labels, lens probabilities [L+1, V], the model's own probabilities [V]) at the last position.

    Row 0 reads the embedding, row l+1 the residual stream after layer l: each goes through the
    final norm and lm_head as if the model stopped there. The last row is the model's own output.
    """
    residuals: dict[str, np.ndarray] = {}

    def capture(name: str, value: np.ndarray) -> None:
        if is_lens_step(name):
            residuals[name] = value[-1].copy()                                   # [D]

    logits = model.forward(token_ids, trace=capture)                             # [T, V]
    return lens_labels(model), lens_rows(model, np.stack(list(residuals.values()))), layers.softmax(logits[-1])


def is_lens_step(name: str) -> bool:
    """Whether the lens reads the step traced as `name`: the embedding and each layer's result."""
    return name == "model.embed_tokens" or name.endswith(".residual_mlp")


def lens_labels(model: Qwen3Model) -> list[str]:
    return ["embedding"] + [f"layer {i}" for i in range(model.config.num_hidden_layers)]


def lens_rows(model: Qwen3Model, stream: np.ndarray) -> np.ndarray:
    """Probabilities [L+1, V] from the residual stream [L+1, D] of one position (the lens steps in order)."""
    normed = layers.rms_norm(stream, model.norm, model.config.rms_norm_eps)      # [L+1, D]
    return layers.softmax(layers.linear(normed, model.lm_head))                  # [L+1, V]


def logit_lens(model: Qwen3Model, token_ids: list[int], tokenizer: Any, top_k: int = 5) -> str:
    """After each layer, the top-k next tokens the final norm + lm_head would predict at the last position."""
    labels, probs, final = lens_probabilities(model, token_ids)
    last = len(token_ids) - 1
    lines = [f"Logit lens at the last position ({last}, {token_text(tokenizer, token_ids[-1])}): the final norm + "
             "lm_head applied to the residual stream after each layer",
             f"  {'after':<12}top {top_k} next tokens (probability)"]
    lines += [f"  {label:<12}{_top_tokens(row, tokenizer, top_k)}" for label, row in zip(labels, probs)]
    lines.append(f"  {'model':<12}{_top_tokens(final, tokenizer, top_k)}")
    lines.append(f"  (the model's own output equals the row after layer {len(labels) - 2}: "
                 "there the lens IS the model)")
    return "\n".join(lines)


def _top_tokens(probs: np.ndarray, tokenizer: Any, top_k: int) -> str:
    top = np.argsort(-probs, kind="stable")[:top_k]
    return "  ".join(f"{pad(token_text(tokenizer, int(i)), 15)}{probs[i]:<9.3g}" for i in top).rstrip()
