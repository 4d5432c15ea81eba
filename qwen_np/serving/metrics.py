"""GET /metrics: the batch and its KV cache in Prometheus' text exposition format.

Each metric is three lines, `# HELP name text`, `# TYPE name gauge|counter`, `name value`; counters
end in _total and only grow. Hand-written: the format is those lines, and prometheus_client would
add a dependency and a process-wide registry for a handful of numbers read from one BatchGenerator.
"""

from __future__ import annotations

from ..generation.batching import BatchGenerator

PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def prometheus_text(generator: BatchGenerator) -> str:
    """The generator's numbers now, one metric each (read from the event loop while the batching thread
    runs: each is one read of an int or a length, so a scrape never sees a torn value)."""
    pool = generator.pool
    prompt, reused = generator.prompt_tokens, generator.reused_tokens
    metrics = [
        ("requests_running", "gauge", "Requests in the batch.", len(generator.rows)),
        ("requests_waiting", "gauge", "Requests waiting to join the batch (preempted ones included).",
         generator.waiting),
        ("kv_blocks_used", "gauge", f"KV cache blocks ({pool.block_size} positions each) held by requests.",
         pool.used_blocks),
        ("kv_blocks_free", "gauge", "KV cache blocks free, or holding only the prefix cache.", pool.free_blocks),
        ("prefix_cache_hit_rate", "gauge", "Share of prompt tokens found in the prefix cache, since start.",
         reused / prompt if prompt else 0.0),
        ("prefix_cache_queried_tokens_total", "counter", "Prompt tokens looked up in the prefix cache.", prompt),
        ("prefix_cache_hit_tokens_total", "counter", "Prompt tokens found in the prefix cache.", reused),
        ("prefill_tokens_total", "counter", "Prompt tokens run through the model (recomputed ones included).",
         generator.prefilled_tokens),
        ("generation_tokens_total", "counter", "Tokens generated.", generator.generated_tokens),
        ("preemptions_total", "counter", "Requests preempted for want of KV cache blocks.", generator.preemptions),
    ]
    return "".join(f"# HELP qwen_np_{name} {text}\n# TYPE qwen_np_{name} {kind}\nqwen_np_{name} {value}\n"
                   for name, kind, text, value in metrics)
