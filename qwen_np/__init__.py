"""qwen_np: the Qwen3 dense decoder in pure NumPy, exact to transformers' Qwen3ForCausalLM in FP32."""

import os
from importlib.metadata import PackageNotFoundError, version

# Before NumPy loads OpenBLAS, which reads this once: its idle threads spin for 2^28 cycles (~0.1 s)
# after each call it threads before they sleep, and while they spin they take the cores from what
# runs next on our own threads (runtime.split: few-row products, BF16 streaming). Qwen3-0.6B FP32, 2
# threads: forward(8 tokens) just after forward(1 token) took 200-217 ms, alone 143-163; with 2^18
# (~0.1 ms, still bridging the gaps between one step's products) 143-151, one token no slower. Where
# NumPy was imported first (a library user's script) it stays OpenBLAS's default; the CLI imports us first.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "18")


from .config import PRESETS, Qwen3Config, load_config, parameter_count, preset
from .errors import QwenNPError
from .loading import load_model
from .model import KVCache, Qwen3Model

__all__ = ["KVCache", "PRESETS", "Qwen3Config", "Qwen3Model", "QwenNPError", "load_config", "load_model",
           "parameter_count", "preset"]

try:
    __version__ = version("qwen_np")      # pyproject.toml's, the one place it is written
except PackageNotFoundError:              # a checkout on sys.path that was never installed
    __version__ = "0+unknown"
