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

from ..core.layers import log_softmax
from ..errors import QwenNPError
from ..files.tokenizer import Tokenizer

MAX_TOP_LOGPROBS = 20       # OpenAI's limit for top_logprobs


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
