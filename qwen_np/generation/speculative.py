"""Speculative decoding: a cheap drafter guesses the next k tokens, and the target model checks all of
them in one forward pass.

A decode step is memory-bound: it reads every weight (and upcasts every BF16 block) to make one token.
A forward pass over k + 1 tokens reads them once too, so the target scores the last token and k
drafted ones for little more than one step, and keeps the drafted tokens it agrees with:

    sequence so far ... "the"           drafter guesses   "cat" "sat" "on"
    target is fed       ["the", "cat", "sat", "on"]       ->  logits at 4 positions
    target's choices     "cat"  "sat"  "in"   (...)
    kept                 "cat"  "sat", then the target's own "in": 3 tokens for one target step

Which drafted tokens are kept (generate.Continuation.verify does it, position by position, for
generate() and the batcher alike):

* greedy: while a drafted token equals the target's argmax; at the first that does not, the target's
  argmax replaces it. So the output is exactly plain greedy decoding's (up to BLAS summing a k+1-row
  product in another order than a one-row one: a last-bit difference can flip only an exact tie).
* sampled: the rejection rule of Leviathan et al. 2023 and Chen et al. 2023 (`accept`): drafted token x,
  drawn from the drafter's distribution q, is kept with probability min(1, p(x) / q(x)), p being the
  target's; at the first rejection a token is drawn from norm(max(0, p - q)) instead. Every emitted
  token is then distributed exactly as p, whatever q is: a better drafter only makes rejections rarer.
  p and q are both the *processed* distributions (sampling.processed_logits: repetition and presence
  penalties, temperature, top-k, top-p, min-p). The penalties depend on the tokens so far, so each
  position's p and q are computed with the drafted tokens before it counted as generated.

When every drafted token is kept, the target's choice after the last one is a bonus token: k + 1
tokens from one step. Afterwards the target's cache holds keys and values for all k + 1 fed tokens;
the positions past the kept ones are rolled back (PagedKVCache.truncate, which also drops the
prefix-cache names of blocks the rejected tokens filled).

Two drafters (the Drafter protocol):

* DraftModel: a smaller Qwen3 with the same tokenizer (Qwen3-0.6B for Qwen3-8B), with a KV cache of
  its own, kept in step with the sequence by cutting it back to what the sequence still starts with.
* PromptLookup: n-gram prompt lookup (transformers' prompt_lookup_num_tokens, vLLM's "ngram"): find
  the sequence's last n tokens earlier in prompt + reply and propose what followed them. No second
  model; it pays off where the reply copies its prompt (code edits, summaries, quoting). Its drafts
  are deterministic: q is one-hot at the drafted token.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..core.defaults import DEFAULT_DRAFT_TOKENS   # defined there for --help, which loads no NumPy
from ..core.config import Qwen3Config
from ..errors import QwenNPError
from ..engine.paged import OwnPoolCache, PagedKVCache
from ..engine.budget import context_for, prefill_chunks
from ..core.model import Qwen3Model
from ..core.sampling import SamplingParams, draw, pick, processed_logits, softmax
from ..files.tokenizer import Tokenizer, common_prefix
from ..engine.finite import check_weights_finite
from ..engine.loading import load_model
from ..files.model_files import ModelFiles, open_model

# Keeps the draft model's random stream apart from the target's: the rejection rule needs the drafted
# token and the uniform that judges it to be independent draws.
DRAFT_STREAM = 1


@dataclass(frozen=True)
class Draft:
    """Drafted tokens [k] and the distributions q [k, V] (float64) they were drawn from; q None: chosen
    deterministically (greedy drafting or lookup), i.e. q one-hot at each token."""

    tokens: list[int]
    q: np.ndarray | None = None

    def distribution(self, i: int) -> np.ndarray | None:
        return None if self.q is None else self.q[i]


NO_DRAFT = Draft([])


class Drafter(Protocol):
    """Guesses how a sequence goes on."""

    def propose(self, sequence: Sequence[int], generated: Sequence[int], k: int) -> Draft:
        """Up to k tokens to follow `sequence` (prompt + reply so far; `generated`: the reply alone)."""
        ...

    def reset(self) -> None:
        """Let go of what is kept for the sequence (its cache's blocks): it left the batch."""
        ...


def accept(p: np.ndarray, q: np.ndarray | None, drafted: int, rng: np.random.Generator) -> int:
    """The token emitted at a drafted position, by the rejection rule: `drafted` with probability
    min(1, p(x) / q(x)), else a draw from norm(max(0, p - q)). p, q [V] float64; q None means one-hot
    at `drafted` (a deterministic draft). The result is distributed as p."""
    q_drafted = 1.0 if q is None else float(q[drafted])
    if rng.random() * q_drafted < p[drafted]:          # u < p/q, without dividing by a q(x) that may be 0
        return drafted
    # max(0, p - q); for a one-hot q that is p without the drafted token.
    residual = np.maximum(p - q, 0.0) if q is not None else np.where(np.arange(p.size) == drafted, 0.0, p)
    if not residual.sum() > 0:                          # p == q up to rounding: a rejection had probability ~0
        return drafted
    with np.errstate(divide="ignore"):                  # log(0) = -inf: no mass, as draw() expects
        return draw(np.log(residual), rng)              # softmax(log r) = r / sum(r)


class PromptLookup:
    """Drafts by n-gram lookup: the earliest earlier occurrence of the sequence's last n tokens (n from
    max_ngram down to 1, as transformers' prompt lookup) and the k tokens that followed it."""

    def __init__(self, max_ngram: int) -> None:
        if max_ngram < 1:
            raise QwenNPError(f"the n-gram size must be >= 1, got {max_ngram}", "max_ngram")
        self.max_ngram = max_ngram

    def propose(self, sequence: Sequence[int], generated: Sequence[int], k: int) -> Draft:
        ids = np.asarray(sequence, dtype=np.int64)
        for n in range(min(self.max_ngram, len(ids) - 1), 0, -1):
            # Window j is ids[j:j+n]; over ids[:-1], so the last n tokens do not match themselves and a
            # match always has at least one token after it.
            windows = sliding_window_view(ids[:-1], n)                                  # [len - n, n]
            found = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if found.size:
                start = int(found[0]) + n
                return Draft(ids[start:start + k].tolist())
        return NO_DRAFT

    def reset(self) -> None:
        pass


class DraftModel:
    """Drafts with a smaller model over its own `cache`: k tokens picked from its processed distributions
    (the target's sampling settings), one forward pass each. Each proposal first cuts the cache back to
    the longest prefix it shares with the sequence (the target rejected the rest) and feeds the remainder.
    When the cache's pool (shared by a batch's rows) has no blocks for that, it proposes nothing.

    A proposal is written once as steps (_begin, then _take per forward pass) that propose_together
    drives for a whole batch's drafters at once; propose() drives it for this one alone."""

    def __init__(self, model: Qwen3Model, params: SamplingParams, cache: PagedKVCache,
                 catch_up: int | None = None) -> None:
        self.model, self.params, self.cache = model, params, cache
        self.catch_up = catch_up       # at most this many tokens fed to catch up per proposal (None: all)
        self.rng = np.random.default_rng(None if params.seed is None else [params.seed, DRAFT_STREAM])
        # The proposal under way (_begin to _draft): its sequence and reply so far, how many tokens it
        # drafts (0: only catching up), and the drafted tokens with their distributions q.
        self._sequence: list[int] = []
        self._generated: list[int] = []
        self._k = 0
        self._tokens: list[int] = []
        self._q: list[np.ndarray] = []

    def propose(self, sequence: Sequence[int], generated: Sequence[int], k: int) -> Draft:
        outcome = propose_together([(self, sequence, generated, k)])[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def _begin(self, sequence: Sequence[int], generated: Sequence[int], k: int) -> list[int]:
        """Start a proposal of up to k tokens: the tokens to feed the draft model first (the part of the
        sequence its cache lacks), or [] if it proposes nothing this time."""
        self._sequence, self._generated, self._tokens, self._q = list(sequence), list(generated), [], []
        # It feeds the sequence and k - 1 drafted tokens: room for that many positions.
        room = context_for(self.model.config, self.cache.max_tokens)
        self._k = min(k, room - len(sequence) + 1)
        if self._k < 1:
            return []
        if not self.cache.length and not self.cache.table:
            self.cache.reuse_prefix(sequence)   # a pool with prefix caching (serve's): what an earlier row filled
        self.cache.truncate(min(common_prefix(self.cache.tokens, sequence), len(sequence) - 1))
        pending = self._sequence[self.cache.length:]
        if self.catch_up is not None and len(pending) > self.catch_up:
            # In a batch, a row's draft cache catches up (its prompt, or after a preemption) a chunk a step, as
            # prompts prefill, so that no other row's step waits for a whole prompt; undrafted until then.
            self._k = 0
            return pending[:self.catch_up] if self.cache.blocks_needed(self.catch_up) <= self.cache.pool.free_blocks else []
        if self.cache.blocks_needed(len(pending) + self._k - 1) > self.cache.pool.free_blocks:
            return []                        # a draft pool shared by a batch is full: this step goes undrafted
        chunks = prefill_chunks(len(pending))   # a whole prompt (generate's first proposal): chunks, but the last
        for chunk in chunks[:-1]:
            self.model.forward(pending[chunk], self.cache, last_only=True)
        return pending[chunks[-1]]

    def _take(self, logits: np.ndarray) -> list[int]:
        """The draft model's logits [V] after the last token fed: pick the next drafted token; the token to
        feed next, or [] when the proposal is complete."""
        if len(self._tokens) == self._k:                                # a catch-up chunk: nothing to draft
            return []
        so_far, reply = [*self._sequence, *self._tokens], [*self._generated, *self._tokens]
        processed = processed_logits(logits, self.params, so_far, reply)
        self._tokens.append(pick(processed, self.params, self.rng))
        if not self.params.greedy:
            self._q.append(softmax(processed))
        return self._tokens[-1:] if len(self._tokens) < self._k else []

    def _draft(self) -> Draft:
        return Draft(self._tokens, np.stack(self._q) if self._q else None) if self._tokens else NO_DRAFT

    def reset(self) -> None:
        self.cache.free()


Job = tuple[Drafter, Sequence[int], Sequence[int], int]      # a drafter, its sequence, its reply so far, k


def propose_together(jobs: Sequence[Job]) -> list[Draft | Exception]:
    """Every job's proposal, or the exception that ended it (that job only). The DraftModels' passes are
    shared: each round feeds every drafter still drafting one forward_batch of the draft model (a batch's
    rows draft k tokens in k passes, not in k passes per row; a few rows cost about one, fast.py)."""
    outcomes: list[Draft | Exception] = [NO_DRAFT] * len(jobs)
    feeding: dict[int, tuple[DraftModel, list[int]]] = {}      # job -> its drafter, the tokens it reads next
    for i, (drafter, sequence, generated, k) in enumerate(jobs):
        try:
            if not isinstance(drafter, DraftModel):
                outcomes[i] = drafter.propose(sequence, generated, k)
            elif ids := drafter._begin(sequence, generated, k):
                feeding[i] = drafter, ids
        except Exception as error:                        # e.g. non-finite draft logits in its sampling
            outcomes[i] = error
    while feeding:
        by_model: dict[int, list[int]] = {}
        for i, (drafter, _) in feeding.items():
            by_model.setdefault(id(drafter.model), []).append(i)
        for members in by_model.values():
            drafters = [feeding[i][0] for i in members]
            logits = drafters[0].model.forward_batch([feeding[i][1] for i in members], [d.cache for d in drafters],
                                                     last_only=True)                          # [B, V]
            for i, drafter, row in zip(members, drafters, logits):
                try:
                    ids = drafter._take(row)
                except Exception as error:
                    outcomes[i], ids = error, []
                if ids:
                    feeding[i] = drafter, ids
                    continue
                del feeding[i]
                if not isinstance(outcomes[i], Exception):
                    outcomes[i] = drafter._draft()
    return outcomes


@dataclass(frozen=True)
class Speculation:
    """How to speculate: `tokens` (k) drafted per target step, by drafters that `new_drafter(params,
    max_tokens)` makes, one per sequence (max_tokens: the positions the sequence may reach)."""

    tokens: int
    new_drafter: Callable[[SamplingParams, int], Drafter]
    describe: str                               # for the stats line, e.g. "lookup:3" or "draft"


def lookup_speculation(max_ngram: int, tokens: int = DEFAULT_DRAFT_TOKENS) -> Speculation:
    drafter = PromptLookup(max_ngram)          # checked now; it keeps nothing per sequence
    return Speculation(_checked_tokens(tokens), lambda params, max_tokens: drafter, f"lookup:{max_ngram}")


def draft_speculation(draft: Qwen3Model, tokens: int = DEFAULT_DRAFT_TOKENS,
                      new_cache: Callable[[int], PagedKVCache] | None = None, catch_up: int | None = None) -> Speculation:
    """Drafting with `draft`; each sequence's draft cache from new_cache(positions) (default: a pool of its
    own, OwnPoolCache), with room for the k - 1 drafted tokens it feeds past the sequence; catch_up: see
    DraftModel (a batch's rows: its prefill chunk)."""
    k = _checked_tokens(tokens)
    make = new_cache or (lambda positions: OwnPoolCache(draft.config, positions))

    def new_drafter(params: SamplingParams, max_tokens: int) -> Drafter:
        return DraftModel(draft, params, make(max_tokens + k), catch_up)

    return Speculation(k, new_drafter, "draft")


@dataclass
class SpeculationCounts:
    """How a generation's target steps went: the one tally that generate(), the batcher's rows, the CLI's
    summary and the server's `usage` all read."""

    target_steps: int = 0         # target forward passes whose logits chose tokens (the prompt's prefill included)
    drafted_tokens: int = 0       # drafted tokens judged ...
    accepted_tokens: int = 0      # ... and kept

    def __add__(self, other: SpeculationCounts) -> SpeculationCounts:
        return SpeculationCounts(self.target_steps + other.target_steps, self.drafted_tokens + other.drafted_tokens,
                                 self.accepted_tokens + other.accepted_tokens)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

    def tokens_per_step(self, new_tokens: int) -> float | None:
        return new_tokens / self.target_steps if self.target_steps else None

    def usage(self, completion_tokens: int) -> dict[str, object]:
        """What a reply's `usage` adds when decoding speculatively: OpenAI's completion_tokens_details for
        predicted tokens (the draft is the prediction), and `speculative_decoding` with the rates."""
        rate, per_step = self.acceptance_rate, self.tokens_per_step(completion_tokens)
        return {"completion_tokens_details": {"accepted_prediction_tokens": self.accepted_tokens,
                                              "rejected_prediction_tokens": self.drafted_tokens - self.accepted_tokens},
                "speculative_decoding": {"drafted_tokens": self.drafted_tokens, "accepted_tokens": self.accepted_tokens,
                                         "acceptance_rate": None if rate is None else round(rate, 4),
                                         "target_steps": self.target_steps,
                                         "tokens_per_step": None if per_step is None else round(per_step, 4)}}


def _checked_tokens(tokens: int) -> int:
    if tokens < 1:
        raise QwenNPError(f"must be >= 1, got {tokens}", "draft_tokens")
    return tokens


def check_draft(target: Qwen3Config, target_tokenizer: Tokenizer, draft: Qwen3Config, draft_tokenizer: Tokenizer) -> None:
    """Raise QwenNPError (about the draft) unless the draft speaks the target's tokens: the same vocabulary
    size and the same token strings for the same ids (checked from the small files, before any weight loads)."""
    if draft.vocab_size != target.vocab_size:
        raise QwenNPError(f"its vocabulary has {draft.vocab_size} ids, the model's "
                          f"{target.vocab_size}: a draft needs the model's tokenizer", "draft")
    if draft_tokenizer.backend.get_vocab(with_added_tokens=True) != target_tokenizer.backend.get_vocab(with_added_tokens=True):
        raise QwenNPError("its tokenizer maps tokens to other ids than the model's: a draft needs the "
                          "model's tokenizer", "draft")


def check_draft_folder(path: str | Path | ModelFiles, config: Qwen3Config, tokenizer: Tokenizer) -> None:
    """Raise QwenNPError (about the draft) unless the checkpoint at `path` can draft for a model of `config`
    and `tokenizer` (speculative.check_draft), reading only its small files."""
    try:
        draft = open_model(path, "draft")
        draft_config, draft_tokenizer = draft.config, draft.tokenizer
    except QwenNPError as problem:
        if problem.param == "draft":        # already about the draft: its path
            raise
        raise QwenNPError(str(problem), "draft") from None
    check_draft(config, tokenizer, draft_config, draft_tokenizer)


def load_draft(path: str | Path | ModelFiles, memory: str = "auto", max_tokens: int | None = None) -> Qwen3Model:
    """The draft model of --draft (its folder checked first by check_draft_folder), loaded like the model,
    its weights checked to be finite, so that NaN weights are reported as the draft's, not as a request's
    sampling settings that the drafter's NaN logits would seem to break."""
    model = load_model(path, memory=memory, max_tokens=max_tokens)
    try:
        check_weights_finite(model)
    except QwenNPError as problem:
        raise QwenNPError(str(problem), "draft") from None
    return model
