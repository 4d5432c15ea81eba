"""What a training step holds at its peak, part by part (training_memory), decided from the config alone as the
inference plan is (memory.py): the weights, gradients and AdamW's moments in FP32, the tape of activations,
the [T, V] rows of the loss, and each moment's transients; measured against the real step in
tests/engine/test_memory.py. `inspect` prints it, `train` checks a run against it, the walkthrough's §10 explains it.
"""

from __future__ import annotations

import math
from typing import Sequence

from ..core.config import LAYER_TENSOR_NAMES, Qwen3Config, expected_tensors, parameter_count
from .memory import ALIASES, held_weight_bytes


# Bytes per activation value the training step keeps, by the format it holds them in. qwen_np's tape is
# FP32 in every precision (NumPy rounds the operands, it keeps FP32 arrays); a GPU run in BF16 or FP16
# keeps 2 bytes. FP8 is counted at 2 too: DeepSeek-V3 caches some linear inputs in FP8 and the rest in
# BF16, so 2 is the upper bound.
ACTIVATION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}

# A step's memory peaks at one of six moments; what is alive then, beyond what it holds throughout
# (TRAINING_HELD: the weights, the frozen base of LoRA, AdamW's moments), by training_memory's names.
# Measured with tracemalloc against the real step in tests/engine/test_memory.py.
TRAINING_HELD = ("frozen_base", "weights", "adamw")
_LOGITS = ("activations", "logits", "logit_gradient", "scaled_logit_gradient")     # alive from the loss to the backward's end
TRAINING_MOMENTS = {
    "forward": ("activations", "logits", "stacked_probabilities"),        # the record stacked into the tape
    "loss": ("activations", "logits", "logit_gradient"),                  # gradients.cross_entropy (in place)
    "head_backward": (*_LOGITS, "piece_gradients", "head_gradient", "rounded_head", "frozen_upcast"),   # the head's
    "layer_backward": (*_LOGITS, "gradients", "piece_gradients", "layer_temporaries",
                       "recomputed_probabilities"),                       # a layer's (the first layer's gradients, at most)
    "backward": (*_LOGITS, "gradients", "piece_gradients", "tied_embedding_gradients"),   # its last: the embedding's
    "update": ("gradients", "adamw_temporaries"),                          # AdamW.update of the largest weight
}
# What rounding an FP32 array to a precision's values allocates at its peak, in copies of the array (the
# copy it returns and the integer codes on the way: mixed.operands, measured with tracemalloc).
ROUNDING_COPIES = {"fp32": 0.0, "bf16": 3.0, "fp16": 1.5, "fp8": 3.25}


