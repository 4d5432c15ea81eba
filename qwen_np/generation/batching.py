"""Continuous batching: many generations share every forward pass, and one pool of KV blocks.

Decoding is memory-bound: a step reads every weight once, and a step for 8 sequences reads them once
too (Qwen3Model.forward_batch packs the sequences' tokens into one matrix). So a server that runs
its requests' decode steps together turns the same memory traffic into several times the tokens.

A BatchGenerator holds up to `max_batch` sequences ("rows"), each with its own sampler and stop
strings and a block table into the generator's one paged.BlockPool. Each `step()` is one forward pass:

1. requests that were submitted join while there is room in the batch and blocks for their prompt
   (a prompt whose first blocks are in the prefix cache takes those and prefills only the rest; one that a
   row in the batch is still reading waits until it is read, then takes its blocks so);
   cancelled and finished rows have left and given their blocks back;
2. every decoding row feeds its last sampled token, and rows still reading their prompt feed their
   next chunk of it (at most `prefill_chunk` prompt tokens per step in all, so a long prompt delays
   the others' next token by one chunk's time, never by the whole prompt). When the pool has no block
   for a row's tokens, the newest row is preempted: its blocks go back and it waits at the head of
   the queue; when it joins again it recomputes its tokens (prompt and reply so far: its full blocks
   are often still in the prefix cache) and goes on exactly where it was, with the same sampler;
3. every row whose tokens are all in its cache samples its next token (generate.Continuation: the same
   per-sequence logic as generate()). Sampling is each row's own: a row whose sampling raises (e.g.
   settings that make its logits non-finite), or whose logits the model itself makes non-finite (a NaN
   in the embedding row of one of its tokens: NonFiniteLogits), ends alone with that error, and the
   others go on (each row's numbers are its own in a forward pass).

Rows join and leave between any two steps (continuous batching): a new request starts its prefill at
the next step instead of waiting for the running ones to finish. BatchRunner runs the steps on a
background thread for the server, and other model work between them (Work: an embedding request, one
forward pass at a time); the CLI calls step() itself.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import numpy as np

from ..errors import QwenNPError
from .generate import Continuation, Ending, TokenEvent
from .constraints import Grammar
from .logprobs import check_top_logprobs
from .thinking import ThinkingBudget
from ..engine.finite import NonFiniteLogits
from ..engine.budget import PREFILL_CHUNK, context_for, pool_blocks
from ..engine.paged import BlockPool, PagedKVCache
from ..core.adapters import Adapter
from ..core.batch import check_token_ids
from ..core.model import Qwen3Model
from ..core.sampling import SamplingParams
from .speculative import NO_DRAFT, Draft, Drafter, Job, Speculation, propose_together
from ..files.tokenizer import Tokenizer

# A row's listener receives each of its TokenEvents, or the exception that ended the row.
Listener = Callable[[TokenEvent | BaseException], None]


@dataclass(frozen=True)
class Request:
    """One generation: prompt token ids, how to sample, when to stop; optionally a grammar the reply
    follows and how many top log-probabilities each token reports (generate.Continuation)."""

    prompt: Sequence[int]
    params: SamplingParams
    max_new_tokens: int
    stop: Sequence[str] = ()
    grammar: Grammar | None = None
    logprobs: int | None = None
    ending: Ending = Ending()                     # stop token ids, ignore_eos, min_tokens (vLLM's)
    adapter: Adapter | None = None                # the LoRA adapter its rows run with (None: the base model)
    thinking_budget: int | None = None            # its thinking's most tokens (thinking.py; None: unbounded)


@dataclass(eq=False)
class Row:
    """A request in the batch: its cache (while it holds blocks) and its Continuation."""

    number: int
    request: Request
    listener: Listener | None = None
    cache: PagedKVCache | None = None             # while in the batch: its block table
    continuation: Continuation | None = None      # from its first join on (a preempted row keeps it)
    drafter: Drafter | None = None                # when speculating: its drafter, from its first join on
    draft: Draft = NO_DRAFT                       # the tokens it drafted for this step
    cached_tokens: int = 0                        # prompt tokens the prefix cache held when it first joined
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

    @property
    def tokens(self) -> Sequence[int]:
        """Every token whose keys/values the row needs: the prompt, then the reply sampled so far."""
        return self.continuation.sequence if self.continuation is not None else self.request.prompt

    def pending(self) -> Sequence[int]:
        """The tokens its cache does not hold yet: a chunk of prompt to read, or the last sampled token."""
        assert self.cache is not None
        return self.tokens[self.cache.length:]

    @property
    def decoding(self) -> bool:
        """Whether its next feed is its last sampled token (else a chunk of prompt, or recomputed reply)."""
        return bool(self.generated) and len(self.pending()) == 1


class BatchGenerator:
    """Up to `max_batch` generations advanced together, one forward pass per step(), their keys and values
    in `pool` (default: FP32 with prefix caching, room for max_batch rows at the memory plan's context).
    With a `speculation`, each decoding row feeds its last token and the tokens its own drafter proposes,
    and keeps what Continuation.verify accepts (speculative.py); the rows draft together (propose_together)."""

    def __init__(self, model: Qwen3Model, tokenizer: Tokenizer, *, eos_token_ids: Sequence[int] = (),
                 max_batch: int = 8, context: int | None = None, prefill_chunk: int = PREFILL_CHUNK,
                 pool: BlockPool | None = None, speculation: Speculation | None = None) -> None:
        if max_batch < 1:
            raise QwenNPError(f"must be >= 1, got {max_batch}", "max_batch")
        self.model, self.tokenizer, self.eos_token_ids = model, tokenizer, tuple(eos_token_ids)
        self.max_batch, self.prefill_chunk, self.speculation = max_batch, prefill_chunk, speculation
        self.context = context_for(model.config, context, default=None)
        # The default pool: every row at the context the memory plan reserved (not the model's whole
        # context: 40960 positions of Qwen3-8B are 5.6 GiB of FP32 cache per row), or the batch's if less.
        planned = context_for(model.config, model.plan.max_tokens if model.plan is not None else None)
        per_row = min(self.context, planned)
        self.pool = pool if pool is not None else BlockPool(model.config, pool_blocks([per_row] * max_batch),
                                                            prefix_caching=True)
        self.rows: list[Row] = []                 # in the batch, in the order they joined
        self._waiting: list[Row] = []             # submitted or preempted, not (again) in the batch (guarded by _lock)
        self._lock = threading.Lock()
        self._numbers = itertools.count()
        self.batch_sizes: list[int] = []          # rows in each step's forward pass, for tests and stats
        self.preemptions = 0                      # rows sent back to wait for want of blocks
        self.generated_tokens = 0                 # tokens sampled, every row together
        self.prefilled_tokens = 0                 # prompt (and recomputed) tokens run through the model
        self.prompt_tokens = 0                    # prompt tokens of the rows that joined ...
        self.reused_tokens = 0                    # ... and of those, the ones the prefix cache held

    @property
    def capacity(self) -> int:
        """Positions the pool holds: the most one request's prompt and reply can take."""
        return self.pool.num_blocks * self.pool.block_size

    def check(self, request: Request) -> None:
        """Raise QwenNPError if `request` cannot run: no prompt, ids outside the vocabulary, no room for a
        new token, bad max_new_tokens, bad logprobs, a thinking budget without thinking, a grammar for another
        vocabulary, more positions than the whole pool. A bad id would fail the whole batch's forward pass, not its own row."""
        vocab = self.model.config.vocab_size
        check_token_ids(request.prompt, vocab, "prompt")
        if request.max_new_tokens < 1:
            raise QwenNPError(f"must be >= 1, got {request.max_new_tokens}", "max_new_tokens")
        if len(request.prompt) + 1 > self.context:
            raise QwenNPError(f"prompt: {len(request.prompt)} tokens leave no room for a new token in the "
                              f"{self.context}-token context")
        if request.logprobs is not None:
            check_top_logprobs(request.logprobs)
        if request.thinking_budget is not None:
            ThinkingBudget(self.tokenizer, request.thinking_budget, request.prompt)      # its checks, here
        if request.grammar is not None and request.grammar.vocabulary.size != vocab:
            raise QwenNPError(f"grammar: compiled for {request.grammar.vocabulary.size} token ids, the model has {vocab}")
        if self._positions(request) > self.capacity:
            raise QwenNPError(f"the prompt and the new tokens need {self._positions(request)} positions of KV cache, "
                              f"more than the {self.capacity} the whole cache holds", "max_new_tokens")

    def _positions(self, request: Request) -> int:
        """KV cache positions a request may fill: prompt + max_new_tokens, at most the context."""
        return min(len(request.prompt) + request.max_new_tokens, self.context)

    def submit(self, request: Request, listener: Listener | None = None) -> Row:
        """Queue a request (any thread); it joins the batch at the next step with room for it."""
        self.check(request)
        row = Row(next(self._numbers), request, listener)
        with self._lock:
            self._waiting.append(row)
        return row

    def cancel(self, row: Row) -> None:
        """Stop a request (any thread): it leaves at the next step and frees its blocks."""
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
        events: list[tuple[Row, TokenEvent | BaseException]] = []
        feeds = self._schedule(events)
        if not feeds:
            return events
        self.batch_sizes.append(len(feeds))
        tails = [1 + len(row.draft.tokens) for row, _ in feeds]       # logits of the last token and the drafted ones
        logits = self.model.forward_batch([ids for _, ids in feeds], [row.cache for row, _ in feeds], tails=tails,
                                          adapters=[row.request.adapter for row, _ in feeds])     # [sum(tails), V]
        # A NaN or +inf anywhere in a row's logits is its maximum (NumPy's max propagates NaN): one pass for all.
        peaks = np.split(np.max(logits, axis=-1), np.cumsum(tails)[:-1])
        for (row, _), row_logits, row_peaks in zip(feeds, np.split(logits, np.cumsum(tails)[:-1]), peaks):
            if row.pending():
                continue                                              # more prompt to read first
            assert row.continuation is not None and row.cache is not None
            try:
                if not np.isfinite(row_peaks).all():      # the model's own numbers, before any setting: its weights'
                    raise NonFiniteLogits("model: the logits are not finite (NaN or Inf) for this row's tokens")
                verified = row.continuation.verify(row_logits, row.draft)
            except Exception as error:                                # this row's settings or stop strings
                events.extend((failed, error) for failed in self.fail(error, [row]))
                continue
            row.draft = NO_DRAFT
            row.cache.truncate(len(row.tokens) - 1)                   # roll back the rejected drafted tokens
            self.generated_tokens += len(verified)
            if row.first_token is None:
                row.first_token = time.perf_counter()
            if verified[-1].finish_reason:
                row.finish_reason, row.finished = verified[-1].finish_reason, time.perf_counter()
                _free(row)
            events.extend((row, event) for event in verified)
        self.rows = [row for row in self.rows if not row.done]
        return events

    def _schedule(self, failures: list[tuple[Row, TokenEvent | BaseException]]) -> list[tuple[Row, Sequence[int]]]:
        """What each row feeds this step, its blocks allocated: decoding rows their last token (and what their
        drafter proposes), prefilling rows chunks of their prompt within the step's prefill budget. Rows are
        served oldest first; when the pool is out of blocks, the newest rows are preempted to make room
        (possibly the row asking), but never for drafted positions: a row without room for its draft decodes
        without it. A row whose drafting raised ends, with its error in `failures`."""
        feeds: list[tuple[Row, Sequence[int]]] = []
        budget = self.prefill_chunk
        self._draft_all(failures)
        for row in list(self.rows):
            if row not in self.rows:                                  # preempted for an older row, or failed
                continue
            assert row.cache is not None
            pending, decoding = row.pending(), row.decoding
            if row.draft.tokens and row.cache.blocks_needed(len(pending) + len(row.draft.tokens)) > self.pool.free_blocks:
                row.draft = NO_DRAFT                # drafted positions are rolled back at once: not worth a preemption
            ids = [*pending, *row.draft.tokens] if decoding else pending[:budget]
            if not ids or not self._make_room(row, len(ids)):
                continue
            row.cache.reserve(len(ids))
            if not decoding:
                budget -= len(ids)
                self.prefilled_tokens += len(ids)
            feeds.append((row, ids))
        return feeds

    def _draft_all(self, failures: list[tuple[Row, TokenEvent | BaseException]]) -> None:
        """Set each decoding row's draft for this step (none without speculation), the draft model's forward
        passes shared by all of them (speculative.propose_together). A row whose drafting raised (e.g. the
        draft's logits not finite) ends, with its error in `failures`."""
        drafting: list[Row] = []
        jobs: list[Job] = []
        for row in self.rows:
            row.draft = NO_DRAFT
            if self.speculation is None or row.drafter is None or row.continuation is None or not row.decoding:
                continue
            if k := row.continuation.room(self.speculation.tokens):
                drafting.append(row)
                jobs.append((row.drafter, row.continuation.sequence, row.continuation.generated, k))
        for row, outcome in zip(drafting, propose_together(jobs)):
            if isinstance(outcome, Exception):
                failures.extend((failed, outcome) for failed in self.fail(outcome, [row]))
            else:
                row.draft = outcome

    def _make_room(self, row: Row, new_tokens: int) -> bool:
        """Preempt the newest rows until `row` can have blocks for `new_tokens` more positions; False if
        `row` itself had to go."""
        assert row.cache is not None
        while row.cache.blocks_needed(new_tokens) > self.pool.free_blocks:
            newest = self.rows[-1]
            self.preempt(newest)
            if newest is row:
                return False
        return True

    def preempt(self, row: Row) -> None:
        """Send a row back to the head of the queue, its blocks freed; it recomputes them when it joins again."""
        _free(row)
        self.rows.remove(row)
        self.preemptions += 1
        with self._lock:
            self._waiting.insert(0, row)

    def fail(self, error: BaseException, rows: Sequence[Row] | None = None) -> list[Row]:
        """End `rows` (default: every row in the batch, when a forward pass raised) with `error`, which each
        keeps as row.error; returns them. The other rows, and waiting ones, stay."""
        failed = list(self.rows if rows is None else rows)
        self.rows = [row for row in self.rows if row not in failed]
        for row in failed:
            row.finish_reason, row.error, row.finished = "error", error, time.perf_counter()
            _free(row)
        return failed

    def _admit(self) -> None:
        """Drop cancelled rows; let waiting rows join, in order, while the batch has room and the pool has
        blocks for the tokens each must read first (those the prefix cache does not hold). A row whose prompt
        a row in the batch is still reading waits for it (follows), the rows behind it going ahead."""
        for row in self.rows:
            if row.cancelled:
                _free(row)
        self.rows = [row for row in self.rows if not row.cancelled]
        with self._lock:
            self._waiting = [row for row in self._waiting if not row.cancelled]
            following: list[Row] = []
            while self._waiting and len(self.rows) < self.max_batch:
                if self.follows(self._waiting[0]):
                    following.append(self._waiting.pop(0))
                elif self._join(self._waiting[0]):
                    del self._waiting[0]
                else:
                    break
            self._waiting[:0] = following

    def follows(self, row: Row) -> bool:
        """Whether `row` (not yet started) has the prompt of a row in the batch that is still reading it: joining
        once that one has read it, it takes the prompt's full blocks from the prefix cache and computes only
        the last, partly filled one. How the n choices of one request (submitted together) share one
        prefill; a prompt shorter than a block has nothing to share, nor has a row of another adapter (its
        keys and values differ)."""
        prompt, adapter = row.request.prompt, row.request.adapter
        return row.continuation is None and len(prompt) > self.pool.block_size and any(
            other.cache is not None and other.cache.length < len(prompt) and len(other.request.prompt) == len(prompt)
            and other.request.adapter is adapter and list(other.request.prompt) == list(prompt) for other in self.rows)

    def _join(self, row: Row) -> bool:
        """Give `row` a cache (taking what the prefix cache holds of its tokens) if the pool has blocks for the
        rest; False, holding nothing, if not."""
        request, first = row.request, row.continuation is None
        size = self._positions(request)
        cache = PagedKVCache(self.pool, size, request.adapter.digest if request.adapter is not None else b"")
        reused = cache.reuse_prefix(row.tokens)
        if cache.blocks_needed(len(row.tokens) - reused) > self.pool.free_blocks:
            cache.free()
            return False
        row.cache = cache
        if first:
            row.cached_tokens = reused
            self.prompt_tokens += len(request.prompt)
            self.reused_tokens += reused
            row.continuation = Continuation(self.tokenizer, request.prompt, request.params, request.max_new_tokens,
                                            size, eos_token_ids=self.eos_token_ids, stop=request.stop,
                                            rng=np.random.default_rng(request.params.seed),
                                            grammar=request.grammar, logprobs=request.logprobs, ending=request.ending,
                                            thinking_budget=request.thinking_budget)
            if self.speculation is not None:
                row.drafter = self.speculation.new_drafter(request.params, size)
        self.rows.append(row)
        return True


def _free(row: Row) -> None:
    """Give a row's blocks back to the pool (its full blocks stay in the prefix cache until evicted), and its
    drafter's (a preempted row's draft cache is rebuilt when it drafts again)."""
    if row.cache is not None:
        row.cache.free()
        row.cache = None
    if row.drafter is not None:
        row.drafter.reset()


class Work(Protocol):
    """Model work beside the batch, done in pieces (generation.embedding.Embedding): step() runs one forward
    pass of it (at most a prefill chunk's tokens) and says whether it is finished."""

    def step(self) -> bool: ...


@dataclass(eq=False)
class Task:
    """Work queued on a BatchRunner; `done` hears None when it has finished, or the exception that ended it."""

    work: Work
    done: Callable[[BaseException | None], None]
    cancelled: bool = False


class BatchRunner:
    """Runs a BatchGenerator's steps on a background thread whenever it has work, and hands each row's
    events to that row's listener (on that thread: listeners must only hand them on, e.g. to an
    event loop). The model is used from this one thread only: other Work runs there too, one piece
    after each step, the tasks taking turns. So a generation waits at most one piece (one prefill
    chunk's forward pass) between its steps, and a task advances at every step however busy the batch."""

    def __init__(self, generator: BatchGenerator) -> None:
        self.generator = generator
        self._tasks: deque[Task] = deque()         # guarded by _lock
        self._lock = threading.Lock()
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

    def run_beside(self, work: Work, done: Callable[[BaseException | None], None]) -> Task:
        """Queue `work` (any thread): its pieces run between the batch's steps; `done` is called on the
        batching thread."""
        task = Task(work, done)
        with self._lock:
            self._tasks.append(task)
        self._wake.set()
        return task

    def _run(self) -> None:
        while not self._stopping:
            self._wake.clear()                  # before looking: a submit after this sets it again
            with self._lock:
                tasks = bool(self._tasks)
            if self.generator.idle and not tasks:
                self._wake.wait()
                continue
            if not self.generator.idle:
                self._step()
            if tasks:
                self._step_task()

    def _step(self) -> None:
        try:
            events = self.generator.step()
        except Exception as error:          # a bug or a bad request must not stop the server's loop
            events = [(row, error) for row in self.generator.fail(error)]
        for row, event in events:
            if row.listener is not None:
                row.listener(event)

    def _step_task(self) -> None:
        """One piece of the first task (a cancelled one is dropped); it goes to the back unless finished."""
        with self._lock:
            task = self._tasks.popleft()
        if task.cancelled:
            return
        try:
            finished = task.work.step()
        except Exception as error:          # this task's own failure: it ends alone
            task.done(error)
            return
        if finished:
            task.done(None)
        else:
            with self._lock:
                self._tasks.append(task)
