"""What "the same logits" means: the one criterion of every test that compares two computations of logits
(qwen_np with transformers, the fast path with the readable one, a cache with a full pass, a format's
blocks with its rounded FP32 model, ...).

Two computations match when no logit differs by more than RELATIVE_TOLERANCE x max(1, max|reference|)
and both pick the same token (the argmax) at every position.

Only NumPy is needed here, so the stored-fixture tests can use it without torch.
"""

import numpy as np

# FP32 vs FP32 with identical weights: the only differences are summation order, exp and
# cos/sin ulps (spec §1.10), which stay far below this relative bound.
RELATIVE_TOLERANCE = 1e-5


def allowed_error(reference: np.ndarray, tolerance: float = RELATIVE_TOLERANCE) -> float:
    """The largest |actual - reference| that still matches: tolerance x max(1, max|reference|).

    The floor of 1 keeps the bound absolute for logits of order one or smaller.
    """
    return tolerance * max(1.0, float(np.max(np.abs(reference))))


def max_relative_error(actual: np.ndarray, reference: np.ndarray) -> float:
    """Return max|actual - reference| scaled by max(1, max|reference|): the measure the tolerance bounds."""
    scale = max(1.0, float(np.max(np.abs(reference))))
    return float(np.max(np.abs(actual.astype(np.float64) - reference))) / scale


def assert_logits_match(actual: np.ndarray, reference: np.ndarray, what: str,
                        tolerance: float = RELATIVE_TOLERANCE) -> float:
    """Assert `actual` logits match `reference` at every position; return the error.

    Logits are [V] or [..., V] (the vocabulary last). Checks shape, dtype, the relative error bound
    and that the argmax (the greedy token) agrees at every position.
    """
    assert actual.shape == reference.shape, f"{what}: shape {actual.shape} != {reference.shape}"
    assert actual.dtype == np.float32, f"{what}: dtype {actual.dtype} is not float32"
    error = max_relative_error(actual, reference)
    worst = np.unravel_index(np.argmax(np.abs(actual.astype(np.float64) - reference)), actual.shape)
    assert error <= tolerance, (
        f"{what}: max relative error {error:.3e} > {tolerance:.0e} "
        f"(worst at position {tuple(int(i) for i in worst[:-1])}, token {int(worst[-1])})"
    )
    mismatched = np.argwhere(np.atleast_1d(actual.argmax(-1) != reference.argmax(-1)))
    assert mismatched.size == 0, f"{what}: argmax differs at positions {mismatched.tolist()}"
    return error
