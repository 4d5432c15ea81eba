"""Generating text: prefill the prompt, then sample one token at a time through the KV cache.

    from qwen_np import load_model
    from qwen_np.files.checkpoint import resolve_model_path
    from qwen_np.generation.generate import generate, prompt_ids, resolve_sampling
    from qwen_np.files.model_files import read_generation_defaults, read_tokenizer

    folder = resolve_model_path("Qwen/Qwen3-0.6B")
    model, tokenizer = load_model(folder), read_tokenizer(folder)
    defaults = read_generation_defaults(folder, model.config)
    params = resolve_sampling(defaults, enable_thinking=False, seed=0)
    ids = prompt_ids(tokenizer, "Why is the sky blue?", enable_thinking=False)
    for event in generate(model, tokenizer, ids, params, 200, eos_token_ids=defaults.eos_token_ids):
        print(event.text, end="", flush=True)

`ChatSession` holds a multi-turn conversation whose KV cache survives between turns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ..core.config import Qwen3Config
from ..errors import QwenNPError
from ..engine.runtime import peak_rss_bytes
from ..engine.finite import check_finite
from ..engine.budget import context_for, prefill_chunks
from ..core.kv_cache import SequenceCache
from ..core.model import Qwen3Model, Trace
from ..core.sampling import SamplingParams, pick, processed_logits, softmax
from .speculative import NO_DRAFT, Draft, Drafter, Speculation, SpeculationCounts, accept
from .constraints import Grammar
from .logprobs import Logprobs, check_top_logprobs, token_logprobs
from .thinking import ThinkingBudget
from ..files.tokenizer import Message, StreamDecoder, Tokenizer, chat_delta
from ..files.model_files import GenerationDefaults

# The Qwen3 model card's settings for non-thinking mode, used with enable_thinking=False.
NON_THINKING_SAMPLING = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0}


@dataclass(frozen=True)
class TokenEvent:
    """One generated token and the text it completes ("" while a multi-byte character is unfinished).

    The last event carries `finish_reason`: "eos" (its token is the end-of-sequence id, whose own
    text is not included), "stop" (the text reached one of the stop strings, which is not included, or
    the grammar it was constrained to is complete, or the token is one of the stop token ids, whose text is
    not included either), "length" (max_new_tokens reached) or "context" (the context is full). `logprobs`:
    the token's log-probabilities, when they were asked for.
    """

    token_id: int
    text: str
    finish_reason: str | None = None
    logprobs: Logprobs | None = None


@dataclass
class GenerationStats:
    """Counts and timings of one generation, kept current while it runs (so Ctrl-C can still report)."""

    prompt_tokens: int = 0        # prompt tokens run through the model in this call
    cached_tokens: int = 0        # prompt tokens whose keys/values were already in the cache
    new_tokens: int = 0
    load_seconds: float = 0.0     # filled in by whoever loads the model
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0   # sampling every new token and running all but the last through the model
    finish_reason: str | None = None
    seed: int | None = None       # shown in the summary: the seed drawn for a run that was given none
    speculation: str | None = None   # the drafter when decoding speculatively (speculative.Speculation.describe)
    counts: SpeculationCounts = field(default_factory=SpeculationCounts)   # its target steps and drafts

    def summary(self, model_name: str) -> str:
        """The one-line report printed after every run."""
        return (f"stats: model={model_name} prompt_tokens={self.prompt_tokens} cached_tokens={self.cached_tokens} "
                f"new_tokens={self.new_tokens} load={self.load_seconds:.2f}s "
                f"prefill={_rate(self.prompt_tokens, self.prefill_seconds)} "
                f"decode={_rate(self.new_tokens, self.decode_seconds)} "
                f"peak_rss={peak_rss_bytes() / 2**20:.0f}MiB finish={self.finish_reason or 'none'}"
                + (f" seed={self.seed}" if self.seed is not None else "") + self._speculation())

    def _speculation(self) -> str:
        if self.speculation is None:
            return ""
        rate, per_step = self.counts.acceptance_rate, self.counts.tokens_per_step(self.new_tokens)
        return (f" speculative={self.speculation} accepted={self.counts.accepted_tokens}/{self.counts.drafted_tokens}"
                f"({'n/a' if rate is None else f'{rate:.0%}'}) "
                f"tokens_per_step={'n/a' if per_step is None else f'{per_step:.2f}'}")


def _rate(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:.1f}tok/s" if seconds > 0 and tokens else "n/a"


def resolve_sampling(defaults: GenerationDefaults, enable_thinking: bool | None = None,
                     **explicit: float | int | None) -> SamplingParams:
    """The sampling settings to use: explicit values (None = not given) win over the model card's
    non-thinking settings when enable_thinking is False, which win over the checkpoint's defaults."""
    chosen: dict[str, Any] = {**(NON_THINKING_SAMPLING if enable_thinking is False else {}),
              **{key: value for key, value in explicit.items() if value is not None}}
    return replace(defaults.sampling, **chosen)


