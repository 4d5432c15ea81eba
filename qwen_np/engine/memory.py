"""The memory plan: decided from the config alone, before a single weight is allocated.

Weights stay resident in FP32 when they fit with margin (fastest: no conversion per token).
Otherwise they stay in their stored 2-byte format, memory-mapped from the checkpoint, and are
upcast block by block as each matmul uses them (Qwen3-8B: 30.5 GiB FP32 vs 15.3 GiB BF16).
Asked for explicitly, "int8" quantizes every matrix once at load to int8 codes with one FP32 scale
per row (7.6 GiB for Qwen3-8B); unlike the other two it changes the logits (a little: see
`python -m qwen_np precision`), so "auto" never picks it.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..core.defaults import MODES   # defined there for --help, which loads no NumPy
from ..core.config import LAYER_TENSOR_NAMES, Qwen3Config, expected_tensors, parameter_count, tensor_shapes
from ..errors import QwenNPError
from ..numbers.formats import HELD_FORMATS, storage_bytes
from .budget import PREFILL_CHUNK
from .runtime import peak_rss_bytes

GiB = 1024 ** 3
# Other names for a mode: "stored" says what "bf16" does whatever the file holds (BF16, F16, or a GGUF's
# quantized blocks: kept as they are and widened on use); the plan is the "bf16" one.
ALIASES = {"stored": "bf16"}
SAFETY_FRACTION = 0.85   # leave room for the OS, the page cache of the BF16 path and Python itself


def available_memory() -> int:
    """Bytes this process can still use: the kernel's MemAvailable (or physical RAM), and no more
    than a container's cgroup limit leaves (a container sees the host's MemAvailable)."""
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        pass
    room = _cgroup_room()
    return available if room >= available else int(room)


def _cgroup_room() -> int | float:
    """memory.max - memory.current of this process's cgroup (v2), or infinity when unlimited."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return math.inf
    return math.inf if limit == "max" else max(int(limit) - used, 0)


@dataclass
class ResidentPeak:
    """This process's resident memory from a moment on: the RSS then (`start`) and the most since (`peak`).

    Linux's high-water mark (VmHWM in /proc/self/status) is restarted at that moment (writing 5 to
    /proc/self/clear_refs), so an earlier peak (a tokenizer's parse, say) is not taken for the one watched.
    Where that is not possible (not Linux) `peak` is runtime.peak_rss_bytes, the process's whole-life peak,
    and `restarted` says so."""

    start: int
    restarted: bool

    @classmethod
    def begin(cls) -> "ResidentPeak":
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            restarted = True
        except OSError:
            restarted = False
        return cls(_status_bytes("VmRSS") or peak_rss_bytes(), restarted)

    @property
    def peak(self) -> int:
        return (_status_bytes("VmHWM") if self.restarted else None) or peak_rss_bytes()


def _status_bytes(field: str) -> int | None:
    """A memory field of /proc/self/status (VmRSS, VmHWM) in bytes; None where there is no such file."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
    except (OSError, StopIteration, ValueError):
        return None


def kv_cache_bytes_per_token(config: Qwen3Config, bytes_per_value: int = 4) -> int:
    """Keys and values of every layer for one position (qwen_np keeps them in FP32: 4 bytes)."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * bytes_per_value


def working_bytes(config: Qwen3Config, max_tokens: int, chunk: int = PREFILL_CHUNK) -> int:
    """Rough peak of activations for a prefill chunk: logits, MLP activations, attention scores."""
    T = min(chunk, max_tokens)
    logits = T * config.vocab_size * 4
    mlp = 3 * T * config.intermediate_size * 4
    scores = 2 * config.num_attention_heads * T * max_tokens * 4
    return logits + mlp + scores + 8 * T * config.hidden_size * 4


