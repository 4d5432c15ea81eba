"""Parameters, FLOPs and bytes per token, counted from the STEPS table and a config (no weights)."""

from __future__ import annotations

import math

from ..core.config import Qwen3Config, dimensions, evaluate, parameter_count, resolve
from .steps import STEPS, Step


def weight_tensors(config: Qwen3Config) -> list[tuple[Step, int]]:
    """(step, parameters per instance) for every step that reads a tensor of its own.

    A tied lm_head reads the embedding table and so owns no parameters: it is left out.
    """
    dims = dimensions(config, 1)
    return [(step, math.prod(resolve(weight, dims))) for step in STEPS
            if (weight := step.weight) is not None and not (step.name == "lm_head" and config.tie_word_embeddings)]


def parameter_summary(config: Qwen3Config) -> dict[str, int]:
    """Parameters in total, per decoder layer, and without the embedding table and lm_head."""
    owned = weight_tensors(config)
    total = sum(n * (config.num_hidden_layers if step.in_layer else 1) for step, n in owned)
    embedding_like = sum(n for step, n in owned if step.name in ("model.embed_tokens", "lm_head"))
    return {"total": total, "per_layer": sum(n for step, n in owned if step.in_layer),
            "without_embeddings": total - embedding_like}


def forward_flops(config: Qwen3Config, tokens: int, positions: int) -> int:
    """Matmul FLOPs (2 per multiply-add) of one forward call: `tokens` new tokens over `positions`."""
    dims = dimensions(config, tokens, positions)
    return sum(evaluate(step.flops, dims) * (config.num_hidden_layers if step.in_layer else 1)
               for step in STEPS if step.flops)


def weight_bytes_read_per_token(config: Qwen3Config, bytes_per_value: float) -> int:
    """Bytes of weights one decode step streams from memory: all of them, except the embedding table,
    of which only the token's own row is read (unless it doubles as the lm_head)."""
    unread = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    return int((parameter_count(config) - unread) * bytes_per_value)
