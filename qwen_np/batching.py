"""Continuous batching: many generations share every forward pass.

Decoding is memory-bound: a step reads every weight once, and a step for 8 sequences reads them once
too (Qwen3Model.forward_batch packs the sequences' tokens into one matrix). So a server that runs
its requests' decode steps together turns the same memory traffic into several times the tokens.

A BatchGenerator holds up to `max_batch` sequences ("rows"), each with its own KV cache, sampler and
stop strings. Each `step()` is one forward pass:

1. requests that were submitted join while there is room; cancelled and finished rows have left;
2. every decoding row feeds its last sampled token, and rows still reading their prompt feed their
   next chunk of it (at most `prefill_chunk` prompt tokens per step in all, so a long prompt delays
   the others' next token by one chunk's time, never by the whole prompt);
3. every row whose prompt is all in its cache samples its next token (generate.Continuation: the same
   per-sequence logic as generate()). Sampling is each row's own: a row whose sampling raises (e.g.
   settings that make its logits non-finite) ends alone with that error, and the others go on.

Rows join and leave between any two steps (continuous batching): a new request starts its prefill at
the next step instead of waiting for the running ones to finish. BatchRunner runs the steps on a
background thread for the server; the CLI calls step() itself.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from .errors import QwenNPError
from .generate import Continuation, TokenEvent
from .memory import PREFILL_CHUNK
from .model import KVCache, Qwen3Model
from .sampling import SamplingParams
from .tokenizer import Tokenizer

# A row's listener receives each of its TokenEvents, or the exception that ended the row.
Listener = Callable[[TokenEvent | BaseException], None]


@dataclass(frozen=True)
class Request:
    """One generation: prompt token ids, how to sample, when to stop."""

    prompt: Sequence[int]
    params: SamplingParams
    max_new_tokens: int
    stop: Sequence[str] = ()


@dataclass(eq=False)
class Row:
    """A request in the batch: its cache, its Continuation, how much of its prompt is in the cache."""

    number: int
    request: Request
    listener: Listener | None = None
    cache: KVCache | None = None                 # allocated when the row joins the batch
    continuation: Continuation | None = None
    fed: int = 0                                  # prompt tokens whose keys/values are in the cache
    last: TokenEvent | None = None                # the newest event (its token is fed next)
    cancelled: bool = False
    finish_reason: str | None = None              # "error" when `error` ended it
    error: BaseException | None = None
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None              # perf_counter() when the first token was sampled
    finished: float | None = None

    @property
    def generated(self) -> list[int]:
        return self.continuation.generated if self.continuation is not None else []

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class BatchGenerator:
    """Up to `max_batch` generations advanced together, one forward pass per step()."""

    def __init__(self, model: Qwen3Model, tokenizer: Tokenizer, *, eos_token_ids: Sequence[int] = (),
                 max_batch: int = 8, context: int | None = None, prefill_chunk: int = PREFILL_CHUNK) -> None:
        if max_batch < 1:
            raise QwenNPError(f"--max-batch: must be >= 1, got {max_batch}")
        self.model, self.tokenizer, self.eos_token_ids = model, tokenizer, tuple(eos_token_ids)
        self.max_batch, self.prefill_chunk = max_batch, prefill_chunk
        self.context = min(context or model.config.max_position_embeddings, model.config.max_position_embeddings)
        self.rows: list[Row] = []                 # in the batch, in the order they joined
        self._waiting: list[Row] = []             # submitted, not yet joined (guarded by _lock)
        self._lock = threading.Lock()
        self._numbers = itertools.count()
        self.batch_sizes: list[int] = []          # rows in each step's forward pass, for tests and stats

    def check(self, request: Request) -> None:
        """Raise QwenNPError if `request` cannot run: no prompt, ids outside the vocabulary, no room for a
        new token, bad max_new_tokens. A bad id would fail the whole batch's forward pass, not its own row."""
        if not request.prompt:
            raise QwenNPError("prompt: no tokens")
        vocab = self.model.config.vocab_size
        # bool is an int in Python, and a NumPy array of them would index the embedding as a mask.
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) and 0 <= t < vocab
                   for t in request.prompt):
            raise QwenNPError(f"prompt: token ids must be integers in [0, {vocab})")
        if request.max_new_tokens < 1:
            raise QwenNPError(f"max_tokens: must be >= 1, got {request.max_new_tokens}")
        if len(request.prompt) + 1 > self.context:
            raise QwenNPError(f"prompt: {len(request.prompt)} tokens leave no room for a new token in the "
                              f"{self.context}-token context")

    def submit(self, request: Request, listener: Listener | None = None) -> Row:
        """Queue a request (any thread); it joins the batch at the next step with room for it."""
        self.check(request)
        row = Row(next(self._numbers), request, listener)
        with self._lock:
            self._waiting.append(row)
        return row

    def cancel(self, row: Row) -> None:
        """Stop a request (any thread): it leaves at the next step and frees its cache."""
        row.cancelled = True

    @property
    def idle(self) -> bool:
        with self._lock:
            return not self.rows and not self._waiting

    @property
    def waiting(self) -> int:
        with self._lock:
            return len(self._waiting)

    def step(self) -> list[tuple[Row, TokenEvent | BaseException]]:
        """One forward pass for every row that has something to feed; returns the new tokens' events, and
        for a row whose sampling raised, the exception that ended it (that row only)."""
        self._admit()
        feeds, budget = [], self.prefill_chunk
        for row in self.rows:
            assert row.cache is not None
            if row.last is not None:                                  # decoding: feed the last token
                feeds.append((row, [row.last.token_id]))
            elif budget > 0:                                          # prefilling: the next chunk
                chunk = list(row.request.prompt[row.fed:row.fed + budget])
                budget -= len(chunk)
                feeds.append((row, chunk))
        if not feeds:
            return []
        self.batch_sizes.append(len(feeds))
        logits = self.model.forward_batch([ids for _, ids in feeds], [row.cache for row, _ in feeds],
                                          last_only=True)                                          # [B, V]
        events: list[tuple[Row, TokenEvent | BaseException]] = []
        for (row, ids), row_logits in zip(feeds, logits):
            if row.last is None:
                row.fed += len(ids)
                if row.fed < len(row.request.prompt):
                    continue                                          # more prompt to read first
            assert row.continuation is not None
            try:
                event = row.last = row.continuation.advance(row_logits)
            except Exception as error:                                # this row's settings or stop strings
                events.extend((failed, error) for failed in self.fail(error, [row]))
                continue
            if row.first_token is None:
                row.first_token = time.perf_counter()
            if event.finish_reason:
                row.finish_reason, row.finished = event.finish_reason, time.perf_counter()
            events.append((row, event))
        self.rows = [row for row in self.rows if not row.done]
        return events

    def fail(self, error: BaseException, rows: Sequence[Row] | None = None) -> list[Row]:
        """End `rows` (default: every row in the batch, when a forward pass raised) with `error`, which each
        keeps as row.error; returns them. The other rows, and waiting ones, stay."""
        failed = list(self.rows if rows is None else rows)
        self.rows = [row for row in self.rows if row not in failed]
        for row in failed:
            row.finish_reason, row.error, row.finished = "error", error, time.perf_counter()
        return failed

    def _admit(self) -> None:
        """Drop cancelled rows; let waiting rows join while there is room, each with its own cache."""
        self.rows = [row for row in self.rows if not row.cancelled]
        with self._lock:
            self._waiting = [row for row in self._waiting if not row.cancelled]
            joining = self._waiting[:max(0, self.max_batch - len(self.rows))]
            del self._waiting[:len(joining)]
        for row in joining:
            request = row.request
            size = min(len(request.prompt) + request.max_new_tokens, self.context)
            row.cache = self.model.new_cache(size)
            row.continuation = Continuation(self.tokenizer, request.prompt, request.params, request.max_new_tokens,
                                            size, eos_token_ids=self.eos_token_ids, stop=request.stop,
                                            rng=np.random.default_rng(request.params.seed))
            self.rows.append(row)


class BatchRunner:
    """Runs a BatchGenerator's steps on a background thread whenever it has work, and hands each row's
    events to that row's listener (on that thread: listeners must only hand them on, e.g. to an
    event loop). The model is used from this one thread only."""

    def __init__(self, generator: BatchGenerator) -> None:
        self.generator = generator
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="qwen_np-batching", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join()

    def submit(self, request: Request, listener: Listener) -> Row:
        row = self.generator.submit(request, listener)
        self._wake.set()
        return row

    def cancel(self, row: Row) -> None:
        self.generator.cancel(row)

    def _run(self) -> None:
        while not self._stopping:
            self._wake.clear()                  # before looking: a submit after this sets it again
            if self.generator.idle:
                self._wake.wait()
                continue
            try:
                events = self.generator.step()
            except Exception as error:          # a bug or a bad request must not stop the server's loop
                events = [(row, error) for row in self.generator.fail(error)]
            for row, event in events:
                if row.listener is not None:
                    row.listener(event)