def training_memory(config: Qwen3Config, rows: int, context: int, recompute: bool = False,
                    activations: str = "fp32", lora_rank: int = 0, lora_targets: Sequence[str] = (),
                    frozen: str = "fp32", micro_batches: int = 1, shards: int = 1, threads: int = 1,
                    precision: str = "fp32", loss_scaling: bool = False) -> dict[str, int]:
    """Bytes a training step holds at its peak, part by part, for `rows` sequences of `context` tokens at
    once (a micro-batch: --batch-size / --grad-accum), cut into `shards` pieces computed `threads` at a time
    (step.loss_and_accumulated_gradients). training_total adds them up: what the step holds throughout
    (TRAINING_HELD) and the largest of its moments (TRAINING_MOMENTS); training_peak names that moment.

    The "weights", AdamW's two moments ("adamw") and the step's "gradients" are FP32 in every precision.
    "activations" (the tape): per token per layer gradients.LayerTape's arrays: 4 D-wide (x, h, x_mid, h_mlp),
    q before and after norm+RoPE and the mixed heads (3 H*Dh), k before and after, v (3 KVH*Dh), gate, up
    (2 F) and the attention probabilities, H x T per token (`attention_probabilities`: they grow with the
    context, so at long contexts they dominate); plus the final norm's input and output (2 D). recompute: only
    each layer's input (D) is kept, and one layer's activations at a time in the backward. activations: the
    format the tape is held in (ACTIVATION_BYTES). The [T, V] rows stay FP32 in every precision, as the loss
    is: the "logits" and their gradient ("logit_gradient", the cross-entropy's shifted logits turned into it in
    place), alive from the loss to the backward's end, and with FP16's loss scaling (loss_scaling) the scaled
    gradient ("scaled_logit_gradient").
    The transient copies, each at its moment: "stacked_probabilities", every kept layer's probabilities
    stacked [B, H, T, T] while the forward's record still holds them per sequence (with recompute
    "recomputed_probabilities", one layer's, in the backward); at the backward's start the LM head's gradient
    ("head_gradient", before the layers' exist) and, in a mixed `precision` (mixed.PRECISIONS), its weight
    and the logits' gradient rounded for the input gradient's product ("rounded_head", the rounding's
    integer codes included: ROUNDING_COPIES); a tied model's "tied_embedding_gradients" at the backward's
    end, the embedding's scattered gradient and the head's, [V, D] each, alive while they are added into the
    table's one gradient; "layer_temporaries", a layer's backward's own arrays, the larger of its MLP's
    (silu(gate), its product with up, and the three gradients of the [T, F] steps: 5 F a token) and its
    attention's (softmax's backward: the probabilities' gradient, the scores' and a product, 3 H x T a
    token, and the repeated keys and values and their gradients, 5 H*Dh), counted with every layer's
    gradients (an upper bound: the layers below have none yet); "adamw_temporaries", the two arrays like
    the largest weight that AdamW.update's expressions make. The layers' rounded operands (mixed precision)
    are one matrix at a time, below these.
    Pieces computed at once (min(shards, threads)) each hold their own tape, gradients and transients, and
    while an earlier piece's or micro-batch's gradient is kept to add into, the backward holds one set more
    ("piece_gradients"): an upper bound, as the pieces' threads do not reach their peaks at the same instant.
    But for one moment: the pieces reach their backward's end one after another, so a tied model's embedding
    gradients there are one piece's (counted for each, the plan was 20% over the peak RSS of a full step on 2
    threads: bench/README.md, "The training memory plan").
    lora_rank (LoRA, with lora_targets: the projections adapted): only the adapters have FP32 weights,
    gradients and AdamW moments; the frozen base is held as `frozen` says (a MODES name) with no gradient
    nor moments ("frozen_base"); a base not held in FP32 is widened whole, one matrix at a time, for the
    backward's input gradients: the LM head's [V, D] the largest ("frozen_upcast"). The tape is the same:
    the adapters' rank-r products are recomputed in the backward, and dropout's masks are drawn again
    there, never kept.
    """
    D, F, H, KVH, Dh, V, L = (config.hidden_size, config.intermediate_size, config.num_attention_heads,
                              config.num_key_value_heads, config.head_dim, config.vocab_size,
                              config.num_hidden_layers)
    at_once = max(1, min(shards, threads))
    tokens = rows * at_once // max(1, shards) * context                 # the tokens of the pieces alive at once
    layer_tape = 4 * D + 3 * H * Dh + 3 * KVH * Dh + 2 * F + H * context    # values per token and layer
    kept = L * D + layer_tape - D if recompute else L * layer_tape           # LayerTape.x is the saved input
    per_token = ACTIVATION_BYTES[activations] * (kept + 2 * D)
    row = 4 * V * tokens                                                     # one FP32 [T, V] array
    probabilities = 4 * H * context * tokens                                 # one layer's [B, H, T, T]
    table = 4 * V * D                                                        # one FP32 [V, D] array
    params = parameter_count(config)
    shapes = expected_tensors(config)
    largest = max(math.prod(shape) for shape in shapes.values())                # values of one weight
    held = {}
    if lora_rank:
        params = lora_parameters(config, lora_rank, lora_targets)
        largest = lora_rank * max((max(shapes[LAYER_TENSOR_NAMES[key].format(i=0)]) for key in lora_targets), default=0)
        held = {"frozen_base": held_weight_bytes(config, frozen)}
    widened = lora_rank > 0 and ALIASES.get(frozen, frozen) != "fp32"    # a stored frozen head is upcast, not rounded
    rounding = 0.0 if widened else ROUNDING_COPIES[precision]
    again = micro_batches > 1 or shards > at_once                         # an earlier piece's gradient to add into
    parts = {"activations": per_token * tokens, "logits": row, "logit_gradient": row,
             "scaled_logit_gradient": row if loss_scaling else 0,
             "stacked_probabilities": 0 if recompute else L * probabilities,
             "recomputed_probabilities": probabilities if recompute else 0,
             "layer_temporaries": 4 * tokens * max(5 * F, 3 * H * context + 5 * H * Dh),
             "head_gradient": 0 if lora_rank else at_once * table,
             "rounded_head": int(max(rounding * row, row + at_once * rounding * table)) if rounding else 0,
             "frozen_upcast": at_once * table if widened else 0,
             "tied_embedding_gradients": 2 * table if config.tie_word_embeddings and not lora_rank else 0,
             "piece_gradients": 4 * params * (at_once - 1 + again), "adamw_temporaries": 2 * 4 * largest}
    return {**held, "weights": 4 * params, "gradients": 4 * params, "adamw": 8 * params,
            "activations_per_token": per_token, **{name: value for name, value in parts.items() if value}}


