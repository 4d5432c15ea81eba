"""Non-finite logits: weights holding NaN or Inf (or values that overflow FP32) give NaN logits, which
no sampler can rank (greedy would pick token 0, perhaps the end-of-sequence id, and stop in silence).

Checking a forward call's logits costs one pass over them. Only once they are not finite is the
culprit looked for: the tokens are run again on the readable path with a trace (model.py), which
stops at the first step whose output is not finite, so the report names a layer, not just "nan".
"""

from __future__ import annotations

import re
from typing import Sequence

import numpy as np

from ..errors import QwenNPError
from .budget import prefill_chunks
from ..core.model import Qwen3Model

LAYER = re.compile(r"model\.layers\.\d+")


class NonFiniteLogits(QwenNPError):
    """The model's own logits (before any sampling setting) are not finite for a sequence's tokens: its
    weights' doing, not the caller's, so a server answers it apart from bad settings (serving/finite.py)."""


class _NotFinite(Exception):
    """Raised inside the trace to stop the forward pass at the first step that is not finite."""

    def __init__(self, step: str) -> None:
        super().__init__(step)
        self.step = step


def check_finite(model: Qwen3Model, token_ids: Sequence[int] | np.ndarray, logits: np.ndarray) -> np.ndarray:
    """`logits` (of `token_ids`, the whole sequence so far) as they are if every value is finite; else a
    QwenNPError naming the first layer whose output is not."""
    if np.isfinite(logits).all():
        return logits
    step = first_non_finite_step(model, token_ids)
    if step is None:        # the readable path stayed finite where the fast one did not: say what is known
        raise NonFiniteLogits("model: the logits are not finite (NaN or Inf), though every traced step's output is")
    layer = match[0] if (match := LAYER.match(step)) else step
    raise NonFiniteLogits(f"model: the logits are not finite (NaN or Inf): {layer} is the first layer whose output is not "
                      f"(first at {step}); the checkpoint's weights hold NaN or Inf there, or overflow FP32")


def first_non_finite_step(model: Qwen3Model, token_ids: Sequence[int] | np.ndarray) -> str | None:
    """The first traced step (e.g. "model.layers.1.mlp.down_proj") whose output holds a NaN or an Inf, for
    these tokens run from position 0 in prefill-sized chunks (a traced call takes the readable path)."""
    ids = [int(t) for t in token_ids]
    cache = model.new_cache(len(ids))

    def check(step: str, value: np.ndarray) -> None:
        # The causal mask writes -inf into the scores on purpose; the softmax after them shows a NaN.
        if not step.endswith(".scores") and not np.isfinite(value).all():
            raise _NotFinite(step)

    try:
        for chunk in prefill_chunks(len(ids)):
            model.forward_batch([ids[chunk]], [cache], check, head=model.has_head)
    except _NotFinite as found:
        return found.step
    return None


def check_weights_finite(model: Qwen3Model) -> None:
    """One forward pass of one token: every layer's matrices take part in it, so NaN or Inf weights show
    (all but the embedding rows of other tokens; the final norm's output for a model without an LM head).
    For a server to call before it listens."""
    check_finite(model, [0], model.forward_batch([[0]], [None], head=model.has_head))
