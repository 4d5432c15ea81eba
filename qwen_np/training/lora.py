"""LoRA (Hu et al. 2021, "Low-Rank Adaptation"): train a small update beside each frozen projection.

A projection y = x W^T, W [out, in], gets two small matrices A [r, in] and B [out, r] of rank r << in:

    y = x W^T + (alpha / r) * (x A^T) B^T

W stays frozen (it gets no gradient and no optimizer state); only A and B are trained: r (in + out)
numbers instead of in * out (rank 16 on all seven projections of Qwen3-0.6B: 10M instead of 440M).
A starts random and B zero, as the paper and peft do, so the adapted model starts as the base model
exactly, while A's randomness gives B's first gradients a direction (with A zero too, both gradients
would stay zero). alpha / r scales the update so that changing r does not change how far a step moves
the outputs.

The weight kind numerics.Adapted carries the adapter with its projection; layers.linear (and the fast
path) compute the update through layers.adapter_product. This module makes adapters, names them as peft
does, merges them, and holds their backward, read beside gradients.linear_backward.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..core import layers
from ..core.config import EMBED_TOKENS, FINAL_NORM, LAYER_MATRICES, LAYER_TENSOR_NAMES, LM_HEAD, Qwen3Config, expected_tensors
from ..core.ablations import model_class
from ..core.model import Qwen3Model
from ..errors import QwenNPError
from ..files.adapter import adapter_name, write_adapter
from ..files.checkpoint import save_checkpoint
from ..numbers.numerics import Adapted, upcast

@dataclass
class LoraSettings:
    """A LoRA run's adapters (train --lora RANK, --lora-alpha, --lora-targets, --lora-dropout), saved with its
    checkpoints: a resumed run keeps them."""

    rank: int
    alpha: float | None = None                  # None: 2 * rank
    targets: tuple[str, ...] = LAYER_MATRICES
    dropout: float = 0.0                        # the share of each adapter's input dropped while training

    def check(self) -> "LoraSettings":
        """These settings as a run keeps them (alpha given, targets in LAYER_MATRICES' order), or a QwenNPError
        naming the one that is wrong (rank, alpha, targets, dropout)."""
        if self.rank < 1:
            raise QwenNPError(f"must be at least 1, got {self.rank}", "rank")
        if self.alpha is not None and not self.alpha > 0:
            raise QwenNPError(f"must be positive, got {self.alpha}", "alpha")
        unknown = sorted(set(self.targets) - set(LAYER_MATRICES))
        if unknown or not self.targets:
            raise QwenNPError(f"expected some of {', '.join(LAYER_MATRICES)}, got {', '.join(unknown) or 'none'}",
                              "targets")
        if not 0.0 <= self.dropout < 1.0:
            raise QwenNPError(f"must be in [0, 1), got {self.dropout}", "dropout")
        return LoraSettings(self.rank, float(2 * self.rank if self.alpha is None else self.alpha),
                            tuple(key for key in LAYER_MATRICES if key in self.targets), float(self.dropout))


@dataclass
class AdapterGradient:
    """The gradients of one adapter: dA [r, in], dB [out, r] (the frozen W gets none)."""

    a: np.ndarray
    b: np.ndarray


def initial_adapter(out_features: int, in_features: int, rank: int,
                    rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A [r, in] and B [out, r] as peft initialises them by default: A kaiming-uniform, B zero.

    peft calls nn.init.kaiming_uniform_(A, a=sqrt(5)) (nn.Linear's own init): gain sqrt(2 / (1 + 5)),
    bound gain * sqrt(3 / fan_in) = 1 / sqrt(in), so A ~ U(-1/sqrt(in), 1/sqrt(in)). The numbers differ
    from torch's (another generator); the distribution is the same.
    """
    bound = 1.0 / math.sqrt(in_features)
    a = rng.uniform(-bound, bound, size=(rank, in_features)).astype(np.float32)    # [r, in]
    return a, np.zeros((out_features, rank), dtype=np.float32)                     # [out, r]


def add_adapters(model: Qwen3Model, rank: int, alpha: float | None = None,
                 targets: Sequence[str] = LAYER_MATRICES, seed: int = 0) -> None:
    """Wrap each target projection of every layer in an Adapted weight, in place (alpha default: 2 * rank)."""
    LoraSettings(rank, alpha, tuple(targets)).check()
    scale = (2.0 * rank if alpha is None else alpha) / rank
    rng = np.random.default_rng(seed)
    for layer in model.layers:
        for name in LAYER_MATRICES:                         # a fixed order, whatever order targets come in
            weight = getattr(layer, name)
            if name in targets and weight is not None:   # None: a projection an ablation removed (GELU's gate_proj)
                if isinstance(weight, Adapted):
                    raise QwenNPError(f"{name}: the model already has adapters")
                a, b = initial_adapter(weight.shape[0], weight.shape[1], rank, rng)
                setattr(layer, name, Adapted(weight, a, b, scale))


def adapter_parameters(model: Qwen3Model) -> dict[str, np.ndarray]:
    """The adapters' arrays (the model's own, trained in place), named as the checkpoint tensor they adapt
    with lora_A / lora_B before ".weight": model.layers.0.self_attn.q_proj.lora_A.weight (peft's
    names for Qwen3 without its "base_model.model." prefix)."""
    params: dict[str, np.ndarray] = {}
    for i, layer in enumerate(model.layers):
        for key in LAYER_MATRICES:
            weight = getattr(layer, key)
            if isinstance(weight, Adapted):
                params[adapter_name(LAYER_TENSOR_NAMES[key].format(i=i), "A")] = weight.a
                params[adapter_name(LAYER_TENSOR_NAMES[key].format(i=i), "B")] = weight.b
    return params


def adapter_shapes(config: Qwen3Config, rank: int, targets: Sequence[str]) -> dict[str, tuple[int, int]]:
    """The shape of every adapter array add_adapters makes, by adapter_parameters' names: A [r, in], B [out, r]."""
    shapes = expected_tensors(config)
    out: dict[str, tuple[int, int]] = {}
    for i in range(config.num_hidden_layers):
        for key in LAYER_MATRICES:
            if key in targets:
                rows, columns = shapes[LAYER_TENSOR_NAMES[key].format(i=i)]
                tensor = LAYER_TENSOR_NAMES[key].format(i=i)
                out[adapter_name(tensor, "A")], out[adapter_name(tensor, "B")] = (rank, columns), (rows, rank)
    return out


def has_adapters(model: Qwen3Model) -> bool:
    return any(isinstance(getattr(layer, key), Adapted) for layer in model.layers for key in LAYER_MATRICES)


def dropped(x: np.ndarray, keep: np.ndarray | None, dropout: float) -> np.ndarray:
    """The adapter's input under dropout: x * keep / (1 - p), keep a 0/1 mask like x (None: no dropout).

    As peft's lora_dropout, it drops only what enters A, never the frozen path's input."""
    return x if keep is None else x * (keep * np.float32(1.0 / (1.0 - dropout)))


@dataclass
class Dropout:
    """LoRA dropout in one piece of a training step (layers.ADAPTER_INPUTS while its forward and backward run).

    Each adapter's keep mask is drawn afresh from a generator seeded by (seed: the run's seed, the step, the
    piece; the adapter's number in the model), not kept: the backward (and a layer recomputed there) draws
    the same mask again, and a resumed run the masks the unstopped run drew. Only the adapter's input is
    dropped (peft's lora_dropout); the frozen path reads x whole."""

    p: float
    seed: tuple[int, ...]
    numbers: dict[int, int]                     # id(adapter.a) -> the adapter's number, in model order

    @classmethod
    def of(cls, model: Qwen3Model, p: float, seed: tuple[int, ...]) -> "Dropout":
        numbers = {id(getattr(layer, key).a): n for n, (layer, key) in enumerate(
            (layer, key) for layer in model.layers for key in LAYER_MATRICES if isinstance(getattr(layer, key), Adapted))}
        return cls(p, seed, numbers)

    def piece(self, number: int) -> "Dropout":
        """The dropout of piece `number` of the step (a micro-batch's shard): masks of its own."""
        return Dropout(self.p, (*self.seed, number), self.numbers)

    def keep(self, x: np.ndarray, weight: Adapted) -> np.ndarray:
        """The 0/1 mask [x's shape] of this adapter's input (drawn over x's values in order, so the forward's
        packed rows [B*T, in] and the backward's [B, T, in] get the same mask)."""
        rng = np.random.default_rng([*self.seed, self.numbers[id(weight.a)]])
        return (rng.random(x.size, dtype=np.float32) >= self.p).astype(x.dtype).reshape(x.shape)

    def __call__(self, x: np.ndarray, weight: Adapted) -> np.ndarray:
        return dropped(x, self.keep(x, weight), self.p)


def adapter_forward(x: np.ndarray, weight: Adapted, keep: np.ndarray | None = None,
                    dropout: float = 0.0) -> np.ndarray:
    """layers.adapter_product of the (dropped-out) input: the adapter's term of y."""
    return layers.adapter_product(dropped(x, keep, dropout), weight)


def adapter_backward(d_out: np.ndarray, x: np.ndarray, weight: Adapted, keep: np.ndarray | None = None,
                     dropout: float = 0.0) -> tuple[np.ndarray, AdapterGradient]:
    """The adapter's term s (x' A^T) B^T reversed, x' = dropped(x), u = x' A^T [N, r], s = alpha / r.

    d_out [..., out], x [..., in] -> the adapter path's share of dx [..., in], and dA, dB:
    du = s dy B [N, r];  dB = s dy^T u [out, r];  dA = du^T x' [r, in];  dx' = du A, and dx = dx' keep / (1 - p).
    Every product is thin (r columns), so the backward costs about 3x the forward's adapter term. The
    frozen path's dx = dy W is gradients.linear_backward's; W itself gets no gradient.
    """
    d_rows = d_out.reshape(-1, d_out.shape[-1])                                      # [N, out]
    x_rows = dropped(x, keep, dropout).reshape(-1, x.shape[-1])                      # [N, in]
    scale = np.float32(weight.scale)
    u = x_rows @ weight.a.T                                                          # [N, r]
    d_u = (d_rows @ weight.b) * scale                                                # [N, r]
    d_b = (d_rows.T @ u) * scale                                                     # [out, r]
    d_a = d_u.T @ x_rows                                                             # [r, in]
    dx = dropped((d_u @ weight.a).reshape(x.shape), keep, dropout)                   # [..., in]
    return dx, AdapterGradient(d_a, d_b)


# --- What a tuned model is written as -----------------------------------------------------------------


def adapter_settings(model: Qwen3Model) -> tuple[int, float, list[str]]:
    """(rank, alpha, targets) of a model's adapters (every adapter of a model has the same rank and alpha)."""
    adapted = {key: weight for layer in model.layers for key in LAYER_MATRICES
               if isinstance(weight := getattr(layer, key), Adapted)}
    if not adapted:
        raise QwenNPError("model: it has no adapters")
    first = next(iter(adapted.values()))
    rank = first.a.shape[0]
    return rank, first.scale * rank, [key for key in LAYER_MATRICES if key in adapted]


def save_adapter(folder: Path, model: Qwen3Model, base: str, dropout: float = 0.0) -> Path:
    """The model's adapters in peft's format (files/adapter.write_adapter). base: the base model's name or
    folder (base_model_name_or_path)."""
    rank, alpha, targets = adapter_settings(model)
    return write_adapter(folder, adapter_parameters(model), base, rank, alpha, targets, dropout)


def with_adapters(model: Qwen3Model, arrays: dict[str, np.ndarray]) -> Qwen3Model:
    """A readable Qwen3Model on the same frozen weights (not copied) whose adapters hold `arrays` (by
    adapter_parameters' names): a checkpoint's adapters written out without touching the model trained."""
    layers = []
    for i, layer in enumerate(model.layers):
        swapped: dict[str, Any] = {}
        for key in LAYER_MATRICES:
            weight = getattr(layer, key)
            if isinstance(weight, Adapted):
                tensor = LAYER_TENSOR_NAMES[key].format(i=i)
                swapped[key] = Adapted(weight.base, arrays[adapter_name(tensor, "A")], arrays[adapter_name(tensor, "B")],
                                       weight.scale)
        layers.append(dataclasses.replace(layer, **swapped))
    return model_class(model.config)(model.config, model.embed_tokens, layers, model.norm, model.lm_head)


def without_adapters(model: Qwen3Model) -> Qwen3Model:
    """The frozen base under a model's adapters, as a model on the same arrays (nothing copied): what a LoRA
    run's DPO or GRPO reference is (the starting weights, its adapters switched off), as TRL's
    `use_adapter(model, None)` is for a peft model."""
    layers = [dataclasses.replace(layer, **{key: getattr(layer, key).base for key in LAYER_MATRICES
                                            if isinstance(getattr(layer, key), Adapted)}) for layer in model.layers]
    return model_class(model.config)(model.config, model.embed_tokens, layers, model.norm, model.lm_head)


def merged_tensors(model: Qwen3Model) -> dict[str, np.ndarray]:
    """Every checkpoint tensor of the model in FP32, each adapted projection merged: W + (alpha / r) B A."""
    tensors = {EMBED_TOKENS: upcast(model.embed_tokens), FINAL_NORM: upcast(model.norm)}
    for i, layer in enumerate(model.layers):
        tensors.update({template.format(i=i): upcast(getattr(layer, key)) for key, template in LAYER_TENSOR_NAMES.items()
                        if getattr(layer, key) is not None})        # an ablation's layer lacks some
    if not model.config.tie_word_embeddings:
        tensors[LM_HEAD] = upcast(model.lm_head)
    return tensors


def save_merged(folder: Path, model: Qwen3Model, config_json: dict[str, Any]) -> Path:
    """The merged model as a checkpoint folder's weights and config.json, in FP32.

    Why FP32 and not the base's BF16: the update (alpha / r) B A is small next to W, often below half
    a BF16 ulp of W's entries, so rounding W + update to BF16 gives back W itself for many of them:
    much of what was learned would vanish in the write. FP32 keeps it (twice the file; the tokenizer
    files are the caller's to copy)."""
    return save_checkpoint(folder, config_json, [merged_tensors(model)], dtype="F32")
