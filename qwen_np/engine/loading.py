"""load_model: a model's files (a checkpoint folder, a GGUF file or a hub id; files/ tells them apart and
answers for either) -> a Qwen3Model, its weights held as the memory plan says (one entry of MATRICES a
memory mode), and attach_adapter."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import numpy as np

from ..core.adapters import Adapter
from ..core.config import LAYER_MATRICES, MODEL_TENSORS, layer_tensors
from .fast import FastQwen3Model
from ..numbers.names import HELD_FORMATS
from ..numbers.formats import FormatRows, get_format, quantize_int8_rows
from .budget import context_for
from .memory import plan_memory
from ..core.ablations import model_class
from ..core.model import Qwen3Model, layer_weights
from ..numbers.numerics import PANEL, Int8Rows, Panels, Weight, panel_shape, panels, upcast
from . import runtime
from .runtime import allocate, split, threads
from .weight_cache import load_fp32
from ..files.checkpoint import Checkpoint
from ..files.model_files import ModelFiles, open_model

# Rows quantized at a time in the int8 mode: the FP32 copy of a whole large tensor (Qwen3-8B's
# embedding table: 2.5 GB) never exists, only this many of its rows.
QUANTIZE_BLOCK_ROWS = 1024


def load_model(path: str | Path | ModelFiles, memory: str = "auto", max_tokens: int | None = None,
               fast: bool = True, kv_dtype: str = "fp32") -> Qwen3Model:
    """Load a Qwen3 checkpoint folder, GGUF file (gguf_file.py) or hub id for inference.

    memory: "fp32" upcasts every weight once; "bf16" (or its other name "stored") keeps the stored
    weights memory-mapped and upcasts them block by block on use (a GGUF's quantized tensors as their
    blocks: formats.FormatRows, ggml_blocks.BlockRows); "int8" quantizes every matrix once to int8
    codes with an FP32 scale per row (formats.quantize_int8_rows; norm weights stay FP32; from a GGUF,
    its blocks are widened and requantized), which changes the logits slightly; "q8_0" and "q4_0"
    quantize every matrix once to llama.cpp's blocks of 32 (formats.FormatRows, bit for bit as
    gguf's quantizers); "auto" picks fp32 when it fits in RAM with margin, else bf16. fp32 asked
    for by name holds plain [out, in] arrays (what training updates in place); fp32 chosen by "auto"
    for a fast model holds them as numerics.Panels (the same values in the layout in which a few
    rows' product costs about one row's) where BLAS has a small-matrix kernel (OpenBLAS's SkylakeX
    one; not Haswell's).
    max_tokens: the context the memory plan reserves KV cache for (default min(config, 4096)), stored as
    `kv_dtype` (kv_cache.KV_DTYPES: its bytes per position, int8's scales included).
    fast: a FastQwen3Model (qwen_np/engine/fast.py: same logits, tuned for speed; a Qwen3 only: an ablation's
    checkpoint, config.ABLATION_CHOICES, always loads readable); False gives the readable
    Qwen3Model, every call on model.py's code.
    """
    checkpoint = open_model(path).checkpoint()
    config = checkpoint.config
    plan = plan_memory(config, context_for(config, max_tokens), memory,
                       stored_bytes_per_value=checkpoint.held_bytes_per_value(), kv_dtype=kv_dtype)
    # "auto" holding FP32 in a fast model, where BLAS has a small-matrix kernel: every matrix whose
    # rows split into whole panels is held as numerics.Panels, the layout in which a product of a few
    # rows (a batch's decode step, a speculative check) costs about one row's. Without that kernel
    # (OpenBLAS's Haswell one) a panel's few-row product is a packing GEMM, slower than GEMVs over W's
    # rows (bench/README.md, "Panels"). memory="fp32" by name keeps plain [out, in] arrays: what
    # training updates in place and the precision lab rounds.
    panel_layout = fast and memory == "auto" and plan.mode == "fp32" and runtime.blas_has_small_matrix_kernel()
    weights = Holding(checkpoint, plan.mode, "panels" if panel_layout else "rows")

    decoder_layers = []
    for i in range(config.num_hidden_layers):
        # An ablation's layer has fewer tensors; a sparse one (Qwen3-MoE) its router and experts for the dense MLP.
        names = {key: spec.name.format(i=i) for key, spec in layer_tensors(config, i).items()}
        held = [key for key in names if key in LAYER_MATRICES or key == "router" or key.startswith("experts.")]
        layer: dict[str, Weight] = {key: weights.vector(name) for key, name in names.items() if key not in held}
        layer.update(zip(held, weights.matrices([names[key] for key in held])))
        decoder_layers.append(layer_weights(layer))
    embed_tokens, = weights.matrices([MODEL_TENSORS["embed_tokens"].name])
    # An untied checkpoint without lm_head.weight (a bare Qwen3Model: Qwen3-Embedding) loads without a head.
    head = MODEL_TENSORS["lm_head"].name
    lm_head = (embed_tokens if config.tie_word_embeddings else
               weights.matrices([head])[0] if head in checkpoint.tensors else None)
    kind = FastQwen3Model if fast and not config.ablations else model_class(config)   # an ablation: readable
    return kind(config, embed_tokens, decoder_layers, weights.vector(MODEL_TENSORS["norm"].name), lm_head, plan)


class Holding:
    """A checkpoint's tensors as one memory mode holds them: `matrices` by the mode's entry of MATRICES,
    `vector` (the norms) always FP32.

    fp32 and the converting modes (int8, q8_0, q4_0): each stored tensor is read with plain file I/O into
    one reused buffer and upcast (or quantized) into memory the model keeps, so the peak is the model plus
    the largest stored tensor; a checkpoint whose source() gives views of its file (a GGUF's blocks) is
    quantized from them, with no buffer. A layer's matrices share one allocation, back to back in
    config.LAYER_TENSORS order (q, k, v, o, gate, up, down): the fast path then multiplies q|k|v and
    gate|up as one matrix each without copying them (int8: the codes share one allocation, the scales
    another). fp32 with the weight cache (weight_cache.py): views of the FP32 file it maps, in that same
    layout. bf16: zero-copy views of the mapped files (Checkpoint.held).
    """

    def __init__(self, checkpoint: Checkpoint, mode: str, layout: str) -> None:
        self.checkpoint, self.mode, self.layout = checkpoint, mode, layout
        self.cached = load_fp32(checkpoint, layout) if mode == "fp32" and checkpoint.cacheable else None
        converting = mode == "int8" or mode in HELD_FORMATS
        reads = (converting and not checkpoint.source_views) or (mode == "fp32" and self.cached is None)
        largest = max(info.nbytes for info in checkpoint.tensors.values())
        self.buffer = allocate((largest,), np.uint8) if reads else None

    def matrices(self, names: list[str]) -> list[Weight]:
        """These matrices (one layer's, or the embedding table) as the mode holds them."""
        return MATRICES[self.mode](self, names)

    def vector(self, name: str) -> np.ndarray:
        return self.cached[name] if self.cached is not None else upcast(self.checkpoint.read(name))

    def source(self, name: str) -> Weight:
        """Tensor `name` as a converting mode reads it (Checkpoint.source)."""
        return self.checkpoint.source(name, self.buffer)

    def shapes(self, names: list[str]) -> list[tuple[int, ...]]:
        return [self.checkpoint.tensors[name].shape for name in names]


def _fp32(weights: Holding, names: list[str]) -> list[Weight]:
    if weights.cached is not None:
        return [Panels(weights.cached[name]) if weights.cached[name].ndim == 3 else weights.cached[name]
                for name in names]
    return [fp32_matrix(weights.checkpoint.read(name, weights.buffer), kept, weights.layout)
            for name, kept in zip(names, back_to_back(weights.shapes(names), np.float32))]


def _stored(weights: Holding, names: list[str]) -> list[Weight]:
    if weights.checkpoint.held_copies:
        # Repacking copies each tensor (gguf_file.REPACK_BUDGET): a layer's on every core, so their fresh
        # pages fault in at once (Qwen3-8B Q4_K_M: 12.7 s against 15.5-18.8 on one thread).
        return runtime.independent_jobs(weights.checkpoint.held, names)
    return [weights.checkpoint.held(name) for name in names]


def _int8(weights: Holding, names: list[str]) -> list[Weight]:
    shapes = weights.shapes(names)
    codes, scales = back_to_back(shapes, np.int8), back_to_back([shape[:1] for shape in shapes], np.float32)
    for name, q, scale in zip(names, codes, scales):
        quantize_int8_into(weights.source(name), q, scale)
        weights.checkpoint.release(name)           # converted: its file's pages need not stay resident
    return [Int8Rows(q, scale) for q, scale in zip(codes, scales)]


def _blocks(weights: Holding, names: list[str]) -> list[Weight]:
    blocks: list[Weight] = []
    for name in names:
        blocks.append(quantize_blocks(weights.source(name), weights.mode))
        weights.checkpoint.release(name)
    return blocks


# Each memory mode's way to hold a layer's matrices (memory.MODES but "auto", and the "stored" alias: the plan
# names the mode it chose).
MATRICES: dict[str, Callable[[Holding, list[str]], list[Weight]]] = {
    "fp32": _fp32, "bf16": _stored, "int8": _int8, **{fmt: _blocks for fmt in HELD_FORMATS}}


def attach_adapter(model: Qwen3Model, adapter: Adapter) -> None:
    """Apply a LoRA adapter to every forward pass of `model` without merging it (generate/chat --lora): each
    projection it adapts becomes an Adapted weight around the model's own, in place; the base's arrays stay
    as they are, whatever kind holds them (FP32, BF16, int8, a block format), and the fast path multiplies
    them as before, adding the adapter's thin products after (fast._add_adapters)."""
    for i, layer in enumerate(model.layers):
        for key in LAYER_MATRICES:
            adapted = adapter.adapted(i, key, getattr(layer, key))
            if adapted is not None:
                setattr(layer, key, adapted)


def fp32_matrix(stored: np.ndarray, out: np.ndarray, layout: str) -> Weight:
    """A stored matrix upcast into `out` (its shape): as Panels (a view of the same memory) when the
    layout is "panels" and its rows split into whole panels, else as a plain array."""
    shape = panel_shape(stored.shape)
    if layout == "panels" and shape is not None:      # NumPy's transposing copy runs ~1.3 GB/s a thread
        values = out.reshape(shape)
        split(shape[0], threads(), lambda p: panels(stored[p.start * PANEL:p.stop * PANEL], out=values[p]))
        return Panels(values)
    return upcast(stored, out=out)


def back_to_back(shapes: list[tuple[int, ...]], dtype: type = np.float32) -> list[np.ndarray]:
    """Arrays of these shapes carved one after another out of one new allocation: consecutive ones are
    one matrix to the fast path (fast.back_to_back_view, a view of this memory)."""
    block, start, arrays = allocate((sum(math.prod(shape) for shape in shapes),), dtype), 0, []
    for shape in shapes:
        arrays.append(block[start:start + math.prod(shape)].reshape(shape))
        start += math.prod(shape)
    return arrays


def quantize_blocks(stored: Weight, fmt: str) -> FormatRows:
    """A stored matrix [out, in] quantized to a block format (formats.HELD_FORMATS), a block of rows at a
    time into parts allocated once (their per-row shapes from quantizing the first row): rows are
    independent, so the parts equal quantizing the whole matrix at once; split between the threads."""
    quantize = get_format(fmt).quantize
    sample = quantize(upcast(stored[:1]))
    parts = tuple(np.empty((stored.shape[0], *part.shape[1:]), part.dtype) for part in sample)

    def fill(part: slice) -> None:
        for start in range(part.start, part.stop, QUANTIZE_BLOCK_ROWS):
            rows = slice(start, min(start + QUANTIZE_BLOCK_ROWS, part.stop))
            for kept, made in zip(parts, quantize(upcast(stored[rows]))):
                kept[rows] = made

    split(stored.shape[0], threads(), fill)
    return FormatRows(fmt, parts, stored.shape[1])


def quantize_int8_into(stored: Weight, codes: np.ndarray, scale: np.ndarray) -> None:
    """formats.quantize_int8_rows of a stored matrix [out, in] (any dtype or weight kind numerics.upcast reads) into
    codes [out, in] and scale [out], a block of rows at a time: rows are independent, so the result
    is the same as quantizing the whole matrix at once. The rows are split between runtime.threads()
    threads (NumPy's loops are single-threaded and release the GIL), each taking blocks of its part."""
    def quantize(part: slice) -> None:
        for start in range(part.start, part.stop, QUANTIZE_BLOCK_ROWS):
            rows = slice(start, min(start + QUANTIZE_BLOCK_ROWS, part.stop))
            codes[rows], scale[rows] = quantize_int8_rows(upcast(stored[rows]))

    split(stored.shape[0], threads(), quantize)
