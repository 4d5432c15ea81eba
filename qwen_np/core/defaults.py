"""The names and numbers a run is set with that the command line shows before it runs anything (its --help:
choices, defaults, the machine's cores). They live here, in a module that imports nothing heavy, so that
building a command's parser loads no NumPy; each library module that uses one imports it from here and
keeps its public name (engine.memory.DEFAULT_CONTEXT is this DEFAULT_CONTEXT).
"""

from __future__ import annotations

import os

from ..numbers.names import FORMATS, HELD_FORMATS  # noqa: F401  (handed on: --help shows them)

# What --model means besides a path or a hub id: the bundled model, from any folder (`bundled` is no hub id,
# which is always OWNER/NAME; a folder named so is ./bundled). Also its name where it is served.
BUNDLED = "bundled"
# How load_model may hold the weights (engine.memory's plans): HELD_FORMATS are the block formats a matrix
# can be quantized to at load (numbers.formats.FormatRows); "stored" is "bf16" by another name.
MODES = ("auto", "fp32", "bf16", "stored", "int8", *HELD_FORMATS)
DEFAULT_CONTEXT = 4096   # KV cache positions the plan reserves when the caller does not say
# name -> its NumPy dtype's (dtype_named); int8 stores codes with an FP32 scale per position and head (kv_cache.py)
KV_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "int8": "int8"}
# The precision lab's activation formats (its weight formats: numbers.names.FORMATS), and its defaults.
ACTIVATION_FORMATS = ("bf16", "fp16")      # plain casts: the scaled formats refuse the inf an overflow makes
SCORING_WINDOW = 256                       # tokens per window (or the model's limit, if smaller)
SCORED_TOKENS = 2048                       # predicted tokens scored per format
GGUF_FILE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")   # export --type (files.gguf_export.FILE_TYPES)
DEFAULT_DRAFT_TOKENS = 4    # tokens drafted per step of speculative decoding
DEFAULT_WINDOW = 1024       # tokens per window when eval is not told: the model's context, at most this
DEFAULT_HOST, DEFAULT_PORT, DEFAULT_MAX_BATCH = "127.0.0.1", 8000, 8     # where serve listens; rows per batch
DEFAULT_MAX_TOKENS = 2048   # the server's max_tokens of a request that gives none (serving.requests)


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, e.g. a container's share), not the host's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
