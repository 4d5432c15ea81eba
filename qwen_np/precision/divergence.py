"""How far a number format moves the model's predictions: the statistics `llama-perplexity --kl-divergence` reports.

Both models read the same text. At every scored position we have the FP32 ("base") logits, the
format's ("other") logits and the true next token. Per position:

    nll        -log p(target)                        for both, so perplexity = exp(mean nll)
    KL         sum_v p_base(v) (log p_base(v) - log p_other(v))       KL(base || other), nats
    same top   argmax p_base == argmax p_other
    delta p    p_other(t) - p_base(t), t = argmax p_base              how much the favourite moved

The logits of a whole text ([tokens, V] FP32 is 2.5 GB for 4k tokens of Qwen3) never exist at once:
`Comparison.add` takes a chunk of positions and keeps only the per-position numbers above.

A position whose `other` logits hold NaN or inf (an FP16 run that overflowed) is counted in
`nonfinite_positions`; its NLL, KL and delta p are NaN and carry into the means and percentiles, so
a broken format cannot report a good score, and it never counts as "same top".
"""

from __future__ import annotations

import numpy as np

from ..errors import QwenNPError
from ..core.layers import log_softmax

PERCENTILES = {"p1": 1, "p5": 5, "p10": 10, "median": 50, "p90": 90, "p95": 95, "p99": 99}




def _check(base_logits: np.ndarray, other_logits: np.ndarray, targets: np.ndarray) -> None:
    """A QwenNPError naming the mismatch if the chunk's shapes or targets do not fit together."""
    if base_logits.ndim != 2 or base_logits.shape != other_logits.shape:
        raise QwenNPError(f"compare: base and other logits must both be [N, V]; got {base_logits.shape} "
                          f"and {other_logits.shape}")
    if targets.shape != base_logits.shape[:1]:
        raise QwenNPError(f"compare: expected {base_logits.shape[0]} targets for logits of shape "
                          f"{base_logits.shape}, got shape {targets.shape}")
    if targets.size and (targets.min() < 0 or targets.max() >= base_logits.shape[1]):
        raise QwenNPError(f"compare: targets must be token ids in 0..{base_logits.shape[1] - 1}")


# How far below zero a KL divergence of equal distributions can round (float64 sums over up to ~152k terms).
KLD_ROUNDING = 1e-12


def compare_positions(base_logits: np.ndarray, other_logits: np.ndarray,
                      targets: np.ndarray) -> dict[str, np.ndarray]:
    """Per-position statistics of one chunk: [N, V], [N, V], [N] -> dict of [N] arrays.

    Keys: nll_base, nll_other, kld, same_top (bool), delta_p, nonfinite (bool). Float64 throughout.
    Peak memory is about four float64 [N, V] arrays: choose N accordingly.
    """
    targets = np.asarray(targets)
    _check(base_logits, other_logits, targets)
    rows = np.arange(len(targets))                                      # [N]
    base = log_softmax(base_logits)                                      # [N, V]
    other = log_softmax(other_logits)                                    # [N, V]
    nonfinite = ~np.isfinite(other).all(axis=-1)                         # [N]
    top = np.argmax(base, axis=-1)                                       # [N] base's favourite
    p_base = np.exp(base)                                                # [N, V]
    # KL >= 0 in exact arithmetic; summed in float64 over V terms it can land a few ulps below zero when the
    # two distributions are equal (|error| ~ V * 1e-16 nats, KLD_ROUNDING): callers compare with that slack.
    kld = np.sum(p_base * (base - other), axis=-1)                       # [N] nats
    return {
        "nll_base": -base[rows, targets],
        "nll_other": -other[rows, targets],
        "kld": kld,
        "same_top": (top == np.argmax(other, axis=-1)) & ~nonfinite,
        "delta_p": np.exp(other[rows, top]) - p_base[rows, top],
        "nonfinite": nonfinite,
    }


class Comparison:
    """Accumulates compare_positions over chunks; summary() gives the llama-perplexity figures.

    Chunks are independent, so the summary of a text is the same however it was cut into chunks.
    """

    def __init__(self) -> None:
        self._chunks: list[dict[str, np.ndarray]] = []

    def add(self, base_logits: np.ndarray, other_logits: np.ndarray, targets: np.ndarray) -> None:
        """Score one chunk of positions: base and other logits [N, V], the true next tokens [N]."""
        self._chunks.append(compare_positions(base_logits, other_logits, targets))

    def positions(self) -> dict[str, np.ndarray]:
        """Every position's statistics so far, chunks concatenated: dict of [positions] arrays."""
        if not self._chunks:
            raise QwenNPError("compare: no positions were scored (the text is shorter than two tokens?)")
        return {key: np.concatenate([chunk[key] for chunk in self._chunks]) for key in self._chunks[0]}

    def summary(self) -> dict[str, float]:
        """Perplexities and their ratio, KL divergence, same-top share and delta p (in %, as llama.cpp prints)."""
        per = self.positions()
        n = len(per["kld"])
        ln_ratio = per["nll_other"] - per["nll_base"]                    # [n] log of the per-token ratio
        same = per["same_top"].mean()
        delta_p = 100 * per["delta_p"]                                   # percentage points
        stats = {
            "positions": float(n),
            "nonfinite_positions": float(per["nonfinite"].sum()),
            "ppl_base": float(np.exp(per["nll_base"].mean())),
            "ppl_other": float(np.exp(per["nll_other"].mean())),
            "ppl_ratio": float(np.exp(ln_ratio.mean())),
            "ln_ppl_ratio": float(ln_ratio.mean()),
            "ln_ppl_ratio_stderr": _stderr(ln_ratio),
            "kld_mean": float(per["kld"].mean()),
            "kld_mean_stderr": _stderr(per["kld"]),
            "kld_max": float(per["kld"].max()),
            "same_top_percent": float(100 * same),
            "same_top_percent_stderr": float(100 * np.sqrt(same * (1 - same) / max(n - 1, 1))),
            "delta_p_rms_percent": float(np.sqrt(np.mean(delta_p ** 2))),
            "delta_p_mean_percent": float(delta_p.mean()),
            "delta_p_min_percent": float(delta_p.min()),
            "delta_p_max_percent": float(delta_p.max()),
        }
        for name, q in PERCENTILES.items():
            stats[f"delta_p_{name}_percent"] = float(np.percentile(delta_p, q))
        for name in ("median", "p90", "p99"):
            stats[f"kld_{name}"] = float(np.percentile(per["kld"], PERCENTILES[name]))
        return stats


def _stderr(values: np.ndarray) -> float:
    """Standard error of the mean (0 for a single value)."""
    return float(np.std(values, ddof=1) / np.sqrt(len(values))) if len(values) > 1 else 0.0
