"""DPO's and GRPO's steps through the network (step.dpo_loss_and_gradients, step.grpo_loss_and_gradients): every
gradient by float64 central differences on a micro model, GRPO with one completion a group and no KL as the
policy-gradient step it reduces to, and a LoRA model's reference as its base's."""

from __future__ import annotations

from typing import Callable

import numpy as np
import pytest

from qwen_np.core.config import Qwen3Config
from qwen_np.core.model import Qwen3Model
from qwen_np.training import gradients, lora, objectives
from qwen_np.training.parameters import init_parameters, model_from_parameters
from qwen_np.training.step import (completion_log_probs, dpo_loss_and_gradients, grpo_loss_and_gradients,
                                   loss_and_gradients)
from tests.reference.finite_differences import central_difference
from tests.training.test_gradients import MICRO

CONFIG = Qwen3Config(**MICRO, tie_word_embeddings=False, rope_theta=100.0)


def micro_model(seed: int = 3) -> tuple[dict[str, np.ndarray], Qwen3Model]:
    rng = np.random.default_rng(seed)
    params = {n: p.astype(np.float64) + (0.3 if p.ndim == 1 else 0.25) * rng.standard_normal(p.shape)
              for n, p in init_parameters(CONFIG, seed=seed).items()}
    return params, model_from_parameters(CONFIG, params)


def rows(seed: int, count: int, width: int = 7) -> tuple[np.ndarray, np.ndarray]:
    """ids [count, width] and a completion mask: a prompt of 2-3 tokens, then a reply of ragged length."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, CONFIG.vocab_size, size=(count, width))
    completion = np.zeros((count, width), dtype=bool)
    for row in range(count):
        start = int(rng.integers(2, 4))
        completion[row, start:int(rng.integers(start + 1, width + 1))] = True
    return ids, completion


def assert_gradients_are_central_differences(params: dict[str, np.ndarray], grads: dict[str, np.ndarray],
                                             loss: Callable[[], float]) -> None:
    assert sorted(grads) == sorted(params)
    for name, p in params.items():
        numeric = central_difference(loss, p)
        assert np.abs(grads[name] - numeric).max() <= 1e-7 * max(1.0, np.abs(numeric).max()), name


@pytest.mark.slow
def test_every_dpo_gradient_matches_float64_central_differences() -> None:
    params, model = micro_model()
    ids, completion = rows(seed=1, count=4)                                           # 2 pairs
    reference = np.random.default_rng(2).normal(-8.0, 1.0, size=4)
    result, grads = dpo_loss_and_gradients(model, ids, completion, reference, beta=0.7)

    def loss() -> float:
        sums = completion_log_probs(model, ids, completion).sum(axis=1)
        return objectives.dpo_loss(sums[:2], sums[2:], reference[:2], reference[2:], 0.7).loss

    assert result.loss == pytest.approx(loss(), rel=1e-12)
    assert_gradients_are_central_differences(params, grads, loss)


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", objectives.LOSS_TYPES)
def test_every_grpo_gradient_matches_float64_central_differences_with_kl_and_clipping(loss_type: str) -> None:
    params, model = micro_model()
    ids, completion = rows(seed=4, count=4)
    rng = np.random.default_rng(5)
    policy = completion_log_probs(model, ids, completion)
    old, reference = policy + 0.4 * rng.standard_normal(policy.shape), policy + 0.3 * rng.standard_normal(policy.shape)
    advantages = objectives.group_advantages(rng.normal(size=(2, 2))).reshape(-1)
    result, grads = grpo_loss_and_gradients(model, ids, completion, advantages, loss_type, 0.05,
                                            reference, old, max_completion_length=8)
    assert 0 < result.clipped < 1 and result.kl > 0

    def loss() -> float:
        log_probs = completion_log_probs(model, ids, completion)
        return objectives.grpo_loss(log_probs, old, advantages, completion[:, 1:], loss_type, 0.05, reference,
                                    max_completion_length=8).loss

    assert_gradients_are_central_differences(params, grads, loss)


def test_grpo_with_one_completion_a_group_and_no_kl_is_the_policy_gradient_step() -> None:
    """On-policy (the ratio 1), beta 0: the grpo loss's gradient is REINFORCE's, -mean over completions of
    A_i times the gradient of the completion's mean token log-prob: SFT's weighted cross-entropy step with
    each completion token weighted A_i / (n_i N). A group of one has advantage 0 (its reward less its own mean),
    so with TRL's advantages such a step moves nothing; the reduction is shown with advantages given."""
    _, model = micro_model()
    ids, completion = rows(seed=6, count=3)
    advantages = np.array([1.5, -0.5, 0.8])
    result, grads = grpo_loss_and_gradients(model, ids, completion, advantages, "grpo")
    learned = completion[:, 1:]
    weights = learned * (advantages / learned.sum(axis=1) / len(ids))[:, None]       # [N, T]
    _, expected = loss_and_gradients(model, ids, weights=weights)
    for name, g in expected.items():
        assert np.abs(grads[name] - g).max() <= 1e-12 * max(1.0, np.abs(g).max()), name
    assert result.loss == pytest.approx(-np.sum(advantages) / 3)      # the ratio's value 1 times -A, averaged
    assert not np.any(objectives.group_advantages(np.array([[0.3], [2.0]])))
    assert not np.any(objectives.group_advantages(np.array([[0.3], [2.0]]), scale=False))


def test_a_lora_models_reference_is_its_base_with_the_adapters_off() -> None:
    """lora.without_adapters: the base's log-probs even once the adapters have moved, on the same arrays."""
    _, model = micro_model()
    ids, completion = rows(seed=7, count=2)
    base = completion_log_probs(model, ids, completion)
    lora.add_adapters(model, rank=2, seed=1)
    for array in lora.adapter_parameters(model).values():
        array += 0.3
    adapted = completion_log_probs(model, ids, completion)
    reference = lora.without_adapters(model)
    assert np.abs(adapted - base).max() > 1e-3
    np.testing.assert_array_equal(completion_log_probs(reference, ids, completion), base)
    assert reference.layers[0].q_proj is model.layers[0].q_proj.base


def test_token_log_probs_backward_is_the_derivative_of_log_softmax() -> None:
    rng = np.random.default_rng(8)
    logits, targets = rng.standard_normal((2, 3, 5)), rng.integers(0, 5, size=(2, 3))
    d_log_probs = rng.standard_normal((2, 3))
    _, probs = gradients.token_log_probs(logits, targets)
    analytic = gradients.token_log_probs_backward(d_log_probs, probs, targets)
    numeric = central_difference(lambda: float((gradients.token_log_probs(logits, targets)[0] * d_log_probs).sum()),
                                 logits)
    assert np.abs(analytic - numeric).max() <= 1e-8