def chat_messages(user: str, system: str | None = None) -> list[Message]:
    """A conversation's opening messages: the optional system prompt, then the user's."""
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]


def prompt_ids(tokenizer: Tokenizer, prompt: str, chat: bool = True, enable_thinking: bool | None = None,
               system: str | None = None) -> list[int]:
    """Token ids for `prompt`: rendered as a user message with the chat template (the message read as text,
    Tokenizer.encode_chat), or as plain text (special-token strings in it are those tokens)."""
    if not prompt.strip():
        raise QwenNPError("prompt: empty (give the text to continue or the question to ask)")
    if not chat:
        if system is not None:
            raise QwenNPError("a system prompt needs the chat template, and chat is off", "system")
        return tokenizer.encode(prompt)
    return tokenizer.encode_chat(chat_messages(prompt, system), add_generation_prompt=True,
                                 enable_thinking=enable_thinking)


def context_budget(config: Qwen3Config, prompt_tokens: int, max_new_tokens: int) -> int:
    """KV cache positions one generation needs: prompt + new tokens, capped at the model's context.

    Raises when the prompt leaves no room for a single new token (checked before loading weights).
    """
    context = context_for(config, default=None)
    where = f"the model's {context}-token context"
    _check_room(prompt_tokens, max_new_tokens, context, where)
    return context_for(config, prompt_tokens + max_new_tokens, default=None)


def _check_room(prompt_tokens: int, max_new_tokens: int, limit: int, where: str) -> None:
    if max_new_tokens < 0:
        raise QwenNPError(f"must be >= 0, got {max_new_tokens}", "max_new_tokens")
    if prompt_tokens + min(max_new_tokens, 1) > limit:
        raise QwenNPError(f"prompt: {prompt_tokens} tokens leave no room for new tokens in {where}")


