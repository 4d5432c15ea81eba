"""Choosing the next token from logits: penalties, then the warpers, then one draw.

Each step is a small pure function on a logits vector [V] and follows transformers'
semantics (generation/logits_process.py), applied in transformers' order:

    repetition penalty -> presence and frequency penalties -> logit bias -> grammar mask
        -> temperature -> top-k -> top-p -> min-p -> draw

* repetition_penalty (HF RepetitionPenaltyLogitsProcessor): for every token already in the
  context, prompt included as HF does, a positive logit is divided by the penalty and a
  negative one multiplied by it. 1.0 disables it.
* presence_penalty (OpenAI / vLLM; transformers has none): subtract the penalty once from the
  logit of every token the model has *generated* so far. The prompt is not counted, as in vLLM,
  so a long prompt does not push the model away from the words it asks about. 0.0 disables it.
* frequency_penalty (OpenAI / vLLM): subtract the penalty times the number of times a token has been
  generated so far (prompt not counted). Together with presence this is OpenAI's definition,
  logit[j] -= count[j] * frequency + (count[j] > 0) * presence. 0.0 disables it.
* logit_bias (OpenAI): a number in [-100, 100] added to the logit of each listed token id, after the
  penalties; -100 in practice bans a token, +100 makes it near-certain.
* the grammar mask (constrained decoding, generation/constraints.py supplies it): every token the
  grammar forbids gets -inf. It comes after everything that changes values and before every filter,
  so top-k/top-p/min-p choose among allowed tokens only and can never keep only forbidden ones.
* temperature divides the logits; 0 means greedy: the argmax of the penalised logits (HF's
  do_sample=False, which still applies the repetition penalty). Warpers are skipped then.
* top-k keeps every token scoring at least the k-th highest logit (ties kept, as in HF); 0 disables.
* top-p keeps the smallest set of most likely tokens whose probability reaches p; 1.0 disables.
* min-p drops tokens whose probability is below min_p times the top token's; 0.0 disables.

Removed tokens get -inf, so a later softmax gives them exactly zero probability. Logits that the
penalties or the temperature push to +inf or NaN make no distribution: next_token raises then
(QwenNPError), rather than drawing from NaN probabilities an id that is not in the vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

from ..errors import QwenNPError

# The smallest temperature and repetition penalty accepted (besides temperature 0, greedy): dividing
# float32 logits by less overflows them to inf for ordinary settings (1e-300 even rounds to 0 in
# float32). vLLM clamps temperatures below 0.01 for the same reason; we refuse them instead.
MIN_DIVISOR = 0.01


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. Invalid values raise QwenNPError naming the field (its param)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # token id -> bias, held as sorted (id, bias) pairs so that the frozen dataclass stays hashable (a
    # dict given here is converted).
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        checks = [
            ("temperature", self.temperature, self.temperature == 0 or self.temperature >= MIN_DIVISOR,
             f"0 (greedy) or a number >= {MIN_DIVISOR} (Qwen3: 0.6, 0.7 without thinking)"),
            ("top_k", self.top_k, self.top_k >= 0, "an integer >= 0 (0 = off)"),
            ("top_p", self.top_p, 0 < self.top_p <= 1, "a number in (0, 1] (1 = off)"),
            ("min_p", self.min_p, 0 <= self.min_p <= 1, "a number in [0, 1] (0 = off)"),
            ("repetition_penalty", self.repetition_penalty, self.repetition_penalty >= MIN_DIVISOR,
             f"a number >= {MIN_DIVISOR} (1 = off)"),
            ("presence_penalty", self.presence_penalty, True, "a finite number (0 = off)"),
            ("frequency_penalty", self.frequency_penalty, True, "a finite number (0 = off)"),
        ]
        for name, value, ok, rule in checks:
            # `not ok` alone would let NaN through every comparison above; inf is no setting either.
            if not ok or not math.isfinite(value):
                raise QwenNPError(f"must be {rule}, got {value}", name)
        if self.seed is not None and self.seed < 0:
            raise QwenNPError(f"must be >= 0, got {self.seed}", "seed")
        object.__setattr__(self, "logit_bias", _checked_bias(self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _checked_bias(bias: Iterable[tuple[int, float]] | Mapping[int, float]) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs, each id an integer >= 0 and each bias in [-100, 100]."""
    pairs = bias.items() if isinstance(bias, Mapping) else bias
    checked = {}
    for token, value in pairs:
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or token < 0:
            raise QwenNPError(f"token ids must be integers >= 0, got {token!r}", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not -100 <= value <= 100:
            raise QwenNPError(f"the bias of token {token} must be a number in [-100, 100], got {value!r}", "logit_bias")
        checked[int(token)] = float(value)
    return tuple(sorted(checked.items()))


def apply_repetition_penalty(logits: np.ndarray, context_ids: Sequence[int], penalty: float) -> np.ndarray:
    """Penalise every token of the context once: positive logits / penalty, negative ones * penalty."""
    if penalty == 1.0 or len(context_ids) == 0:
        return logits
    ids = np.unique(np.asarray(context_ids, dtype=np.int64))
    out = logits.copy()
    seen = out[ids]
    out[ids] = np.where(seen < 0, seen * penalty, seen / penalty)
    return out


def apply_presence_penalty(logits: np.ndarray, generated_ids: Sequence[int], penalty: float) -> np.ndarray:
    """Subtract `penalty` once from every token present in the generated ids (however often it occurs)."""
    if penalty == 0.0 or len(generated_ids) == 0:
        return logits
    out = logits.copy()
    out[np.unique(np.asarray(generated_ids, dtype=np.int64))] -= penalty
    return out


def apply_frequency_penalty(logits: np.ndarray, generated_ids: Sequence[int], penalty: float) -> np.ndarray:
    """Subtract `penalty` from every token's logit once per time it occurs in the generated ids."""
    if penalty == 0.0 or len(generated_ids) == 0:
        return logits
    ids, counts = np.unique(np.asarray(generated_ids, dtype=np.int64), return_counts=True)
    out = logits.copy()
    out[ids] -= (counts * penalty).astype(out.dtype)
    return out


def apply_logit_bias(logits: np.ndarray, bias: Sequence[tuple[int, float]]) -> np.ndarray:
    """Add each (token id, bias) pair's bias to that token's logit."""
    if not bias:
        return logits
    ids = np.array([token for token, _ in bias], dtype=np.int64)
    if ids[-1] >= logits.size:                     # sorted: the largest id is the last
        raise QwenNPError(f"token id {int(ids[-1])} is outside the vocabulary [0, {logits.size})", "logit_bias")
    out = logits.copy()
    out[ids] += np.array([value for _, value in bias], dtype=out.dtype)
    return out


def apply_mask(logits: np.ndarray, allowed: np.ndarray | None) -> np.ndarray:
    """Constrained decoding's one step: every token not `allowed` (bool [V]; None: all are) gets -inf,
    so a draw gives it exactly zero probability and greedy never takes it."""
    if allowed is None:
        return logits
    return np.where(allowed, logits, np.float32(-np.inf)).astype(logits.dtype, copy=False)


def apply_temperature(logits: np.ndarray, temperature: float) -> np.ndarray:
    return logits if temperature == 1.0 else logits / np.float32(temperature)


def top_k_filter(logits: np.ndarray, k: int) -> np.ndarray:
    """Keep the tokens scoring at least the k-th highest logit (k = 0: keep all)."""
    if k == 0 or k >= logits.size:
        return logits
    kth = np.partition(logits, logits.size - k)[logits.size - k]
    return np.where(logits < kth, -np.inf, logits).astype(logits.dtype, copy=False)


def top_p_filter(logits: np.ndarray, p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose probabilities sum to at least p.

    As HF: sort ascending, drop tokens while the cumulative probability is <= 1 - p, keep the
    top token always. Only the tokens still alive are sorted (after top-k that is a handful).
    """
    if p >= 1.0:
        return logits
    alive = np.flatnonzero(np.isfinite(logits))
    ascending = alive[np.argsort(logits[alive], kind="stable")]
    cumulative = np.cumsum(softmax(logits[ascending]))
    drop = cumulative <= 1.0 - p
    drop[-1] = False
    out = logits.copy()
    out[ascending[drop]] = -np.inf
    return out


def min_p_filter(logits: np.ndarray, min_p: float) -> np.ndarray:
    """Drop tokens whose probability is below min_p x the most likely token's (the top token stays)."""
    if min_p == 0.0:
        return logits
    probs = softmax(logits)
    drop = probs < min_p * probs.max()
    drop[np.argmax(probs)] = False
    return np.where(drop, -np.inf, logits).astype(logits.dtype, copy=False)


def softmax(logits: np.ndarray) -> np.ndarray:
    """Probabilities in float64 (so cumulative sums over 150k tokens do not drift); -inf -> 0."""
    shifted = logits.astype(np.float64) - np.max(logits)
    weights = np.exp(shifted)
    return weights / weights.sum()


def draw(logits: np.ndarray, rng: np.random.Generator) -> int:
    """One token id drawn from softmax(logits) by inverse CDF with a single uniform from `rng`."""
    cumulative = np.cumsum(softmax(logits))
    # Kept strictly below the total so rounding can never land past the last token with mass.
    u = min(rng.random() * cumulative[-1], np.nextafter(cumulative[-1], 0.0))
    return int(np.searchsorted(cumulative, u, side="right"))


def require_distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """`logits` as they are, if softmax makes a distribution of them: a finite maximum (NaN and +inf
    propagate to the maximum, and so does a vector with every token removed). Raises QwenNPError."""
    if not np.isfinite(np.max(logits)):
        raise QwenNPError(f"sampling: the next token's logits are not finite after the penalties and temperature "
                          f"(temperature {params.temperature}, repetition penalty {params.repetition_penalty}, "
                          f"presence penalty {params.presence_penalty}, frequency penalty {params.frequency_penalty}): "
                          "choose settings nearer 1, 1, 0 and 0, or check the model's weights")
    return logits


def warp_stages(logits: np.ndarray, params: SamplingParams) -> list[tuple[str, np.ndarray]]:
    """The logits after each warper in transformers' order, named: temperature, top-k, top-p, min-p (the
    last is what a draw samples from; the explorer shows them all). Raises QwenNPError when the tempered
    logits make no distribution (require_distribution)."""
    tempered = require_distribution(apply_temperature(logits, params.temperature), params)
    top_k = top_k_filter(tempered, params.top_k)
    top_p = top_p_filter(top_k, params.top_p)
    return [("temperature", tempered), ("top-k", top_k), ("top-p", top_p), ("min-p", min_p_filter(top_p, params.min_p))]


def warp(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Temperature, top-k, top-p, min-p in transformers' order: the distribution a draw samples from.
    Raises QwenNPError when the tempered logits make no distribution (require_distribution)."""
    return warp_stages(logits, params)[-1][1]


def processed_logits(logits: np.ndarray, params: SamplingParams, context_ids: Sequence[int],
                     generated_ids: Sequence[int], allowed: np.ndarray | None = None) -> np.ndarray:
    """One position's logits [V] as the sampler sees them: penalised, biased, masked, then (unless greedy)
    warped; a draw samples from their softmax, greedy takes their argmax. Raises QwenNPError when they
    make no distribution.

    context_ids: every token of the sequence so far (prompt + generated), for the repetition penalty;
    generated_ids: only the generated ones, for the presence and frequency penalties; allowed: the
    tokens a grammar allows next (bool [V]), None when unconstrained.
    """
    # Overflow to inf is caught as an error (require_distribution), so NumPy's warnings about it would
    # only repeat it, less clearly.
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        logits = apply_repetition_penalty(logits, context_ids, params.repetition_penalty)
        logits = apply_presence_penalty(logits, generated_ids, params.presence_penalty)
        logits = apply_frequency_penalty(logits, generated_ids, params.frequency_penalty)
        logits = apply_mask(apply_logit_bias(logits, params.logit_bias), allowed)
        return require_distribution(logits, params) if params.greedy else warp(logits, params)


def pick(processed: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """The token chosen from processed_logits: their argmax when greedy (no random number used), else one draw."""
    return int(np.argmax(processed)) if params.greedy else draw(processed, rng)


def next_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator,
               context_ids: Sequence[int], generated_ids: Sequence[int]) -> int:
    """The next token id from one position's logits [V] (context_ids, generated_ids: as processed_logits)."""
    return pick(processed_logits(logits, params, context_ids, generated_ids), params, rng)
