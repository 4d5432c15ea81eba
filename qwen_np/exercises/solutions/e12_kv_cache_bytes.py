"""Exercise 12 (section 6): the KV cache's bytes per token.

Write `kv_cache_bytes_per_token(config, bytes_per_value)`: what one position adds to the KV cache, the keys
and values of every layer (config.num_hidden_layers, num_key_value_heads, head_dim; a qwen_np.Qwen3Config,
as `qwen_np.preset("qwen3-14b")` gives). Then Qwen3-14B's at its full context in BF16 is one line more.
Graded against qwen_np.engine.memory.kv_cache_bytes_per_token on several real Qwen3 sizes.
"""

from __future__ import annotations

from typing import Any


def kv_cache_bytes_per_token(config: Any, bytes_per_value: int) -> int:
    """Bytes of keys and values one position holds, over all layers."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * bytes_per_value