@dataclass(frozen=True)
class MemoryPlan:
    """How the weights will be held, and what every part costs in bytes."""

    mode: str                  # "fp32" (upcast once at load), "bf16" (stored format, upcast per use), "int8",
                               # "q8_0" or "q4_0" (quantized once at load)
    weight_bytes: dict[str, int]   # the weights' bytes in every mode (quantized: matrices with their scales, norms FP32)
    kv_cache_bytes: int
    working_bytes: int
    available_bytes: int
    max_tokens: int

    @property
    def fp32_weight_bytes(self) -> int:
        return self.weight_bytes["fp32"]

    @property
    def stored_weight_bytes(self) -> int:
        return self.weight_bytes["bf16"]

    @property
    def int8_weight_bytes(self) -> int:
        return self.weight_bytes["int8"]

    @property
    def held_weight_bytes(self) -> int:
        """The weights as this plan holds them."""
        return self.weight_bytes[self.mode]

    @property
    def total_bytes(self) -> int:
        return self.held_weight_bytes + self.kv_cache_bytes + self.working_bytes

    @property
    def room_for_kv_cache(self) -> int:
        """Bytes a server's KV cache may take when not told: the available RAM with the safety margin, less
        the weights and working buffers (can be negative: nothing is left)."""
        return int(self.available_bytes * SAFETY_FRACTION) - self.held_weight_bytes - self.working_bytes

    @property
    def fits(self) -> bool:
        """Whether it fits in the available RAM with the safety margin."""
        return self.total_bytes <= self.available_bytes * SAFETY_FRACTION

    def describe(self) -> str:
        rows = [
            ("weights FP32", self.fp32_weight_bytes), ("weights as stored", self.stored_weight_bytes),
            ("weights int8 (+ FP32 row scales)", self.int8_weight_bytes),
            *((f"weights {fmt} (+ FP16 block scales)", self.weight_bytes[fmt]) for fmt in HELD_FORMATS),
            (f"KV cache ({self.max_tokens} tokens, FP32)", self.kv_cache_bytes),
            ("working buffers", self.working_bytes), ("available RAM", self.available_bytes),
        ]
        lines = [f"  {label:<34} {n / GiB:8.2f} GiB" for label, n in rows]
        how = {"fp32": "weights upcast to FP32 once, at load",
               "bf16": "weights memory-mapped as stored, upcast block by block on use",
               "int8": "weights quantized to int8 rows once, at load; codes cast block by block on use",
               **{fmt: f"weights quantized to llama.cpp's {fmt} blocks once, at load; dequantized block by block on use"
                  for fmt in HELD_FORMATS}}[self.mode]
        return "\n".join([f"memory plan: {self.mode} ({how}); needs {self.total_bytes / GiB:.2f} GiB", *lines])


def candidate_plans(config: Qwen3Config, max_tokens: int, stored_bytes_per_value: float = 2,
                    available: int | None = None) -> dict[str, MemoryPlan]:
    """Every way to hold the model (MODES but auto), costed for this machine (nothing chosen yet)."""
    params = parameter_count(config)
    weights = {"fp32": 4 * params, "bf16": int(stored_bytes_per_value * params), "int8": int8_weight_bytes(config),
               **{fmt: weight_bytes(config, fmt) for fmt in HELD_FORMATS}}
    available = available_memory() if available is None else available
    return {mode: MemoryPlan(mode, weights, max_tokens * kv_cache_bytes_per_token(config),
                             working_bytes(config, max_tokens), available, max_tokens) for mode in weights}


def weight_bytes(config: Qwen3Config, fmt: str) -> int:
    """Bytes of a model's weights with every matrix in `fmt` (its scales included) and the norms in FP32."""
    return sum((storage_bytes(shape, fmt) if len(shape) == 2 else 4 * shape[0]) * count
               for shape, count in tensor_shapes(config))


def int8_weight_bytes(config: Qwen3Config) -> int:
    """Bytes of the weights in the int8 mode: each matrix as int8 codes + one FP32 scale per row, norms FP32."""
    return weight_bytes(config, "int8")