def generate(model: Qwen3Model, tokenizer: Tokenizer, prompt_ids: Sequence[int], params: SamplingParams,
             max_new_tokens: int, *, eos_token_ids: Sequence[int] = (), cache: SequenceCache | None = None,
             rng: np.random.Generator | None = None, trace: Trace | None = None,
             stats: GenerationStats | None = None, stop: Sequence[str] = (),
             kv_dtype: str = "fp32", speculation: Speculation | None = None,
             drafter: Drafter | None = None, grammar: Grammar | None = None,
             logprobs: int | None = None, ending: Ending | None = None,
             observe: Observer | None = None, thinking_budget: int | None = None) -> Iterator[TokenEvent]:
    """Yield one TokenEvent per generated token until an EOS id, a stop string, max_new_tokens or the
    context limit.

    With a `cache`, its first `cache.length` positions must hold `prompt_ids[:cache.length]`; only
    the rest of the prompt is prefilled; without one, a cache storing `kv_dtype` (kv_cache.KV_DTYPES) is
    made for it. `rng` defaults to one seeded with params.seed. `trace`
    sees the prompt prefill and the first decode step. `stats`, when given, is updated as it runs.
    With a `speculation` (speculative.py), each target step verifies the tokens its drafter proposes; the
    output is plain decoding's (greedy: the same tokens; sampled: the same distribution). `drafter`: one
    the caller keeps (a chat's, whose draft cache then holds the conversation across turns) instead of a
    new one from `speculation`, left as it is at the end. `grammar`: the reply follows it (constraints.py);
    `logprobs`: each event carries its token's log-probabilities and this many top alternatives (0-20);
    `ending`: vLLM's stop_token_ids, ignore_eos and min_tokens (Ending); `observe`: sees each position's
    choice (Chosen) as it is made; `thinking_budget`: the reply's thinking ends within that many tokens and
    Qwen's closing text (thinking.py).
    """
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise QwenNPError("prompt: no tokens")
    if cache is None:
        cache = model.new_cache(context_budget(model.config, len(prompt), max_new_tokens), kv_dtype)
    limit = context_for(model.config, cache.max_tokens)
    if cache.length >= len(prompt):
        raise QwenNPError(f"cache: holds {cache.length} positions, the whole {len(prompt)}-token prompt; "
                          "at least one prompt token must be new")
    _check_room(len(prompt), max_new_tokens, limit, f"a {limit}-token context")
    stats = stats if stats is not None else GenerationStats()
    stats.cached_tokens, stats.prompt_tokens = cache.length, len(prompt) - cache.length

    started = time.perf_counter()
    logits = check_finite(model, prompt, _prefill(model, prompt[cache.length:], cache, trace))   # [V]
    stats.prefill_seconds = time.perf_counter() - started
    if max_new_tokens == 0:
        stats.finish_reason = "length"
        return

    sequence = Continuation(tokenizer, prompt, params, max_new_tokens, limit, eos_token_ids=eos_token_ids,
                            stop=stop, rng=rng, grammar=grammar, logprobs=logprobs, ending=ending,
                            observe=observe, thinking_budget=thinking_budget)
    if speculation is not None or drafter is not None:
        yield from _speculative_decode(model, sequence, cache, logits, stats, speculation, drafter, trace)
        return
    # The decode loop: choose a token from the last position's logits, show it, run it through the model.
    try:
        while True:
            started = time.perf_counter()
            event, = sequence.verify(logits[None], NO_DRAFT)                   # one row, one token
            stats.decode_seconds += time.perf_counter() - started
            stats.new_tokens, stats.finish_reason = len(sequence.generated), event.finish_reason
            yield event                           # before the next forward pass: print as soon as known
            if event.finish_reason:
                return
            started = time.perf_counter()
            step = model.forward([event.token_id], cache, trace if len(sequence.generated) == 1 else None)
            logits = check_finite(model, sequence.sequence, step[-1])                            # [V]
            stats.decode_seconds += time.perf_counter() - started
    finally:
        stats.counts = sequence.counts


def _speculative_decode(model: Qwen3Model, sequence: Continuation, cache: SequenceCache, logits: np.ndarray,
                        stats: GenerationStats, speculation: Speculation | None, drafter: Drafter | None,
                        trace: Trace | None) -> Iterator[TokenEvent]:
    """generate()'s decode loop when each step verifies drafted tokens: the drafter proposes k, the model
    runs the last token and the k drafted ones in one forward pass, and Continuation.verify keeps the
    drafted tokens the model agrees with (speculative.py's rule), then its own next token."""
    kept = drafter is not None
    if drafter is None and speculation is not None:
        drafter = speculation.new_drafter(sequence.params, sequence.limit)
    stats.speculation = speculation.describe if speculation is not None else None
    rows, draft = logits[None], NO_DRAFT                      # [1, V]: the prompt's last position
    try:
        while True:
            started = time.perf_counter()
            events = sequence.verify(rows, draft)
            cache.truncate(len(sequence.sequence) - 1)        # roll back the rejected drafted tokens' positions
            stats.decode_seconds += time.perf_counter() - started
            for shown, event in enumerate(events, len(sequence.generated) - len(events) + 1):
                stats.new_tokens, stats.finish_reason = shown, event.finish_reason
                yield event                       # before the next forward pass: print as soon as known
            if events[-1].finish_reason:
                return
            started = time.perf_counter()
            k = sequence.room(speculation.tokens) if speculation is not None else 0
            draft = drafter.propose(sequence.sequence, sequence.generated, k) if drafter is not None and k else NO_DRAFT
            fed = [events[-1].token_id, *draft.tokens]
            rows = model.forward(fed, cache, trace if len(sequence.generated) == 1 else None)     # [k+1, V]
            check_finite(model, sequence.sequence + draft.tokens, rows)
            stats.decode_seconds += time.perf_counter() - started
    finally:
        stats.counts = sequence.counts
        if drafter is not None and not kept:
            drafter.reset()


