"""Parameters, FLOPs and bytes per token, counted from the STEPS table and a config (no weights)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..core.config import (DENSE_MLP, EXPERT_TENSORS, ROUTER, Qwen3Config, Shape, active_parameter_count, dimensions,
                           evaluate, resolve)
from .steps import STEPS, Step, layer_flops


def weight_tensors(config: Qwen3Config) -> list[tuple[Step, int]]:
    """(step, parameters per instance) for every step that reads a tensor of its own.

    A tied lm_head reads the embedding table and so owns no parameters: it is left out.
    """
    dims = dimensions(config, 1)
    return [(step, math.prod(resolve(weight, dims))) for step in STEPS
            if (weight := step.weight) is not None and not (step.name == "lm_head" and config.tie_word_embeddings)]


@dataclass(frozen=True)
class Module:
    """One row of the parameter table: a tensor name (without .weight), its shape, parameters each, how many."""

    name: str
    shape: Shape
    parameters: int
    instances: int
    in_layer: bool


def modules(config: Qwen3Config) -> list[Module]:
    """Every tensor kind with its count: the STEPS table's, and in a Qwen3-MoE the dense MLP in its dense layers
    only, each sparse layer's router and E experts' three matrices in its place."""
    L, dims = config.num_hidden_layers, dimensions(config, 1)
    sparse = sum(config.sparse_layer(i) for i in range(L))
    rows = []
    for step, n in weight_tensors(config):
        count = (L - sparse if _dense_mlp(step.name) else L) if step.in_layer else 1
        if count:
            rows.append(Module(step.name, step.weight or (), n, count, step.in_layer))
        if step.name.endswith("mlp.down_proj") and sparse:
            rows += [Module(spec.name.removesuffix(".weight"), spec.shape, math.prod(resolve(spec.shape, dims)), instances,
                            True)
                     for spec, instances in [(ROUTER, sparse), *((spec, sparse * config.num_experts)
                                                                 for spec in EXPERT_TENSORS.values())]]
    return rows


def _dense_mlp(name: str) -> bool:
    """Whether a tensor name (without .weight) is a dense layer's MLP matrix (not an expert's)."""
    return name.rsplit(".", 1)[-1] in DENSE_MLP and name.endswith(tuple(f".mlp.{key}" for key in DENSE_MLP))


def parameter_summary(config: Qwen3Config) -> dict[str, int]:
    """Parameters in total, per decoder layer (a Qwen3-MoE's: a sparse one's), without the embedding table and
    lm_head, and active: those one token computes with (a Qwen3-MoE's routed experts only; all of a dense one)."""
    rows = modules(config)
    total = sum(m.parameters * m.instances for m in rows)
    embedding_like = sum(m.parameters for m in rows if m.name in ("model.embed_tokens", "lm_head"))
    sparse = any(map(config.sparse_layer, range(config.num_hidden_layers)))
    per_layer = sum(m.parameters * (config.num_experts if ".mlp.experts." in m.name else 1) for m in rows
                    if m.in_layer and not (sparse and _dense_mlp(m.name)))
    return {"total": total, "per_layer": per_layer, "without_embeddings": total - embedding_like,
            "active": active_parameter_count(config)}


def forward_flops(config: Qwen3Config, tokens: int, positions: int) -> int:
    """Matmul FLOPs (2 per multiply-add) of one forward call: `tokens` new tokens over `positions`."""
    dims = dimensions(config, tokens, positions)
    return layer_flops(config, dims) + sum(evaluate(step.flops, dims) for step in STEPS if step.flops and not step.in_layer)


def weight_bytes_read_per_token(config: Qwen3Config, bytes_per_value: float) -> int:
    """Bytes of weights one decode step streams from memory: all of them (a Qwen3-MoE: but the experts a token
    is not routed to), except the embedding table, of which only the token's own row is read (unless it doubles
    as the lm_head)."""
    unread = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    return int((active_parameter_count(config) - unread) * bytes_per_value)     # a MoE: its routed experts only