def plan_memory(config: Qwen3Config, max_tokens: int, requested: str = "auto",
                stored_bytes_per_value: float = 2, available: int | None = None) -> MemoryPlan:
    """Choose fp32, bf16 or int8 residency before anything is loaded. A plan that would not fit in RAM is a
    QwenNPError now, not an out-of-memory kill later: "auto" falls back from fp32 to bf16 and fails
    only when even the stored weights do not fit; an explicit mode fails if it does not fit."""
    if requested not in MODES:
        raise QwenNPError(f"expected one of {', '.join(MODES)}, got {requested!r}", "memory")
    requested = ALIASES.get(requested, requested)
    plans = candidate_plans(config, max_tokens, stored_bytes_per_value, available)
    fp32, stored, int8 = plans["fp32"], plans["bf16"], plans["int8"]
    plan = plans[requested] if requested != "auto" else fp32 if fp32.fits else stored
    if not plan.fits:
        advice = ("use bf16 (weights kept as stored)" if plan is fp32 and stored.fits
                  else "use int8 (8-bit weights, about half of bf16; the logits change slightly)"
                  if plan is not int8 and int8.fits else "try a smaller model or a shorter context")
        raise QwenNPError(f"the {plan.mode} plan needs {plan.total_bytes / GiB:.1f} GiB (weights, KV cache for "
                          f"{max_tokens} tokens, buffers) but only {plan.available_bytes / GiB:.1f} GiB is available; "
                          f"{advice}", "memory")
    return plan


# Bytes per activation value the training step keeps, by the format it holds them in. qwen_np's tape is
# FP32 in every precision (NumPy rounds the operands, it keeps FP32 arrays); a GPU run in BF16 or FP16
# keeps 2 bytes. FP8 is counted at 2 too: DeepSeek-V3 caches some linear inputs in FP8 and the rest in
# BF16, so 2 is the upper bound.
ACTIVATION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}

# A step's memory peaks at one of six moments; what is alive then, beyond what it holds throughout
# (TRAINING_HELD: the weights, the frozen base of LoRA, AdamW's moments), by training_memory's names.
# Measured with tracemalloc against the real step in tests/test_memory.py.
TRAINING_HELD = ("frozen_base", "weights", "adamw")
_LOGITS = ("activations", "logits", "logit_gradient", "scaled_logit_gradient")     # alive from the loss to the backward's end
TRAINING_MOMENTS = {
    "forward": ("activations", "logits", "stacked_probabilities"),        # the record stacked into the tape
    "loss": ("activations", "logits", "logit_gradient", "loss_temporaries"),   # gradients.cross_entropy
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
    is: the "logits" and their gradient ("logit_gradient"), alive from the loss to the backward's end, the
    cross-entropy's shifted logits and exponentials ("loss_temporaries"), and with FP16's loss scaling
    (loss_scaling) the scaled gradient ("scaled_logit_gradient").
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
    parts = {"activations": per_token * tokens, "logits": row, "logit_gradient": row, "loss_temporaries": 2 * row,
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


def held_weight_bytes(config: Qwen3Config, mode: str, stored_bytes_per_value: float = 2) -> int:
    """The weights' bytes as a memory mode (MODES but auto) holds them: candidate_plans' figure, from the config."""
    return candidate_plans(config, 1, stored_bytes_per_value, available=0)[ALIASES.get(mode, mode)].held_weight_bytes


# Units of a size (serve's --kv-memory 512MiB): binary (KiB = 1024) and decimal (KB = 1000), as written
# by people; hand-written (a regex and a table): no library in our dependencies reads them.
SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1024 ** 2, "mb": 1000 ** 2, "mib": 1024 ** 2,
              "g": GiB, "gb": 1000 ** 3, "gib": GiB, "t": 1024 ** 4, "tb": 1000 ** 4, "tib": 1024 ** 4}
SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_size(text: str, param: str) -> int:
    """Bytes in a size such as "512MiB", "2GiB", "1.5GB" or "4096" (bytes); a QwenNPError about `param` (the
    caller's parameter the text came from, e.g. "kv_memory") if it is not one."""
    match = SIZE.fullmatch(text)
    unit = match[2].lower() if match else ""
    if match is None or unit not in SIZE_UNITS:
        raise QwenNPError(f"expected a size such as 512MiB or 2GiB, got {text!r}", param)
    return int(float(match[1]) * SIZE_UNITS[unit])


def format_size(n: int) -> str:
    """Bytes in the largest binary unit that keeps a number >= 1: "512.0 MiB", "2.00 GiB"."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2 ** 20:.1f} MiB"


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
