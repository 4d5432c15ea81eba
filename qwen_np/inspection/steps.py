"""STEPS: the steps of a forward pass in the order `Qwen3Model.forward` runs them, each with its trace
name, the qwen_np function that does the math, and its input/output shapes in the dimension
vocabulary of config.py. A step's weight shape comes from config's tensor table (LAYER_TENSORS,
MODEL_TENSORS), and its name and place from model.TRACE_STEPS, the names the network reports its
steps under: this table describes them and cannot add, drop or reorder one (checked at import).
"""

from __future__ import annotations

import functools
import linecache
import sys
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Sequence

import numpy as np

from ..core import layers, model
from ..core.config import (DENSE_MLP, EXPERT_TENSORS, LAYER_TENSORS, MODEL_TENSORS, ROUTER, Qwen3Config, Shape,
                           dimensions, evaluate, resolve)
from ..core.model import Qwen3Model, layer_weights

# Trace name of the step that reads a tensor -> that tensor's symbolic shape.
_WEIGHT_SHAPES = {spec.name.removesuffix(".weight"): spec.shape
                  for spec in (*LAYER_TENSORS.values(), *MODEL_TENSORS.values(), ROUTER, *EXPERT_TENSORS.values())}


@dataclass(frozen=True)
class Step:
    """One step of the forward pass, as `Qwen3Model.forward` reports it to a trace."""

    name: str                                  # trace name; "{i}" stands for the layer index
    what: str                                  # what the step computes, in one line
    code: Callable[..., Any]                   # the qwen_np function that does the math
    inputs: tuple[tuple[str, Shape], ...]      # (what, shape) of each input
    output: Shape
    flops: str = ""                            # matmul FLOPs as a product of symbols; "" if elementwise

    @property
    def weight(self) -> Shape | None:
        """Shape of the checkpoint tensor `name + ".weight"` this step reads, if any."""
        return _WEIGHT_SHAPES.get(self.name)

    @property
    def in_layer(self) -> bool:
        return "{i}" in self.name

    @property
    def short_name(self) -> str:
        """The name inside a decoder layer ("self_attn.q_proj"), or the full name outside one."""
        return self.name.replace("model.layers.{i}.", "")


def _linear(name: str, what: str, x: tuple[str, Shape], out: Shape) -> Step:
    """A projection y = x W^T: W is [out, in] as stored, and it costs 2 FLOPs per weight per token."""
    return Step(name, what, layers.linear, (x,), out, flops="*".join(("2", "T", *_WEIGHT_SHAPES[name])))


def _norm(name: str, what: str, x: tuple[str, Shape]) -> Step:
    return Step(name, what, layers.rms_norm, (x,), x[1])


