"""qwen_np: the Qwen3 dense decoder in pure NumPy, exact to transformers' Qwen3ForCausalLM in FP32.

The package by concern, from what a student reads first to what a user types (imports run one way,
down this list's reverse: commands may import everything, numbers nothing of qwen_np but errors):

    core/        Qwen3 itself: config, layers (the math), model (the network), kv_cache, sampling
    numbers/     weight kinds (numerics) and number formats (formats)
    files/       checkpoints, GGUF files, the tokenizer and chat template, one opened model's files
    engine/      running it fast: threads, the memory plan, the fast twin, load_model
    generation/  the decode loop, speculative decoding, continuous batching, constrained decoding,
                 log-probabilities, tool calls, embeddings
    training/    the backward pass, a training step, runs, data, evaluation
    precision/   the precision lab and its KL statistics
    inspection/  shapes, traces, lens, attention views, the machine's topology and bandwidth
    exercises/   the walkthrough's graded exercises: stubs, checks, reference solutions
    serving/     the OpenAI-compatible HTTP API and the web explorer
    commands/    the CLI, one module per command (cli.py assembles them)

The public names below are imported when first used (PEP 562), so `python -m qwen_np --help` does not
pay for NumPy, ml_dtypes and the model code it never runs.
"""

import os
from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import Any

# Before NumPy loads OpenBLAS, which reads this once: its idle threads spin for 2^28 cycles (~0.1 s)
# after each call it threads before they sleep, and while they spin they take the cores from what
# runs next on our own threads (runtime.split: few-row products, BF16 streaming). Qwen3-0.6B FP32, 2
# threads: forward(8 tokens) just after forward(1 token) took 200-217 ms, alone 143-163; with 2^18
# (~0.1 ms, still bridging the gaps between one step's products) 143-151, one token no slower. Where
# NumPy was imported first (a library user's script) it stays OpenBLAS's default; the CLI imports us first.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "18")

from .errors import QwenNPError  # noqa: E402, F401  (light: no NumPy; in __all__ below)

# public name -> the module that defines it
_PUBLIC = {
    "KVCache": "qwen_np.core.kv_cache", "PRESETS": "qwen_np.core.config", "Qwen3Config": "qwen_np.core.config",
    "Qwen3Model": "qwen_np.core.model", "load_config": "qwen_np.core.config", "parameter_count": "qwen_np.core.config",
    "preset": "qwen_np.core.config", "load_model": "qwen_np.engine.loading",
    "loss_and_gradients": "qwen_np.training.step", "embed": "qwen_np.generation.embedding",
}

__all__ = sorted([*_PUBLIC, "QwenNPError"])


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        value = getattr(import_module(_PUBLIC[name]), name)
        globals()[name] = value          # found once, then a plain attribute
        return value
    raise AttributeError(f"module 'qwen_np' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])


try:
    __version__ = version("qwen_np")      # pyproject.toml's, the one place it is written
except PackageNotFoundError:              # a checkout on sys.path that was never installed
    __version__ = "0+unknown"
