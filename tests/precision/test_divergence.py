"""Format-vs-FP32 statistics: KL, perplexity, same top and delta p, against direct float64 formulas."""

from __future__ import annotations

import numpy as np
import pytest

from qwen_np import QwenNPError
from qwen_np.precision.divergence import Comparison, compare_positions, log_softmax


def chunk(n: int = 24, vocab: int = 500, noise: float = 0.3, seed: int = 0):
    """FP32 base logits, logits perturbed as a quantized model's would be, and next-token targets."""
    rng = np.random.default_rng(seed)
    base = (3 * rng.standard_normal((n, vocab))).astype(np.float32)
    other = (base + noise * rng.standard_normal((n, vocab))).astype(np.float32)
    return base, other, rng.integers(0, vocab, size=n)


def direct_probabilities(logits: np.ndarray) -> np.ndarray:
    """softmax without any shift, in float64: fine for the small logits these tests use."""
    e = np.exp(logits.astype(np.float64))
    return e / e.sum(axis=-1, keepdims=True)


def test_identical_logits_have_zero_divergence_and_ratio_one():
    base, _, targets = chunk()
    comparison = Comparison()
    comparison.add(base, base.copy(), targets)
    s = comparison.summary()
    assert s["kld_mean"] == 0 and s["kld_max"] == 0 and s["delta_p_rms_percent"] == 0
    assert s["ppl_ratio"] == 1 and s["ln_ppl_ratio"] == 0 and s["same_top_percent"] == 100


def test_kl_matches_a_direct_float64_computation():
    base, other, targets = chunk()
    p, q = direct_probabilities(base), direct_probabilities(other)
    expected = np.sum(p * np.log(p / q), axis=-1)
    got = compare_positions(base, other, targets)["kld"]
    assert np.allclose(got, expected, rtol=1e-10, atol=1e-15) and np.all(expected > 1e-3)


def test_perplexity_is_exp_of_mean_nll_and_delta_p_is_the_base_favourites_move():
    base, other, targets = chunk(seed=1)
    p, q = direct_probabilities(base), direct_probabilities(other)
    rows, top = np.arange(len(targets)), p.argmax(axis=-1)
    comparison = Comparison()
    comparison.add(base, other, targets)
    s = comparison.summary()
    assert s["ppl_base"] == pytest.approx(np.exp(-np.mean(np.log(p[rows, targets]))), rel=1e-12)
    assert s["ppl_other"] == pytest.approx(np.exp(-np.mean(np.log(q[rows, targets]))), rel=1e-12)
    assert s["ppl_ratio"] == pytest.approx(s["ppl_other"] / s["ppl_base"], rel=1e-12)
    delta = 100 * (q[rows, top] - p[rows, top])
    assert s["delta_p_rms_percent"] == pytest.approx(np.sqrt(np.mean(delta ** 2)), rel=1e-10)
    assert s["same_top_percent"] == pytest.approx(100 * np.mean(top == q.argmax(axis=-1)))


def test_hand_computed_three_token_case():
    base = np.log(np.array([[0.5, 0.3, 0.2]], dtype=np.float32))
    other = np.log(np.array([[0.2, 0.5, 0.3]], dtype=np.float32))
    per = compare_positions(base, other, np.array([1]))
    kld = 0.5 * np.log(0.5 / 0.2) + 0.3 * np.log(0.3 / 0.5) + 0.2 * np.log(0.2 / 0.3)
    assert per["kld"][0] == pytest.approx(kld, rel=1e-6)
    assert per["delta_p"][0] == pytest.approx(-0.3, rel=1e-6) and not per["same_top"][0]
    assert per["nll_base"][0] == pytest.approx(-np.log(0.3), rel=1e-6)
    assert per["nll_other"][0] == pytest.approx(-np.log(0.5), rel=1e-6)


def test_large_logits_do_not_overflow():
    base, other, targets = chunk(seed=2)
    base, other = np.round(base * 64) / 64, np.round(other * 64) / 64    # on a grid: + 1000 stays exact in FP32
    small = compare_positions(base, other, targets)
    large = compare_positions(base + np.float32(1000), other + np.float32(1000), targets)
    for key in ("kld", "nll_base", "nll_other", "delta_p"):
        assert np.allclose(small[key], large[key], rtol=1e-9, atol=1e-13)
    assert np.allclose(np.exp(log_softmax(base + np.float32(1000))).sum(axis=-1), 1, rtol=1e-14)


def test_chunked_equals_unchunked():
    base, other, targets = chunk(n=50, seed=3)
    whole, parts = Comparison(), Comparison()
    whole.add(base, other, targets)
    for start in (0, 7, 30):
        stop = {0: 7, 7: 30, 30: 50}[start]
        parts.add(base[start:stop], other[start:stop], targets[start:stop])
    assert parts.summary() == whole.summary()


def test_nonfinite_logits_are_counted_and_poison_the_scores():
    base, other, targets = chunk(seed=4)
    other[3, 7] = np.inf
    other[5, 0] = np.nan
    comparison = Comparison()
    comparison.add(base, other, targets)
    s = comparison.summary()
    assert s["nonfinite_positions"] == 2
    assert np.isnan(s["kld_mean"]) and np.isnan(s["ppl_other"]) and np.isnan(s["kld_p99"])
    assert not comparison.positions()["same_top"][[3, 5]].any()


@pytest.mark.parametrize("shapes, message", [
    (((4, 10), (4, 11), (4,)), r"base and other logits must both be \[N, V\]; got \(4, 10\) and \(4, 11\)"),
    (((4, 10), (4, 10), (3,)), r"expected 4 targets for logits of shape \(4, 10\), got shape \(3,\)"),
])
def test_mismatched_chunks_are_refused(shapes, message):
    base, other, targets = (np.zeros(shape, dtype=np.float32) for shape in shapes)
    with pytest.raises(QwenNPError, match=message):
        Comparison().add(base, other, targets.astype(np.int64))


def test_out_of_range_target_is_refused():
    with pytest.raises(QwenNPError, match=r"targets must be token ids in 0..9"):
        compare_positions(np.zeros((2, 10)), np.zeros((2, 10)), np.array([3, 10]))


def test_summary_of_nothing_is_an_error():
    with pytest.raises(QwenNPError, match="no positions were scored"):
        Comparison().summary()