@dataclass(frozen=True)
class Ending:
    """When a sequence may end besides its EOS ids, stop strings and token limits: vLLM's request fields,
    with vLLM's meaning. stop_token_ids end it like an EOS id (finish "stop", the token's text left out);
    ignore_eos: the EOS ids are tokens like any other; min_tokens: until that many tokens are generated,
    the EOS and stop ids cannot be sampled (their logits are -inf) and stop strings are not looked for (a
    stop string counts only in the text of the tokens after the first min_tokens).

    Under a grammar, a stop (string or id) applies only where the grammar could end the sequence (its
    free text): inside a value (a JSON answer, a tool call, a think block that must close) a stop id is one
    of the value's tokens and no stop string is looked for, so no stop cuts a value. ignore_eos: the grammar
    never takes an EOS id as text, and a value ends where it is complete, or at the token limit. An ending
    that bans every token the grammar allows next (min_tokens of a value complete before them) is an error
    naming its field."""

    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0


@dataclass(frozen=True)
class Chosen:
    """One position's choice as Continuation.verify makes it, for an observer (the explorer's mask view
    reports what the grammar removed): the model's own logits there, the grammar's mask and the token."""

    logits: np.ndarray                 # [V] raw: before min_tokens, the penalties, the mask and the filters
    allowed: np.ndarray | None         # bool [V]: the tokens the grammar allowed (None: no grammar)
    token: int


Observer = Callable[[Chosen], None]


