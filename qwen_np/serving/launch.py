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
from dataclasses import dataclass
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



@dataclass(frozen=True)
class ServeConfig:
    """What a server runs: the model (`model`: its folder, a GGUF file or its opened files), the names clients
    ask for it by (the first its own), and how it serves. context: prompt and reply together, at most the
    model's; kv_memory: bytes of the KV cache's block pool, shared by every request (None: what RAM has left
    after the weights, at most max_batch full contexts); kv_dtype: how it stores keys and values;
    default_max_tokens: a request's max_tokens when it gives none (None: what the context has left); draft
    (a checkpoint folder) or lookup (the n-gram size): every row decodes speculatively, draft_tokens drafted
    per step; adapters: LoRA adapters (files.adapter.read_adapter) a request asks for by name, over the one
    base in memory; split_reasoning: a chat reply's <think> part apart; log: a line per request on stderr."""

    names: Sequence[str]
    model: Path | ModelFiles
    max_batch: int = DEFAULT_MAX_BATCH
    context: int = DEFAULT_CONTEXT
    memory: str = "auto"
    kv_memory: int | None = None
    kv_dtype: str = "fp32"
    api_key: str | None = None
    log: bool = True
    split_reasoning: bool = True
    default_max_tokens: int | None = DEFAULT_MAX_TOKENS
    draft: Path | ModelFiles | None = None
    lookup: int | None = None
    draft_tokens: int = DEFAULT_DRAFT_TOKENS
    adapters: Sequence[Adapter] = ()

    def check(self) -> None:
        """Refuse settings no model could serve, before any file is read."""
        if isinstance(self.names, str) or not self.names:
            raise QwenNPError(f"serve: names must be a non-empty list of model names, got {self.names!r}")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise QwenNPError(f"must be at least 1, got {self.default_max_tokens}", "default_max_tokens")
        served = [*self.names, *(adapter.name for adapter in self.adapters)]
        if len(set(served)) < len(served):
            raise QwenNPError(f"names must be distinct, the base's and the adapters', got {served}", "adapters")


def serve(config: ServeConfig, listener: socket.socket, announce: Callable[[str], None] = lambda line: None) -> None:
    """Load the model `config` names and serve it on `listener` until Ctrl-C or SIGTERM; announce(line) gets
    the start lines."""
    try:
        import uvicorn
    except ImportError:
        raise QwenNPError("serve: needs the `serve` extra (pip install 'qwen_np[serve]': starlette, uvicorn)") from None
    config.check()
    host, port = listener.getsockname()[:2]
    warning = exposure_warning(host, config.api_key)
    if warning:
        announce(warning)
    service = start_service(config, announce)
    address = f"{'[' + host + ']' if ':' in host else host}:{port}"
    announce(f"serving {', '.join(config.names)} on http://{address}/v1 (max batch {config.max_batch}, context "
             f"{service.context}); Ctrl-C stops")
    app = create_app(service, api_key=config.api_key, loopback_only=is_loopback(host), log=config.log)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2,
                                           timeout_keep_alive=KEEP_ALIVE_SECONDS, http=header_deadline_protocol()))
    service.runner.start()
    try:
        server.run(sockets=[listener])
    finally:
        service.runner.stop()


def start_service(config: ServeConfig, announce: Callable[[str], None]) -> Service:
    """The model loaded (its weights checked finite), the KV pool sized, speculation set up and the Service
    every request goes through, its runner not yet started; the lines that say so announced."""
    files = open_model(config.model)             # read once: the command that opened it passes it on
    tokenizer, defaults = files.tokenizer, files.generation_defaults
    context = context_for(files.config, config.context)
    draft = open_model(config.draft, "draft") if config.draft is not None else None
    if draft is not None:
        check_draft_folder(draft, files.config, tokenizer)    # the files the command checked: nothing is read again
    model = load_model(files, memory=config.memory, max_tokens=context, kv_dtype=config.kv_dtype)
    check_weights_finite(model)                  # NaN/Inf weights: one line naming the layer, before listening
    drafter = load_draft(draft, config.memory, context + config.draft_tokens) if draft is not None else None
    # Every row's draft cache holds as many positions as its target cache (plus the drafted ones), so a
    # draft's block costs its bytes beside each target block: the budget buys pairs of blocks.
    per_block = block_bytes(model.config, config.kv_dtype)
    per_pair = per_block + (block_bytes(drafter.config, config.kv_dtype) if drafter is not None else 0)
    adapter_bytes = sum(adapter.nbytes for adapter in config.adapters)
    budget = (default_kv_memory(model, pool_blocks([context] * config.max_batch) * per_pair, drafter, adapter_bytes)
              if config.kv_memory is None else config.kv_memory)
    pool = BlockPool(model.config, budget // per_pair, config.kv_dtype, prefix_caching=True)
    speculation = (speculation_over(pool, drafter, config.max_batch, config.draft_tokens) if drafter is not None
                   else lookup_speculation(config.lookup, config.draft_tokens) if config.lookup is not None else None)
    generator = BatchGenerator(model, tokenizer, eos_token_ids=defaults.eos_token_ids, max_batch=config.max_batch,
                               context=context, pool=pool, speculation=speculation)
    tokenizer.encode("", parse_special=False)    # its literal backend made now, not under a client's request
    grammars = grammar_vocabulary(files, announce)
    announce(f"KV cache: {format_size(pool.num_blocks * per_pair)} ({config.kv_dtype}), {pool.num_blocks} blocks of "
             f"{pool.block_size} positions, {generator.capacity} positions for all requests together"
             + (f" (the draft's {format_size(pool.num_blocks * (per_pair - per_block))} included)" if drafter else "")
             + (" (default: the RAM left after the weights, with a margin, at most --max-batch full contexts)"
                if config.kv_memory is None else ""))
    if not model.has_head:
        announce("no LM head (an embedding model): it serves /v1/embeddings; chat and completions answer a 400")
    if speculation is not None:
        announce(f"speculative decoding: {speculation.describe}, {speculation.tokens} tokens drafted per step")
    if config.adapters:
        announce(f"LoRA adapters over {config.names[0]}: "
                 + ", ".join(f"{adapter.name} (rank {adapter.rank})" for adapter in config.adapters)
                 + f", {format_size(adapter_bytes)} together")
    return Service(tuple(config.names), tokenizer, defaults, BatchRunner(generator), context,
                   LENGTH_FACTOR * longest_token(tokenizer), tokens_per_message(tokenizer), config.split_reasoning,
                   config.default_max_tokens, grammars, {adapter.name: adapter for adapter in config.adapters})


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
