"""Training a Qwen3 with the hand-written backward pass: loss and gradients, AdamW, the schedule."""

from __future__ import annotations

import numpy as np

from . import gradients
from .errors import QwenNPError
from .model import Qwen3Model


def loss_and_gradients(model: Qwen3Model, batch: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
    """Mean next-token cross-entropy of a batch and every parameter's FP32 gradient.

    batch: int array [B, T+1]; the model reads batch[:, :-1] and predicts batch[:, 1:], the loss
    transformers' Qwen3ForCausalLM computes with labels=input_ids. grads maps each checkpoint tensor
    name to an array of that tensor's shape.
    """
    batch = check_batch(batch, model.config.vocab_size)
    logits, tape = gradients.forward_with_tape(model, batch[:, :-1])                 # [B, T, V]
    loss, d_logits = gradients.cross_entropy(logits, batch[:, 1:])
    return loss, gradients.backward(model, tape, d_logits)


def check_batch(batch: np.ndarray, vocab_size: int) -> np.ndarray:
    """A [B, T+1] integer batch with T >= 1 and every id inside the vocabulary."""
    batch = np.asarray(batch)
    if batch.ndim != 2 or batch.shape[1] < 2 or not np.issubdtype(batch.dtype, np.integer):
        raise QwenNPError(f"batch: expected integer token ids [B, T+1] with T >= 1, got shape {batch.shape} {batch.dtype}")
    if batch.min() < 0 or batch.max() >= vocab_size:
        raise QwenNPError(f"batch: token ids must lie in [0, {vocab_size})")
    return batch.astype(np.int64)
