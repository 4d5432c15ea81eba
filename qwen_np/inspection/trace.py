"""Tracer: a live trace of a forward pass, one aligned row per step (shape, dtype, statistics)."""

from __future__ import annotations

import math
import re
import sys
from typing import TextIO

import numpy as np

from .steps import STEPS_BY_NAME, Shape, format_shape

_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


class Tracer:
    """A trace for `Qwen3Model.forward`: one aligned row per step with shape, dtype and statistics.

        model.forward(ids, trace=Tracer())                  # every step of every layer, to stderr
        model.forward(ids, trace=Tracer(layers={0, 35}))    # only layers 0 and 35 (plus embed/norm/head)

    Shapes print as symbols = numbers ("[T, H, Dh] = [7, 32, 128]"). Statistics skip the -inf that
    the causal mask writes into the attention scores.
    """

    def __init__(self, stream: TextIO = sys.stderr, layers: set[int] | None = None) -> None:
        self.stream = stream
        self.layers = layers
        self.passes = 0

    def __call__(self, name: str, value: np.ndarray) -> None:
        if name == "model.embed_tokens":
            self._start_pass(value.shape[0])
        layer = layer_of(name)
        if layer is not None and self.layers is not None and layer not in self.layers:
            return
        print(trace_row(name, value), file=self.stream)

    def _start_pass(self, tokens: int) -> None:
        self.passes += 1
        print(f"\nforward pass {self.passes}: T = {tokens} token{'s' if tokens != 1 else ''}", file=self.stream)
        print(f"  {'step':<{_NAME_WIDTH}}{'shape':<{_SHAPE_WIDTH}}{'dtype':<9}"
              f"{'mean':>11}{'std':>11}{'max|x|':>11}", file=self.stream)


_NAME_WIDTH, _SHAPE_WIDTH = 44, 32


def trace_row(name: str, value: np.ndarray) -> str:
    """One Tracer row: name, shape as symbols = numbers, dtype, mean, std, max|x| (finite values)."""
    symbols = step_shape(name, value)
    shape = format_shape(symbols, value.shape) if symbols else str(list(value.shape))
    *stats, masked = statistics(value)
    note = f"  ({masked:,} masked)" if masked else ""
    return (f"  {name:<{_NAME_WIDTH}}{shape:<{_SHAPE_WIDTH}}{str(value.dtype):<9}"
            + "".join(f"{s:>11.4g}" for s in stats) + note)


def layer_of(name: str) -> int | None:
    """The layer index in a traced step's name ("model.layers.3.mlp.up_proj" -> 3), None outside a layer."""
    match = _LAYER_INDEX.match(name)
    return int(match.group(1)) if match else None


def step_template(name: str) -> str:
    """The STEPS name of a traced step: its layer index written "{i}"."""
    return _LAYER_INDEX.sub("model.layers.{i}.", name)


def step_shape(name: str, value: np.ndarray) -> Shape | None:
    """The symbolic shape of the step traced as `name` when `value` has as many axes; None for a name
    STEPS does not hold."""
    step = STEPS_BY_NAME.get(step_template(name))
    return step.output if step is not None and len(step.output) == value.ndim else None


def statistics(value: np.ndarray) -> tuple[float, float, float, int]:
    """(mean, std, max|x|) of the finite values, in float64, and how many values are not finite (the -inf
    the causal mask writes into the attention scores); NaN statistics when none is finite."""
    finite = value[np.isfinite(value)].astype(np.float64)
    masked = value.size - finite.size
    if not finite.size:
        return math.nan, math.nan, math.nan, masked
    return float(finite.mean()), float(finite.std()), float(np.abs(finite).max()), masked
