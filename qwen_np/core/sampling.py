"""Choosing the next token from logits: penalties, then the warpers, then one draw.

Each step is a small pure function on a logits vector [V] and follows transformers'
semantics (generation/logits_process.py), applied in transformers' order:

    repetition penalty -> presence penalty -> temperature -> top-k -> top-p -> min-p -> draw

* repetition_penalty (HF RepetitionPenaltyLogitsProcessor): for every token already in the
  context, prompt included as HF does, a positive logit is divided by the penalty and a
  negative one multiplied by it. 1.0 disables it.
* presence_penalty (OpenAI / vLLM; transformers has none): subtract the penalty once from the
  logit of every token the model has *generated* so far. The prompt is not counted, as in vLLM,
  so a long prompt does not push the model away from the words it asks about. 0.0 disables it.
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
from typing import Sequence

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
        ]
        for name, value, ok, rule in checks:
            # `not ok` alone would let NaN through every comparison above; inf is no setting either.
            if not ok or not math.isfinite(value):
                raise QwenNPError(f"must be {rule}, got {value}", name)
        if self.seed is not None and self.seed < 0:
            raise QwenNPError(f"must be >= 0, got {self.seed}", "seed")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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
                          f"presence penalty {params.presence_penalty}): choose settings nearer 1, 1 and 0, or check "
                          "the model's weights")
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
                     generated_ids: Sequence[int]) -> np.ndarray:
    """One position's logits [V] as the sampler sees them: penalised, then (unless greedy) warped; a draw
    samples from their softmax, greedy takes their argmax. Raises QwenNPError when they make no distribution.

    context_ids: every token of the sequence so far (prompt + generated), for the repetition penalty;
    generated_ids: only the generated ones, for the presence penalty.
    """
    # Overflow to inf is caught as an error (require_distribution), so NumPy's warnings about it would
    # only repeat it, less clearly.
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        logits = apply_repetition_penalty(logits, context_ids, params.repetition_penalty)
        logits = apply_presence_penalty(logits, generated_ids, params.presence_penalty)
        return require_distribution(logits, params) if params.greedy else warp(logits, params)


def pick(processed: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """The token chosen from processed_logits: their argmax when greedy (no random number used), else one draw."""
    return int(np.argmax(processed)) if params.greedy else draw(processed, rng)


def next_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator,
               context_ids: Sequence[int], generated_ids: Sequence[int]) -> int:
    """The next token id from one position's logits [V] (context_ids, generated_ids: as processed_logits)."""
    return pick(processed_logits(logits, params, context_ids, generated_ids), params, rng)
