"""LoRA adapters at inference: a tuned model's low-rank updates kept beside the base's weights, never merged
into them, so that one base in memory serves the base model and several adapters at once (as vLLM's
--lora-modules). files/adapter.py reads one from PEFT's folder; training/lora.py trains and writes them.

An adapted projection of layer i computes y = x W^T + scale (x A^T) B^T (numerics.Adapted,
layers.adapter_product), W the base's own weight, untouched. A whole adapter reaches the forward pass in
one of two ways:
* every row of every pass (generate/chat --lora): engine.loading.attach_adapter wraps each projection it
  adapts in an Adapted weight, in place;
* a batch whose rows ask for different adapters (the server): forward_batch takes each row's adapter, and
  model.Batch.layer_weights makes each layer's projections numerics.RowAdapters for that pass: W once for
  every row, each adapter's update on its own rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from ..numbers.numerics import Adapted, Weight


@dataclass(frozen=True, eq=False)
class Adapter:
    """One LoRA adapter for a whole model: for some projections of some layers, A [r, in] and B [out, r] (FP32),
    and the one scale every update is multiplied by (alpha / r; alpha / sqrt(r) for rsLoRA)."""

    name: str                                                       # what a user or a request calls it
    scale: float
    matrices: Mapping[tuple[int, str], tuple[np.ndarray, np.ndarray]]   # (layer, projection key) -> (A, B)
    # What it holds (a hash of its matrices and scale): rows of different adapters have different keys and
    # values for the same tokens, so the prefix cache names a row's blocks under its adapter's digest.
    digest: bytes

    @property
    def rank(self) -> int:
        return max(a.shape[0] for a, _ in self.matrices.values())

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.matrices.values())

    def adapted(self, layer: int, key: str, base: Weight) -> Adapted | None:
        """Layer `layer`'s projection `key` (a LayerWeights name) with this adapter's update beside its base
        weight, or None where the adapter has none."""
        if (layer, key) not in self.matrices:
            return None
        a, b = self.matrices[layer, key]
        return Adapted(base, a, b, self.scale)