def lora_parameters(config: Qwen3Config, rank: int, targets: Sequence[str]) -> int:
    """The trained values of rank-r LoRA adapters on `targets` of every layer: r (in + out) a projection."""
    shapes = expected_tensors(config)
    return config.num_hidden_layers * sum(rank * sum(shapes[LAYER_TENSOR_NAMES[key].format(i=0)]) for key in targets)


def attention_probabilities(config: Qwen3Config, rows: int, context: int, recompute: bool = False,
                            activations: str = "fp32") -> int:
    """The bytes of training_memory's activations that are attention's probabilities: [H, T, T] per
    sequence and layer kept (one layer with recompute), quadratic in the context."""
    layers = 1 if recompute else config.num_hidden_layers
    return ACTIVATION_BYTES[activations] * layers * config.num_attention_heads * context * context * rows


def training_moments(estimate: dict[str, int]) -> dict[str, int]:
    """The bytes of a training_memory estimate at each moment of the step (TRAINING_MOMENTS): what is held
    throughout and what that moment has alive."""
    held = sum(estimate.get(name, 0) for name in TRAINING_HELD)
    return {moment: held + sum(estimate.get(name, 0) for name in names) for moment, names in TRAINING_MOMENTS.items()}


def training_peak(estimate: dict[str, int]) -> str:
    """The moment of the step (a TRAINING_MOMENTS name) at which a training_memory estimate peaks."""
    moments = training_moments(estimate)
    return max(moments, key=moments.__getitem__)


def training_total(estimate: dict[str, int]) -> int:
    """The bytes of a training_memory estimate at its peak: what is held throughout and the largest moment's
    parts (the other moments' transients are gone by then; its per-token figure is a rate, not a part)."""
    return max(training_moments(estimate).values())


def training_remedies(config: Qwen3Config, batch: int, context: int) -> dict[str, dict[str, int]]:
    """The estimate of a step of `batch` sequences, and with each remedy that cuts its activations:
    a quarter of the batch (a different, noisier update), the tape in BF16 (a GPU run; qwen_np's
    tape stays FP32), --grad-accum 4 (the same update in 4 passes of a quarter, which keeps one more set
    of gradients to add into), --recompute, and all three together. Each: the estimate's parts and
    "total"; weights, gradients and AdamW never change."""
    quarter = max(1, batch // 4)
    variants = {"baseline": training_memory(config, batch, context),
                "quarter_batch": training_memory(config, quarter, context),
                "bf16_activations": training_memory(config, batch, context, activations="bf16"),
                "grad_accum_4": training_memory(config, quarter, context, micro_batches=4),
                "recompute": training_memory(config, batch, context, recompute=True),
                "all_three": training_memory(config, quarter, context, recompute=True, activations="bf16",
                                             micro_batches=4)}
    return {name: {**estimate, "total": training_total(estimate)} for name, estimate in variants.items()}
