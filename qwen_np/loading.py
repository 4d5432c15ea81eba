"""load_model: a checkpoint folder (or hub id) -> a Qwen3Model, its weights held as the memory plan says."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from .checkpoint import DTYPE_BYTES, Checkpoint, resolve_model_path
from .config import LAYER_TENSORS, MODEL_TENSORS, load_config
from .fast import FastQwen3Model
from .memory import DEFAULT_CONTEXT, plan_memory
from .model import LayerWeights, Qwen3Model
from .numerics import upcast
from .runtime import allocate
from .weight_cache import load_fp32


def load_model(path: str | Path, memory: str = "auto", max_tokens: int | None = None,
               fast: bool = True) -> Qwen3Model:
    """Load a Qwen3 checkpoint folder (or hub id) for inference.

    memory: "fp32" upcasts every weight once; "bf16" keeps the stored weights memory-mapped and
    upcasts them block by block on use; "auto" picks fp32 when it fits in RAM with margin.
    max_tokens: the context the memory plan reserves KV cache for (default min(config, 4096)).
    fast: a FastQwen3Model (qwen_np/fast.py: same logits, tuned for speed); False gives the readable
    Qwen3Model, every call on model.py's code.
    """
    folder = resolve_model_path(path)
    config = load_config(folder)
    checkpoint = Checkpoint(folder, config)
    context = max_tokens or min(config.max_position_embeddings, DEFAULT_CONTEXT)
    stored_width = DTYPE_BYTES[checkpoint.tensors[MODEL_TENSORS["embed_tokens"].name].dtype]
    plan = plan_memory(config, context, memory, stored_bytes_per_value=stored_width)

    # fp32: each stored tensor is read with plain file I/O into one reused buffer and upcast into
    # memory the model keeps, so the peak is the FP32 model plus the largest stored tensor. A layer's
    # matrices share one allocation, back to back in config.LAYER_TENSORS order (q, k, v, o, gate, up,
    # down): the fast path then multiplies q|k|v and gate|up as one matrix each without copying them.
    # fp32 with the weight cache (weight_cache.py): views of the FP32 file it maps, in that same layout.
    # bf16: zero-copy views of the mapped files.
    cached = load_fp32(checkpoint) if plan.mode == "fp32" else None
    largest = max(info.nbytes for info in checkpoint.tensors.values())
    buffer = allocate((largest,), np.uint8) if plan.mode == "fp32" and cached is None else None

    def matrices(names: list[str]) -> list[np.ndarray]:
        if cached is not None:
            return [cached[name] for name in names]
        if buffer is None:
            return [checkpoint.mapped(name) for name in names]
        shapes = [checkpoint.tensors[name].shape for name in names]
        block, start, kept = allocate((sum(math.prod(shape) for shape in shapes),)), 0, []
        for name, shape in zip(names, shapes):
            end = start + math.prod(shape)
            kept.append(upcast(checkpoint.read(name, buffer), out=block[start:end].reshape(shape)))
            start = end
        return kept

    def vector(name: str) -> np.ndarray:
        return cached[name] if cached is not None else upcast(checkpoint.read(name))   # norms: always FP32

    decoder_layers = []
    for i in range(config.num_hidden_layers):
        names = {key: spec.name.format(i=i) for key, spec in LAYER_TENSORS.items()}
        two_d = [key for key, spec in LAYER_TENSORS.items() if len(spec.shape) == 2]
        weights = {key: vector(name) for key, name in names.items() if key not in two_d}
        weights.update(zip(two_d, matrices([names[key] for key in two_d])))
        decoder_layers.append(LayerWeights(**weights))
    embed_tokens, = matrices([MODEL_TENSORS["embed_tokens"].name])
    lm_head = embed_tokens if config.tie_word_embeddings else matrices([MODEL_TENSORS["lm_head"].name])[0]
    kind = FastQwen3Model if fast else Qwen3Model
    return kind(config, embed_tokens, decoder_layers, vector(MODEL_TENSORS["norm"].name), lm_head, plan)