class Continuation:
    """One sequence's generation between forward passes: its tokens so far, its sampler's random
    stream, its streaming detokeniser and its stop strings; with a grammar, its place in it (the tokens
    the grammar forbids are masked out of every position's distribution); with logprobs, how many top
    alternatives each event reports; with an observer, who sees each choice (Chosen); with a thinking budget,
    the tokens that close its thinking once the budget is spent (thinking.py). `verify(logits,
    draft)` picks the next token(s) of one target step and says what text each completes. generate()
    drives one; batching.BatchGenerator drives one per row.
    """

    def __init__(self, tokenizer: Tokenizer, prompt: Sequence[int], params: SamplingParams, max_new_tokens: int,
                 limit: int, *, eos_token_ids: Sequence[int] = (), stop: Sequence[str] = (),
                 rng: np.random.Generator | None = None, grammar: Grammar | None = None,
                 logprobs: int | None = None, ending: Ending | None = None,
                 observe: Observer | None = None, thinking_budget: int | None = None) -> None:
        self.params, self.max_new_tokens, self.limit = params, max_new_tokens, limit
        ending = ending or Ending()
        self.ignore_eos = ending.ignore_eos
        self.eos = set() if ending.ignore_eos else set(eos_token_ids)
        self.stop_ids, self.min_tokens = set(ending.stop_token_ids), ending.min_tokens
        self.banned = np.array(sorted(self.eos | self.stop_ids), dtype=np.int64)   # while under min_tokens
        self.rng = rng if rng is not None else np.random.default_rng(params.seed)
        self.sequence = [int(t) for t in prompt]        # prompt + generated: the repetition penalty's context
        self.generated: list[int] = []
        self.decoder = StreamDecoder(tokenizer)
        self.stops = StopStrings(stop)
        self.counts = SpeculationCounts()
        # Constrained decoding and log-probabilities (constraints.py, logprobs.py): None when not asked for.
        self.constraint = grammar.constraint() if grammar is not None else None
        self.tokenizer, self.logprobs = tokenizer, None if logprobs is None else check_top_logprobs(logprobs)
        self.observe = observe
        # The thinking held to a budget (thinking.py): None when not asked for.
        self.thinking = None if thinking_budget is None else ThinkingBudget(tokenizer, thinking_budget, prompt)

    def room(self, k: int) -> int:
        """How many tokens a step may draft: at most k, leaving room in max_new_tokens for the target's own
        token after them and, in the context, for the k + 1 positions the target is fed."""
        return max(0, min(k, self.max_new_tokens - len(self.generated) - 1, self.limit - len(self.sequence)))

    def verify(self, logits: np.ndarray, draft: Draft) -> list[TokenEvent]:
        """The tokens one target step gives (speculative's rule), from the logits [k+1, V] of its fed tokens:
        the last token, then the k drafted ones. Row i judges drafted token i: kept, or replaced by the
        target's choice, which ends the step; row k gives a bonus token when every drafted one was kept. Ends
        early when a token finishes the sequence. Plain decoding is the step with no draft: one row, one token."""
        events: list[TokenEvent] = []
        for i, row in enumerate(logits):
            drafted = draft.tokens[i] if i < len(draft.tokens) else None
            free = self._free()                                   # a stop may end the sequence here
            masked = row                                 # row stays the raw logits the log-probabilities read
            if self.constraint is None and self._holding():                 # no ending yet: vLLM's min_tokens
                masked = row.copy()
                masked[self.banned[self.banned < row.size]] = -np.inf
            allowed = self._allowed(free)                                               # [V] or None
            forced = self.thinking.forced() if self.thinking is not None else None
            if forced is not None and (allowed is None or allowed[forced]):  # a grammar that forbids it leads
                allowed = np.zeros(row.size, dtype=bool)
                allowed[forced] = True
            processed = processed_logits(masked, self.params, self.sequence, self.generated, allowed)  # [V]
            if drafted is None or self.params.greedy:      # greedy: kept when it is the argmax
                token = pick(processed, self.params, self.rng)
            else:
                token = accept(softmax(processed), draft.distribution(i), drafted, self.rng)
            if self.observe is not None:
                self.observe(Chosen(row, allowed, token))
            if drafted is not None:
                self.counts.drafted_tokens += 1
                self.counts.accepted_tokens += token == drafted
            events.append(self._emit(token, row, free))
            if self.thinking is not None:
                self.thinking.saw(token)
            if events[-1].finish_reason or token != drafted:
                break
        self.counts.target_steps += 1
        return events

    def _holding(self) -> bool:
        """Whether min_tokens still holds the sequence's end back (its EOS and stop ids cannot be sampled)."""
        return len(self.generated) < self.min_tokens and bool(self.banned.size)

    @property
    def _holds(self) -> str:
        return f"no end (EOS or stop id) for {self.min_tokens} tokens"

    def _allowed(self, free: bool) -> np.ndarray | None:
        """The tokens the grammar allows next (bool [V]; None without a grammar), less the ones this sequence's
        ending bans here: the EOS ids under ignore_eos (never the grammar's text), and under min_tokens, where
        the grammar could end (free), the EOS and stop ids. Raises, naming the field, when that bans all."""
        if self.constraint is None:
            return None
        allowed, n = self.constraint.allowed(), len(self.generated)
        bans: list[tuple[str, Sequence[int], str]] = []          # (field, the ids it bans here, its rule)
        if self.ignore_eos:
            bans.append(("ignore_eos", self.constraint.ends, "the end of the sequence is never text"))
        if free and self._holding():
            bans.append(("min_tokens", self.banned.tolist(), self._holds))
        for name, banned, rule in bans:
            allowed = allowed.copy()
            allowed[[t for t in banned if t < allowed.size]] = False
            if not allowed.any():
                raise _conflict(name, rule, n)
        return allowed

    def _emit(self, token: int, logits: np.ndarray, free: bool = True) -> TokenEvent:
        """Append a chosen token (its position's raw logits [V]; free: whether a stop could end the sequence
        before it); its event says what text it completes and whether the sequence ends."""
        self.sequence.append(token)
        self.generated.append(token)
        logprobs = None if self.logprobs is None else token_logprobs(logits, token, self.logprobs, self.tokenizer)
        # By its id (its own text left out); a stop id inside a grammar's value is one of the value's tokens.
        ended = token in self.eos or (token in self.stop_ids and free)
        complete = False                           # the grammar is complete: nothing but an end may follow
        if self.constraint is not None and not ended:
            self.constraint.consume(token)
            complete = self.constraint.done
            if complete and self._holding():             # only an end may follow, and min_tokens bans it
                raise _conflict("min_tokens", self._holds, len(self.generated))
        finish = ("eos" if token in self.eos else "stop" if ended or complete else "length"
                  if len(self.generated) == self.max_new_tokens else "context" if len(self.sequence) >= self.limit
                  else None)
        text = self.decoder.flush() if ended else self.decoder.push(token) + (self.decoder.flush() if finish else "")
        # Stop strings count only after min_tokens tokens, and under a grammar only in text that the grammar
        # could end both before and after (its free text), so that none cuts a value.
        if len(self.generated) > self.min_tokens and free and (not self.stops.stops or self._free()):
            text, stopped = self.stops.push(text)
            if stopped:
                return TokenEvent(token, text, "stop", logprobs)
        else:
            text = self.stops.flush() + text       # what was held could have been a stop only in free text
        return TokenEvent(token, text + self.stops.flush() if finish else text, finish, logprobs)

    def _free(self) -> bool:
        """Whether a stop could end the sequence where it is now (no grammar, or one that could end here)."""
        return self.constraint is None or self.constraint.accepting