_LAYER = "model.layers.{i}"
_X, _H = ("x", ("T", "D")), ("h", ("T", "D"))
_DESCRIBED: tuple[Step, ...] = (
    Step("model.embed_tokens", "one row of the embedding table per token id (no scaling)",
         layers.embed, (("token ids", ("T",)),), ("T", "D")),
    _norm(f"{_LAYER}.input_layernorm", "RMSNorm over D, before attention", _X),
    _linear(f"{_LAYER}.self_attn.q_proj", "queries, split into H heads of Dh", _H, ("T", "H", "Dh")),
    _linear(f"{_LAYER}.self_attn.k_proj", "keys: only KVH heads (grouped-query attention)", _H, ("T", "KVH", "Dh")),
    _linear(f"{_LAYER}.self_attn.v_proj", "values: KVH heads, never normed", _H, ("T", "KVH", "Dh")),
    _norm(f"{_LAYER}.self_attn.q_norm", "RMSNorm of each query head over Dh (one weight shared by all heads)",
          ("q", ("T", "H", "Dh"))),
    _norm(f"{_LAYER}.self_attn.k_norm", "RMSNorm of each key head over Dh", ("k", ("T", "KVH", "Dh"))),
    Step(f"{_LAYER}.self_attn.rope_q", "rotate query pairs (i, i+Dh/2) by position-dependent angles",
         layers.rope, (("q", ("T", "H", "Dh")),), ("T", "H", "Dh")),
    Step(f"{_LAYER}.self_attn.rope_k", "rotate keys the same way; these go into the KV cache",
         layers.rope, (("k", ("T", "KVH", "Dh")),), ("T", "KVH", "Dh")),
    Step(f"{_LAYER}.self_attn.scores", "q . k / sqrt(Dh) for every query/key pair, future masked to -inf",
         layers.attention_scores, (("q", ("T", "H", "Dh")), ("k cached + new", ("S", "KVH", "Dh"))),
         ("H", "T", "S"), flops="2*H*T*S*Dh"),
    Step(f"{_LAYER}.self_attn.softmax", "each query's scores -> weights that sum to 1",
         layers.softmax, (("scores", ("H", "T", "S")),), ("H", "T", "S")),
    Step(f"{_LAYER}.self_attn.weighted_sum", "mix the values by the weights, heads concatenated",
         layers.weighted_sum, (("weights", ("H", "T", "S")), ("v cached + new", ("S", "KVH", "Dh"))),
         ("T", "H*Dh"), flops="2*H*T*S*Dh"),
    _linear(f"{_LAYER}.self_attn.o_proj", "project the heads back to the model width",
            ("heads", ("T", "H*Dh")), ("T", "D")),
    Step(f"{_LAYER}.residual_attn", "x + attention output: the residual stream",
         Qwen3Model.decoder_layer, (_X, ("attention", ("T", "D"))), ("T", "D")),
    _norm(f"{_LAYER}.post_attention_layernorm", "RMSNorm over D, before the MLP", _X),
    _linear(f"{_LAYER}.mlp.gate_proj", "gate: how much of each MLP feature to let through", _H, ("T", "F")),
    _linear(f"{_LAYER}.mlp.up_proj", "up: the MLP features themselves", _H, ("T", "F")),
    Step(f"{_LAYER}.mlp.act_fn", "SiLU(gate) x up (SwiGLU)", layers.silu,
         (("gate", ("T", "F")), ("up", ("T", "F"))), ("T", "F")),
    _linear(f"{_LAYER}.mlp.down_proj", "back down to the model width", ("act", ("T", "F")), ("T", "D")),
    Step(f"{_LAYER}.residual_mlp", "x + MLP output: this layer's result", Qwen3Model.decoder_layer,
         (_X, ("mlp", ("T", "D"))), ("T", "D")),
    _norm("model.norm", "final RMSNorm over D", _X),
    _linear("lm_head", "one score (logit) per vocabulary entry, at every position", _H, ("T", "V")),
)
STEPS_BY_NAME = {step.name: step for step in _DESCRIBED}
if tuple(STEPS_BY_NAME) != model.TRACE_STEPS:          # a step of the network undescribed, or out of order
    raise ImportError(f"inspection.steps describes {tuple(STEPS_BY_NAME)}, the network traces {model.TRACE_STEPS}")
STEPS = tuple(STEPS_BY_NAME.values())

# A sparse layer's MLP (Qwen3-MoE), as layers.moe computes it in the dense MLP's place: the router, the routing,
# and the chosen experts' SwiGLU over the rows routed to each (T*K rows in all, an expert's n of them gathered),
# their outputs weighted and summed. layers.moe notes the router's logits as mlp.gate; the rest is described here
# for `inspect` only (a trace holds no per-expert step).
_ROUTED = ("x gathered", ("T*K", "D"))
SPARSE_MLP_STEPS: tuple[Step, ...] = (
    _linear(f"{_LAYER}.mlp.gate", "router: one logit per expert", _H, ("T", "E")),
    Step(f"{_LAYER}.mlp.route", "softmax over E (FP32), each token's top K experts and their weights",
         layers.route, (("logits", ("T", "E")),), ("T", "K")),
    Step(f"{_LAYER}.mlp.experts.{{e}}.gate_proj", "each chosen expert's gate, over the rows of its tokens",
         layers.linear, (_ROUTED,), ("T*K", "Fe"), flops="2*T*K*Fe*D"),
    Step(f"{_LAYER}.mlp.experts.{{e}}.up_proj", "each chosen expert's up", layers.linear, (_ROUTED,), ("T*K", "Fe"),
         flops="2*T*K*Fe*D"),
    Step(f"{_LAYER}.mlp.experts.{{e}}.act_fn", "SiLU(gate) x up (SwiGLU), expert by expert", layers.silu,
         (("gate", ("T*K", "Fe")), ("up", ("T*K", "Fe"))), ("T*K", "Fe")),
    Step(f"{_LAYER}.mlp.experts.{{e}}.down_proj", "each chosen expert back to the model width", layers.linear,
         (("act", ("T*K", "Fe")),), ("T*K", "D"), flops="2*T*K*D*Fe"),
    Step(f"{_LAYER}.mlp.moe", "each token's K expert outputs times their weights, summed", layers.moe,
         (("expert outputs", ("T*K", "D")), ("weights", ("T", "K"))), ("T", "D")),
)
_DENSE_MLP_STEPS = frozenset(f"{_LAYER}.mlp.{name}" for name in (*DENSE_MLP, "act_fn"))


