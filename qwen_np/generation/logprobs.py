"""Log-probabilities of generated tokens: what evaluation harnesses and OpenAI's `logprobs` read.

They are the model's own distribution: a log-softmax of the raw logits at the position that chose the
token, before temperature, penalties, logit bias, the grammar mask and the filters (vLLM's default,
and what a harness scoring a model expects: the sampler's settings do not change the model's belief).
Computed in float64 (core.layers.log_softmax), once per chosen token, with the k most likely
alternatives (OpenAI's top_logprobs: 0-20), each with its text and bytes (a byte-level BPE token may
hold part of a UTF-8 character: its text alone then shows U+FFFD, its bytes say what it is).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.adapters import Adapter
from ..core.layers import log_softmax
from ..core.model import Qwen3Model
from ..errors import QwenNPError
from ..files.tokenizer import Tokenizer

MAX_TOP_LOGPROBS = 20       # OpenAI's limit for top_logprobs
# Prompt positions PromptLogprobs scores per forward pass: their logits [T, V] are what a pass holds at
# once (128 x Qwen3's 151,936 FP32 logits: 78 MB).
SCORE_CHUNK = 128


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability, with its text and bytes."""

    token_id: int
    logprob: float
    text: str
    bytes: bytes


@dataclass(frozen=True)
class Logprobs:
    """The chosen token's log-probability and the `top` most likely tokens at its position (most likely
    first), which may include the chosen one."""

    chosen: TokenLogprob
    top: tuple[TokenLogprob, ...]


def check_top_logprobs(top: int) -> int:
    if isinstance(top, bool) or not isinstance(top, (int, np.integer)) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise QwenNPError(f"top_logprobs: must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top!r}")
    return int(top)


def token_logprobs(logits: np.ndarray, token: int, top: int, tokenizer: Tokenizer) -> Logprobs:
    """The log-probabilities at one position from its raw logits [V]: of `token`, and of the `top` most
    likely tokens."""
    logprobs = log_softmax(logits[None])[0]                                   # [V] float64
    best = np.argpartition(-logprobs, top - 1)[:top] if top else np.arange(0)   # the top largest, unordered
    best = best[np.lexsort((best, -logprobs[best]))]                          # most likely first; ties: lower id
    return Logprobs(_entry(logprobs, token, tokenizer), tuple(_entry(logprobs, int(i), tokenizer) for i in best))


def _entry(logprobs: np.ndarray, token: int, tokenizer: Tokenizer) -> TokenLogprob:
    return TokenLogprob(token, float(logprobs[token]), tokenizer.decode([token]), tokenizer.token_bytes(token))


class PromptLogprobs:
    """The log-probability of each token of `ids` given the tokens before it, with its `top` alternatives (the
    first token has none: nothing predicts it): how an evaluation harness scores a text (a completion's echo
    with logprobs). Computed SCORE_CHUNK positions per step(), through a KV cache of its own, so a server can
    run it between its generation steps (batching.Work); `entries` holds one Logprobs per token after the first.
    adapter: the LoRA adapter whose model scores them (None: the base), as a batch row of it generates."""

    def __init__(self, model: Qwen3Model, ids: list[int], top: int, tokenizer: Tokenizer,
                 adapter: Adapter | None = None) -> None:
        self.model, self.ids, self.top, self.tokenizer = model, ids, check_top_logprobs(top), tokenizer
        self.adapter = adapter
        self.cache = model.new_cache(len(ids))
        self.entries: list[Logprobs] = []

    def step(self) -> bool:
        """Score the next chunk of positions; whether every token is then scored."""
        start = self.cache.length
        chunk = self.ids[start:start + SCORE_CHUNK]
        logits = self.model.forward_batch([chunk], [self.cache], adapters=[self.adapter])   # [T, V]: t predicts t + 1
        for t, row in enumerate(logits[:len(self.ids) - 1 - start]):
            self.entries.append(token_logprobs(row, self.ids[start + t + 1], self.top, self.tokenizer))
        return len(self.entries) == len(self.ids) - 1
