"""Starting the server: load the model, size the KV cache's block pool (the budget), set up speculation, print
the start lines, and run the app on uvicorn with our HTTP protocol until Ctrl-C or SIGTERM.

Every row's keys and values are blocks of one pool of --kv-memory bytes (kv_cache.py): a request joins
while blocks are free, one that could never fit is refused with a 400, and a prompt reuses the blocks of a
prefix seen before. Without --kv-memory the pool takes what the memory plan leaves of the RAM after the
weights (the draft's too), at most --max-batch full contexts.

Imports app, protocol, access and requests of serving/ (the top of the folder; commands/serve.py calls it).
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Callable, Sequence

from ..core.adapters import Adapter
from ..core.defaults import DEFAULT_MAX_BATCH
from ..engine.budget import BLOCK_SIZE, PREFILL_CHUNK, context_for, pool_blocks
from ..engine.paged import BlockPool, PagedKVCache, block_bytes
from ..core.model import Qwen3Model
from ..engine.finite import check_weights_finite
from ..engine.loading import load_model
from ..core.defaults import DEFAULT_CONTEXT
from ..engine.sizes import format_size
from ..errors import QwenNPError
from ..files.model_files import ModelFiles, open_model
from ..generation.batching import BatchGenerator, BatchRunner
from ..generation.constraints import INSTALL, Vocabulary, vocabulary
from ..generation.speculative import (DEFAULT_DRAFT_TOKENS, Speculation, check_draft_folder, draft_speculation,
                                      load_draft, lookup_speculation)
from .access import exposure_warning, is_loopback
from .app import create_app
from .protocol import KEEP_ALIVE_SECONDS, header_deadline_protocol
from .requests import DEFAULT_MAX_TOKENS, LENGTH_FACTOR, Service, longest_token, tokens_per_message



def serve(names: Sequence[str], folder: Path | ModelFiles, listener: socket.socket, *, max_batch: int = DEFAULT_MAX_BATCH,
          context: int = DEFAULT_CONTEXT, memory: str = "auto", kv_memory: int | None = None, kv_dtype: str = "fp32",
          api_key: str | None = None, log: bool = True, split_reasoning: bool = True,
          default_max_tokens: int | None = DEFAULT_MAX_TOKENS,
          draft: Path | ModelFiles | None = None, lookup: int | None = None, draft_tokens: int = DEFAULT_DRAFT_TOKENS,
          adapters: Sequence[Adapter] = (), announce: Callable[[str], None] = lambda line: None) -> None:
    """Load the model in `folder` (clients ask for it by any of `names`, the first its own) and serve it on
    `listener` until Ctrl-C or SIGTERM. context: prompt and reply together, at most the model's; kv_memory:
    bytes of the KV cache's block pool, shared by every request (None: what RAM has left after the weights,
    at most max_batch full contexts); kv_dtype: how it stores keys and values; default_max_tokens: a
    request's max_tokens when it gives none (None: what the context has left); draft (a checkpoint folder)
    or lookup (the n-gram size): every row decodes speculatively, draft_tokens drafted per step; adapters:
    LoRA adapters (files.adapter.read_adapter) a request asks for by name, over the one base in memory;
    announce(line) gets the start lines."""
    try:
        import uvicorn
    except ImportError:
        raise QwenNPError("serve: needs the `serve` extra (pip install 'qwen_np[serve]': starlette, uvicorn)") from None
    if isinstance(names, str) or not names:
        raise QwenNPError(f"serve: names must be a non-empty list of model names, got {names!r}")
    if default_max_tokens is not None and default_max_tokens < 1:
        raise QwenNPError(f"must be at least 1, got {default_max_tokens}", "default_max_tokens")
    served = [*names, *(adapter.name for adapter in adapters)]
    if len(set(served)) < len(served):
        raise QwenNPError(f"names must be distinct, the base's and the adapters', got {served}", "adapters")
    files = open_model(folder)                  # read once: the command that opened it passes it on
    config, tokenizer, defaults = files.config, files.tokenizer, files.generation_defaults
    context = context_for(config, context)
    if draft is not None:
        draft = open_model(draft, "draft")
        check_draft_folder(draft, config, tokenizer)       # the files the command checked: nothing is read again
    model = load_model(files, memory=memory, max_tokens=context)
    check_weights_finite(model)                  # NaN/Inf weights: one line naming the layer, before listening
    drafter = load_draft(draft, memory, context + draft_tokens) if draft is not None else None
    # Every row's draft cache holds as many positions as its target cache (plus the drafted ones), so a
    # draft's block costs its bytes beside each target block: the budget buys pairs of blocks.
    per_block = block_bytes(config, kv_dtype)
    per_pair = per_block + (block_bytes(drafter.config, kv_dtype) if drafter is not None else 0)
    default = kv_memory is None
    adapter_bytes = sum(adapter.nbytes for adapter in adapters)
    budget = (default_kv_memory(model, pool_blocks([context] * max_batch) * per_pair, drafter, adapter_bytes)
              if kv_memory is None else kv_memory)
    pool = BlockPool(config, budget // per_pair, kv_dtype, prefix_caching=True)
    speculation = (speculation_over(pool, drafter, max_batch, draft_tokens) if drafter is not None
                   else lookup_speculation(lookup, draft_tokens) if lookup is not None else None)
    generator = BatchGenerator(model, tokenizer, eos_token_ids=defaults.eos_token_ids, max_batch=max_batch,
                               context=context, pool=pool, speculation=speculation)
    tokenizer.encode("", parse_special=False)    # its literal backend made now, not under a client's request
    grammars = grammar_vocabulary(files, announce)
    service = Service(tuple(names), tokenizer, defaults, BatchRunner(generator), context,
                      LENGTH_FACTOR * longest_token(tokenizer), tokens_per_message(tokenizer), split_reasoning,
                      default_max_tokens, grammars, {adapter.name: adapter for adapter in adapters})
    host, port = listener.getsockname()[:2]
    warning = exposure_warning(host, api_key)
    if warning:
        announce(warning)
    announce(f"KV cache: {format_size(pool.num_blocks * per_pair)} ({kv_dtype}), {pool.num_blocks} blocks of "
             f"{pool.block_size} positions, {generator.capacity} positions for all requests together"
             + (f" (the draft's {format_size(pool.num_blocks * (per_pair - per_block))} included)" if drafter else "")
             + (" (default: the RAM left after the weights, with a margin, at most --max-batch full contexts)"
                if default else ""))
    if not model.has_head:
        announce("no LM head (an embedding model): it serves /v1/embeddings; chat and completions answer a 400")
    if speculation is not None:
        announce(f"speculative decoding: {speculation.describe}, {speculation.tokens} tokens drafted per step")
    if adapters:
        announce(f"LoRA adapters over {names[0]}: " + ", ".join(f"{adapter.name} (rank {adapter.rank})" for adapter in adapters)
                 + f", {format_size(adapter_bytes)} together")
    address = f"{'[' + host + ']' if ':' in host else host}:{port}"
    announce(f"serving {', '.join(names)} on http://{address}/v1 (max batch {max_batch}, context {context}); "
             "Ctrl-C stops")
    app = create_app(service, api_key=api_key, loopback_only=is_loopback(host), log=log)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2,
                                           timeout_keep_alive=KEEP_ALIVE_SECONDS, http=header_deadline_protocol()))
    service.runner.start()
    try:
        server.run(sockets=[listener])
    finally:
        service.runner.stop()


def grammar_vocabulary(files: ModelFiles, announce: Callable[[str], None]) -> Vocabulary | None:
    """The grammar engine's view of the tokenizer, shared by every request and the explorer; None, said in a
    start line, without llguidance. Its costly part (about 1.6 s for Qwen3's 151,669 tokens) is built when a
    request first asks for a grammar (Vocabulary.engine), not at every start: most servers never need it."""
    try:
        return vocabulary(files.tokenizer, files.config.vocab_size, files.generation_defaults.eos_token_ids)
    except QwenNPError:
        announce(f"tools and response_format are refused: constrained decoding needs llguidance ({INSTALL})")
        return None


def speculation_over(pool: BlockPool, model: Qwen3Model, max_batch: int, tokens: int) -> Speculation:
    """Drafting with the draft `model` for a batch over `pool`: every row's draft cache comes from one
    pool of the draft's own, as many positions as `pool` has plus the k drafted ones of every row (a row's
    draft cache holds at most its sequence and k - 1 drafted tokens, and a row that leaves frees it). It
    caches prefixes as the target's pool does: a chat client resending its conversation, or rows sharing a
    system prompt, draft after reading only what is new."""
    blocks = pool.num_blocks + pool_blocks([tokens + BLOCK_SIZE] * max_batch)     # k may straddle a block more
    draft_pool = BlockPool(model.config, blocks, pool.dtype, prefix_caching=True)
    return draft_speculation(model, tokens, lambda positions: PagedKVCache(draft_pool, positions), PREFILL_CHUNK)


def default_kv_memory(model: Qwen3Model, full: int, draft: Qwen3Model | None = None, adapter_bytes: int = 0) -> int:
    """The KV cache's bytes when --kv-memory is not given: what the memory plan leaves of the available RAM
    after the weights (the draft's and the LoRA adapters' too), with its margin, and no more than `full`
    (every row of the batch at its full context)."""
    if model.plan is None:
        return full
    drafts = draft.plan.held_weight_bytes if draft is not None and draft.plan is not None else 0
    return min(max(model.plan.room_for_kv_cache - drafts - adapter_bytes, 0), full)
