"""The budgets a run works within, each rule written once: the context it gets (`context_for`), the KV
cache blocks a pool holds (`pool_blocks`) and the chunks a prompt is prefilled in (`prefill_chunks`).

Every caller asks here (generate and chat, the batcher, serve and its draft pool, the commands,
training, evaluation, the precision lab, the inspection report), so a rule changed here changes for
all of them at once, and no second copy of it can drift.
"""

from __future__ import annotations

import math
from typing import Iterable

from ..core.config import Qwen3Config
from ..core.defaults import DEFAULT_CONTEXT   # defined there for --help, which loads no NumPy
from ..errors import QwenNPError

# Prompt tokens per forward pass during prefill: bounds the [T, V] logits and [H, T, S] attention scores one
# pass allocates, so the memory plan can budget working buffers for it (memory.working_bytes).
PREFILL_CHUNK = 512

# Positions per block of a paged KV cache (paged.py). Smaller blocks waste less of each sequence's last
# block and let the prefix cache match more of a shared prefix (it reuses whole blocks only); larger ones
# make fewer, longer runs and cheaper gathers. Measured (python -m bench.kv_cache: Qwen3-0.6B's KV shapes, 2,048 positions, a
# shared machine): gathering scattered blocks costs 1.2-1.5x a plain copy of the same keys at 16,
# about 1x from 64 up, 1.2-2x at 4 and 4x at 1; a decode step whose every block is its own run takes
# 1.3x the in-order step at 16. 16 is the smallest size that stays near those costs, and vLLM's default.
BLOCK_SIZE = 16


def context_for(config: Qwen3Config, asked: int | None = None, *, default: int | None = DEFAULT_CONTEXT,
                param: str | None = None) -> int:
    """The positions a run keeps KV cache for: what the caller asked (--ctx-size, max_tokens, a prompt and
    its reply), else `default` (DEFAULT_CONTEXT; None: the model's whole context), and never more than the
    model's own context (model_context).

    With `param` (the flag or field `asked` came in), asking for more than the model's context is an error
    naming it, not a request quietly cut down: training and evaluation would otherwise measure something
    other than what was asked."""
    limit = model_context(config)
    if param is not None and asked is not None and not 1 <= asked <= limit:
        raise QwenNPError(f"must be between 1 and the model's context ({limit} positions, {_context_source(config)}), "
                          f"got {asked}", param)
    return min(asked or default or limit, limit)


def model_context(config: Qwen3Config) -> int:
    """The positions the model's config allows: max_position_embeddings, or YaRN's extended window (factor x the
    original one: Qwen3's documented 4 x 32,768 = 131,072) when that is longer."""
    yarn = config.rope_scaling
    extended = 0 if yarn is None else int(yarn.factor * yarn.original_max_position_embeddings)
    return max(config.max_position_embeddings, extended)


def _context_source(config: Qwen3Config) -> str:
    """Where the model's context comes from, for a message."""
    return "max_position_embeddings" if model_context(config) == config.max_position_embeddings else "YaRN's rope_scaling"


def blocks_for(tokens: int, block_size: int = BLOCK_SIZE) -> int:
    """Blocks that hold `tokens` positions (also: chunks of `block_size` that cover `tokens`)."""
    return math.ceil(tokens / block_size)


def pool_blocks(positions: Iterable[int], block_size: int = BLOCK_SIZE) -> int:
    """The blocks a pool needs so that every row gets its positions at once, none waiting: each row's own
    blocks (a block holds one row's positions only, so rows do not share a partly filled one)."""
    return sum(blocks_for(one, block_size) for one in positions)


def prefill_chunks(tokens: int, chunk: int | None = None) -> list[slice]:
    """The slices of a `tokens`-long prompt fed one forward pass each: `chunk` (default PREFILL_CHUNK, read
    when called) tokens, the last the rest."""
    chunk = chunk or PREFILL_CHUNK
    return [slice(start, min(start + chunk, tokens)) for start in range(0, tokens, chunk)]