def forward_steps(config: Qwen3Config) -> tuple[Step, ...]:
    """The steps `inspect` shows for `config`: STEPS, with a Qwen3-MoE's sparse MLP in the dense MLP's place
    (its dense layers, if any, run STEPS' MLP: inspect says how many)."""
    if not config.is_moe:
        return STEPS
    first = next(i for i, step in enumerate(STEPS) if step.name in _DENSE_MLP_STEPS)
    return (*STEPS[:first], *SPARSE_MLP_STEPS, *(s for s in STEPS[first:] if s.name not in _DENSE_MLP_STEPS))


def layer_flops(config: Qwen3Config, dims: dict[str, int]) -> int:
    """Matmul FLOPs of every decoder layer together: each layer's attention, and its MLP, dense or sparse."""
    def flops(steps: Sequence[Step]) -> int:
        return sum(evaluate(step.flops, dims) for step in steps if step.flops and step.in_layer)

    dense_mlp = flops([step for step in STEPS if step.name in _DENSE_MLP_STEPS])
    sparse = sum(map(config.sparse_layer, range(config.num_hidden_layers)))
    return (config.num_hidden_layers * (flops(STEPS) - dense_mlp) + (config.num_hidden_layers - sparse) * dense_mlp
            + sparse * flops(SPARSE_MLP_STEPS))


def format_shape(shape: Shape, numbers: Sequence[int] | None = None) -> str:
    """'[T, H, Dh] = [7, 32, 128]', or the symbols alone when no numbers are given."""
    symbols = f"[{', '.join(shape)}]"
    return symbols if numbers is None else f"{symbols} = [{', '.join(str(n) for n in numbers)}]"


def source_line(step: Step) -> tuple[str, int, str]:
    """(file within qwen_np/, line number, code) of the line that computes `step` ("core/model.py", 137,
    "h = t(...)"), as found by running it (_reporters)."""
    return _reporters()[step.name]


@functools.cache
def _reporters() -> dict[str, tuple[str, int, str]]:
    """Every step's computing line: one traced forward pass of a one-layer toy network on the readable path,
    whose trace looks up the stack for the line that reported each step, in model.py or layers.py. In
    model.py a step and its report are one line (`h = t("input_layernorm", ...)`); in layers.py the report
    is a `note(...)` statement after the line that computes it, which is taken instead."""
    found: dict[str, tuple[str, int, str]] = {}
    ours = {model.__file__, layers.__file__}

    def record(name: str, value: np.ndarray) -> None:
        frame: FrameType | None = sys._getframe(1)
        while frame is not None and (frame.f_code.co_filename not in ours or frame.f_code.co_name in _PLUMBING):
            frame = frame.f_back
        assert frame is not None, name
        path, number = frame.f_code.co_filename, frame.f_lineno
        if linecache.getline(path, number).lstrip().startswith("note("):
            number = max(n for n in range(1, number) if linecache.getline(path, n).strip()
                         and not linecache.getline(path, n).lstrip().startswith("#"))
        found.setdefault(name.replace("model.layers.0.", "model.layers.{i}."),
                         (Path(path).relative_to(_PACKAGE).as_posix(), number, linecache.getline(path, number).strip()))

    _toy_model().forward([1, 2], trace=record)
    return found


_PACKAGE = Path(model.__file__).parents[1]        # qwen_np/
_PLUMBING = {"__call__", "<lambda>"}             # model.Notes hands a step's value on; inside() scopes a name


def _toy_model() -> Qwen3Model:
    """A Qwen3 of one tiny layer, zero weights: enough to run every step once."""
    config = Qwen3Config(vocab_size=4, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=4)
    dims = dimensions(config)

    def zeros(shape: Shape) -> np.ndarray:
        return np.zeros(tuple(resolve(shape, dims)), np.float32)

    layer = layer_weights({key: zeros(spec.shape) for key, spec in LAYER_TENSORS.items()})
    table = zeros(MODEL_TENSORS["embed_tokens"].shape)
    return Qwen3Model(config, table, [layer], zeros(MODEL_TENSORS["norm"].shape), table)
