"""The memory plan of inference: decided from the config alone, before a single weight is allocated.

Weights stay resident in FP32 when they fit with margin (fastest: no conversion per token).
Otherwise they stay in their stored 2-byte format, memory-mapped from the checkpoint, and are
upcast block by block as each matmul uses them (Qwen3-8B: 30.5 GiB FP32 vs 15.3 GiB BF16).
Asked for explicitly, "int8" quantizes every matrix once at load to int8 codes with one FP32 scale
per row (7.6 GiB for Qwen3-8B); unlike the other two it changes the logits (a little: see
`python -m qwen_np precision`), so "auto" never picks it.

What a training step holds is step_memory.py's; the room this machine has, available_memory.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from ..core.defaults import MODES   # defined there for --help, which loads no NumPy
from ..core.config import Qwen3Config, parameter_count, tensor_shapes
from ..core.kv_cache import kv_position_bytes
from ..errors import QwenNPError
from ..numbers.names import HELD_FORMATS
from ..numbers.formats import storage_bytes
from .budget import PREFILL_CHUNK
from .sizes import GiB

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
    kv_dtype: str = "fp32"     # how the KV cache stores keys and values (kv_cache.KV_DTYPES): kv_cache_bytes' width

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
            (f"KV cache ({self.max_tokens} tokens, {self.kv_dtype.upper()})", self.kv_cache_bytes),
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
                    available: int | None = None, kv_dtype: str = "fp32") -> dict[str, MemoryPlan]:
    """Every way to hold the model (MODES but auto), costed for this machine (nothing chosen yet), with a KV
    cache of max_tokens positions stored as `kv_dtype`."""
    params = parameter_count(config)
    weights = {"fp32": 4 * params, "bf16": int(stored_bytes_per_value * params), "int8": int8_weight_bytes(config),
               **{fmt: weight_bytes(config, fmt) for fmt in HELD_FORMATS}}
    available = available_memory() if available is None else available
    return {mode: MemoryPlan(mode, weights, max_tokens * kv_position_bytes(config, kv_dtype),
                             working_bytes(config, max_tokens), available, max_tokens, kv_dtype) for mode in weights}


def weight_bytes(config: Qwen3Config, fmt: str) -> int:
    """Bytes of a model's weights with every matrix in `fmt` (its scales included) and the norms in FP32."""
    return sum((storage_bytes(shape, fmt) if len(shape) == 2 else 4 * shape[0]) * count
               for shape, count in tensor_shapes(config))


def int8_weight_bytes(config: Qwen3Config) -> int:
    """Bytes of the weights in the int8 mode: each matrix as int8 codes + one FP32 scale per row, norms FP32."""
    return weight_bytes(config, "int8")


def plan_memory(config: Qwen3Config, max_tokens: int, requested: str = "auto",
                stored_bytes_per_value: float = 2, available: int | None = None, kv_dtype: str = "fp32") -> MemoryPlan:
    """Choose fp32, bf16 or int8 residency before anything is loaded. A plan that would not fit in RAM is a
    QwenNPError now, not an out-of-memory kill later: "auto" falls back from fp32 to bf16 and fails
    only when even the stored weights do not fit; an explicit mode fails if it does not fit."""
    if requested not in MODES:
        raise QwenNPError(f"expected one of {', '.join(MODES)}, got {requested!r}", "memory")
    requested = ALIASES.get(requested, requested)
    plans = candidate_plans(config, max_tokens, stored_bytes_per_value, available, kv_dtype)
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


def held_weight_bytes(config: Qwen3Config, mode: str, stored_bytes_per_value: float = 2) -> int:
    """The weights' bytes as a memory mode (MODES but auto) holds them: candidate_plans' figure, from the config."""
    return candidate_plans(config, 1, stored_bytes_per_value, available=0)[ALIASES.get(mode, mode)].held_weight_bytes
