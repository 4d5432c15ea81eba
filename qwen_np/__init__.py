"""qwen_np: the Qwen3 dense decoder in pure NumPy, exact to transformers' Qwen3ForCausalLM in FP32."""

from importlib.metadata import PackageNotFoundError, version

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
