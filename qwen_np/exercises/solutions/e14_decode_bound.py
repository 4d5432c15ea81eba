"""Exercise 14 (section 8): the fastest decode a memory bus allows.

One decode step reads every weight once, except the embedding table, of which it reads only the new
token's row (unless the table is also the LM head: a tied model reads it all, as lm_head). Write
`max_tokens_per_second(config, bandwidth, bytes_per_value)`: bandwidth (bytes/s) divided by the bytes one
step reads (ignore the KV cache and the norms' handful; qwen_np.parameter_count(config) counts the weights).
Graded against qwen_np.inspection.counts.weight_bytes_read_per_token for a tied and an untied Qwen3.
"""

from __future__ import annotations

from typing import Any

from qwen_np.core.config import parameter_count


def max_tokens_per_second(config: Any, bandwidth: float, bytes_per_value: float) -> float:
    """Tokens per second if reading the weights were all a step did."""
    unread = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    return bandwidth / ((parameter_count(config) - unread) * bytes_per_value)