def _conflict(field: str, rule: str, tokens: int) -> QwenNPError:
    """The error of an ending field (`rule`: what it asks) that bans every token a grammar allows next."""
    return QwenNPError(f"{rule}, but after {tokens} tokens the grammar the reply follows allows nothing else next",
                       field)


class StopStrings:
    """Streamed text with stop strings: releases text as it comes, except a tail that could still grow
    into a stop string (a stop string may straddle tokens, e.g. "\n\n" from two "\n" tokens), and
    ends the text just before the first stop string found.

    Hand-written: tokenizers and the sampling libraries have nothing for text-level stops.
    """

    def __init__(self, stops: Sequence[str] = ()) -> None:
        self.stops = [stop for stop in stops if stop]
        self.held = ""

    def push(self, text: str) -> tuple[str, bool]:
        """(text that can be shown now, whether a stop string was reached)."""
        self.held += text
        found = [index for index in (self.held.find(stop) for stop in self.stops) if index >= 0]
        if found:
            released, self.held = self.held[:min(found)], ""
            return released, True
        keep = max((size for stop in self.stops for size in range(1, min(len(stop), len(self.held) + 1))
                    if self.held.endswith(stop[:size])), default=0)
        released, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return released, False

    def flush(self) -> str:
        """The held-back tail, when the text ends without reaching a stop string."""
        released, self.held = self.held, ""
        return released


def _prefill(model: Qwen3Model, ids: list[int], cache: SequenceCache, trace: Trace | None) -> np.ndarray:
    """Run the prompt through the model in chunks; return the last position's logits [V].

    Only the last position's logits are needed, so the LM head runs on one row, except under a
    trace, which shows every step for every prompt position ([T, V] logits, as `inspect` lists them).
    """
    for chunk in prefill_chunks(len(ids)):
        logits = model.forward(ids[chunk], cache, trace, last_only=trace is None)
    return logits[-1]


