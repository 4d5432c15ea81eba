"""The logit-parity criterion shared by every test that compares qwen_np with transformers.

Only NumPy is needed here, so the stored-fixture tests can use it without torch.
"""

import numpy as np

# FP32 vs FP32 with identical weights: the only differences are summation order, exp and
# cos/sin ulps (spec §1.10), which stay far below this relative bound.
RELATIVE_TOLERANCE = 1e-5


def max_relative_error(actual: np.ndarray, reference: np.ndarray) -> float:
    """Return max|actual - reference| scaled by max(1, max|reference|).

    The floor of 1 keeps the measure absolute for logits of order one or smaller.
    """
    scale = max(1.0, float(np.max(np.abs(reference))))
    return float(np.max(np.abs(actual.astype(np.float64) - reference))) / scale


def assert_logits_match(actual: np.ndarray, reference: np.ndarray, what: str) -> float:
    """Assert qwen_np logits match the reference at every position; return the error.

    Checks shape, dtype, the relative error bound and that the argmax (the greedy token)
    agrees at every position.
    """
    assert actual.shape == reference.shape, f"{what}: shape {actual.shape} != {reference.shape}"
    assert actual.dtype == np.float32, f"{what}: dtype {actual.dtype} is not float32"
    error = max_relative_error(actual, reference)
    worst = np.unravel_index(np.argmax(np.abs(actual - reference)), actual.shape)
    assert error <= RELATIVE_TOLERANCE, (
        f"{what}: max relative error {error:.3e} > {RELATIVE_TOLERANCE:.0e} "
        f"(worst at position {worst[0]}, token {worst[1]})"
    )
    mismatched = np.flatnonzero(actual.argmax(-1) != reference.argmax(-1))
    assert mismatched.size == 0, f"{what}: argmax differs at positions {mismatched.tolist()}"
    return error