class ChatSession:
    """A multi-turn conversation that keeps the KV cache between turns.

    Each turn renders the whole conversation with the chat template, but only the tokens the cache
    does not hold yet are run through the model. Qwen3's template drops the thinking of earlier
    turns, so a new turn may differ from what was fed inside the last reply: the cache is then cut
    back to the common prefix (tokenizer.chat_delta), never rebuilt from scratch.
    """

    def __init__(self, model: Qwen3Model, tokenizer: Tokenizer, params: SamplingParams, *,
                 eos_token_ids: Sequence[int] = (), system: str | None = None,
                 enable_thinking: bool | None = None, max_tokens: int | None = None, kv_dtype: str = "fp32",
                 speculation: Speculation | None = None, thinking_budget: int | None = None) -> None:
        self.model, self.tokenizer, self.params, self.speculation = model, tokenizer, params, speculation
        self.thinking_budget = thinking_budget           # each reply's thinking at most (thinking.py)
        self.eos_token_ids = tuple(eos_token_ids)
        self.enable_thinking = enable_thinking
        self.system = system
        self.messages: list[Message] = []
        # Default: the context the memory plan reserved (not the model's full context, which for
        # Qwen3 would be 40960 positions, ~11 GiB of FP32 cache at 8B).
        planned = model.plan.max_tokens if model.plan is not None else None
        self.cache = model.new_cache(context_for(model.config, max_tokens or planned), kv_dtype)
        self.rng = np.random.default_rng(params.seed)   # one stream across turns: a seed fixes the chat
        self.fed_ids: list[int] = []                     # the tokens whose keys/values the cache holds
        # Kept across turns too: a draft model's cache then holds the conversation (cut back to what the
        # next turn starts with), so a turn drafts after reading only its new tokens, as the target does.
        self.drafter = speculation.new_drafter(params, self.cache.max_tokens) if speculation is not None else None

    def set_system(self, text: str | None) -> None:
        """Replace the system prompt (None: none); the conversation goes on under it from the next turn."""
        self.system = text
        turns = [message for message in self.messages if message["role"] != "system"]
        self.messages = chat_messages("", text)[:-1] + turns if turns else []

    def clear(self) -> None:
        """Forget every turn (the system prompt stays); the cache is cut back on the next turn."""
        self.messages = []

    def make_room(self, text: str, max_new_tokens: int) -> int:
        """Drop the oldest turns (a user message and its reply) until the conversation with `text`
        leaves room for a reply of min(max_new_tokens, a quarter of the context) tokens; returns how
        many turns went. The system prompt always stays. send() calls it too."""
        reserve = max(1, min(max_new_tokens, self.cache.max_tokens // 4))
        dropped = 0
        while True:
            ids = self.tokenizer.encode_chat(self._with(text), add_generation_prompt=True,
                                             enable_thinking=self.enable_thinking)
            users = [i for i, message in enumerate(self.messages) if message["role"] == "user"]
            if len(ids) + reserve <= self.cache.max_tokens or not users:
                return dropped
            end = users[1] if len(users) > 1 else len(self.messages)
            del self.messages[users[0]:end]
            dropped += 1

    def _with(self, text: str) -> list[Message]:
        return self.messages + chat_messages(text, self.system if not self.messages else None)

    def send(self, text: str, max_new_tokens: int, stats: GenerationStats | None = None) -> Iterator[TokenEvent]:
        """Add a user message and yield the reply's tokens; the reply joins the history when it ends
        (or is interrupted, e.g. by Ctrl-C: the part generated so far is kept). When the context is
        too full, the oldest turns are dropped first (make_room)."""
        if not text.strip():
            raise QwenNPError("chat: empty message")
        self.make_room(text, max_new_tokens)
        messages = self._with(text)
        delta = chat_delta(self.tokenizer, self.fed_ids, messages, enable_thinking=self.enable_thinking)
        self.cache.truncate(delta.keep)
        ids = self.fed_ids[:delta.keep] + delta.ids
        reply: list[int] = []
        answered = False     # True once the model has produced anything, even an immediate EOS
        try:
            for event in generate(self.model, self.tokenizer, ids, self.params, max_new_tokens,
                                  eos_token_ids=self.eos_token_ids, cache=self.cache, rng=self.rng, stats=stats,
                                  speculation=self.speculation, drafter=self.drafter,
                                  thinking_budget=self.thinking_budget):
                answered = True
                if event.finish_reason != "eos":
                    reply.append(event.token_id)
                yield event
        finally:
            # The cache holds a prefix of prompt + reply (an interrupted forward pass adds nothing).
            self.fed_ids = (ids + reply)[:self.cache.length]
            if answered:
                self.messages = messages + [{"role": "assistant", "content": self.tokenizer.decode(reply)}]
