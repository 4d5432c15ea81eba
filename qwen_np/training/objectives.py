"""Preference tuning (DPO) and reinforcement learning from rewards (GRPO): their losses over log-probabilities
and the gradients of those losses by hand, as TRL 1.16 defines them (DPOTrainer._compute_loss,
GRPOTrainer._compute_loss; tests/training/test_objectives.py runs TRL's own code on the same numbers).

Both losses read the policy's log-probability of each completion token (gradients.token_log_probs, whose
backward carries d loss / d log p to the logits; gradients.backward carries it on through the network):

    DPO   per pair, sequence log-probs summed over the completion's tokens, policy pi and reference ref:
          z = beta * ((pi_c - ref_c) - (pi_r - ref_r)),  loss = mean over pairs of -log sigmoid(z)
    GRPO  per token, ratio r = exp(log p - log p_old) (p_old: the policy that sampled; one update per batch
          makes r = 1 with its gradient), advantage A of the token's completion:
          loss_t = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) + beta * KL_t,
          KL_t = exp(ref - log p) - (ref - log p) - 1 (the k3 estimator), times r (TRL's default
          use_bias_correction_kl); averaged as the loss type says (grpo_loss).

Why by hand: the network's backward is already by hand (gradients.py); these are a few lines of
elementwise arithmetic on [B, T] arrays, where a library would mean torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import QwenNPError

# GRPO's loss types (TRL's names) and how each averages the per-token losses.
LOSS_TYPES = ("grpo", "dr_grpo", "dapo")
EPSILON = 0.2                   # GRPOConfig.epsilon: the clip range's half-width (epsilon_high defaults to it)
ADVANTAGE_EPS = 1e-4            # added to the group's std before dividing (TRL's constant)
DPO_BETA = 0.1                  # DPOConfig.beta


def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + e^x), finite for any x (-log sigmoid(z) = softplus(-z))."""
    return np.logaddexp(0.0, x)


def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + e^-x) without overflow for x << 0 (e^-x = inf there)."""
    return np.exp(-np.logaddexp(0.0, -x))


@dataclass
class DpoLoss:
    """DPO on a batch of P pairs: the loss, its gradient w.r.t. each sequence log-prob, TRL's logged figures."""

    loss: float
    d_chosen: np.ndarray            # d loss / d pi_c  [P]
    d_rejected: np.ndarray          # d loss / d pi_r  [P]
    chosen_rewards: np.ndarray      # beta (pi_c - ref_c)  [P]
    rejected_rewards: np.ndarray    # beta (pi_r - ref_r)  [P]

    @property
    def accuracy(self) -> float:
        """TRL's rewards/accuracies: the share of pairs whose chosen reward beats the rejected one."""
        return ranked(self.chosen_rewards, self.rejected_rewards)[0]

    @property
    def margin(self) -> float:
        """TRL's rewards/margins: the mean of chosen reward less rejected."""
        return ranked(self.chosen_rewards, self.rejected_rewards)[1]


def ranked(chosen: np.ndarray, rejected: np.ndarray) -> tuple[float, float]:
    """(the share of pairs whose chosen score beats the rejected one, the mean of chosen less rejected)."""
    return float(np.mean(chosen > rejected)), float(np.mean(chosen - rejected))


def dpo_loss(chosen: np.ndarray, rejected: np.ndarray, ref_chosen: np.ndarray, ref_rejected: np.ndarray,
             beta: float = DPO_BETA) -> DpoLoss:
    """TRL's sigmoid DPO loss (its default loss_type, f_divergence_type reverse_kl) over sequence log-probs [P].

    d/dz -log sigmoid(z) = -sigmoid(-z); z moves by beta with pi_c and by -beta with pi_r, and the mean over
    the P pairs divides each by P."""
    chosen_rewards = beta * (chosen.astype(np.float64) - ref_chosen)                 # [P]
    rejected_rewards = beta * (rejected.astype(np.float64) - ref_rejected)           # [P]
    z = chosen_rewards - rejected_rewards                                            # [P]
    d_z = -sigmoid(-z) / len(z)                                                      # [P]
    return DpoLoss(float(np.mean(softplus(-z))), beta * d_z, -beta * d_z, chosen_rewards, rejected_rewards)


def group_advantages(rewards: np.ndarray, scale: bool = True) -> np.ndarray:
    """Each completion's advantage: its reward less its group's mean, divided by the group's std + 1e-4
    (scale_rewards="group"; the std unbiased, as TRL's nanstd) or not (scale=False: Dr. GRPO's "none").
    rewards [P, G] (G completions of each of P prompts) -> [P, G]. A group of one (G = 1) has advantage 0
    either way, as in TRL (which takes its std as 0): a reward alone says nothing against its own mean."""
    centred = rewards - rewards.mean(axis=1, keepdims=True)                          # [P, G]
    if not scale:
        return centred
    G = rewards.shape[1]
    std = np.sqrt((centred ** 2).sum(axis=1, keepdims=True) / (G - 1)) if G > 1 else np.zeros_like(centred)
    return centred / (std + ADVANTAGE_EPS)


@dataclass
class GrpoLoss:
    """GRPO's loss on a batch of N completions, its gradient w.r.t. each token's log-prob, and what TRL logs."""

    loss: float
    d_log_probs: np.ndarray         # [N, T], zero off the completion mask
    kl: float                       # mean KL (the per-token term, bias-corrected) over the completion tokens; 0 without beta
    clipped: float                  # share of completion tokens whose ratio the clip holds (TRL's clip_ratio/region_mean)


def grpo_loss(log_probs: np.ndarray, old_log_probs: np.ndarray, advantages: np.ndarray, mask: np.ndarray,
              loss_type: str = "dapo", beta: float = 0.0, ref_log_probs: np.ndarray | None = None,
              epsilon_low: float = EPSILON, epsilon_high: float = EPSILON, max_completion_length: int | None = None,
              tokens: int | None = None) -> GrpoLoss:
    """GRPOTrainer._compute_loss (token-level importance sampling, no delta, use_bias_correction_kl) by hand.

    log_probs, old_log_probs, ref_log_probs [N, T]: each completion token's log-prob under the policy, the
    policy that sampled it, and the reference; advantages [N]; mask [N, T] (1 on completion tokens).
    The averages: grpo, each completion's mean over its tokens, then the mean over completions; dr_grpo, the
    sum over every token / (N x max_completion_length: the length sampling allowed, default T); dapo, the
    sum / the completion tokens of the whole generation batch (`tokens`, default this batch's).

    The gradient of -min(r A, clip(r) A) is -A r where the unclipped term is the smaller (the clip's bound
    passes none: torch's clamp and min do the same), and the k3 KL times r: d/dlogp [k r] = (1 - e^(ref - logp)) r + k r.
    """
    if loss_type not in LOSS_TYPES:
        raise QwenNPError(f"loss_type: expected one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
    if beta and ref_log_probs is None:
        raise QwenNPError("a KL term (beta > 0) needs the reference's log-probs (ref_log_probs)", "beta")
    mask = mask.astype(log_probs.dtype)                                              # [N, T]
    A = advantages.astype(log_probs.dtype)[:, None]                                  # [N, 1]
    ratio = np.exp(log_probs - old_log_probs)                                        # [N, T]
    clipped_ratio = np.clip(ratio, 1 - epsilon_low, 1 + epsilon_high)
    unclipped = ratio * A <= clipped_ratio * A                                       # the min's pick
    per_token = -np.minimum(ratio * A, clipped_ratio * A)                            # [N, T]
    d_per_token = np.where(unclipped, -A * ratio, 0.0)                               # d per_token / d log p
    kl = np.zeros_like(per_token)
    if beta:
        gap = ref_log_probs - log_probs                                              # [N, T]
        k3 = np.exp(gap) - gap - 1
        kl = k3 * ratio
        per_token = per_token + beta * kl
        d_per_token = d_per_token + beta * ((1 - np.exp(gap)) * ratio + kl)
    N, T = log_probs.shape
    if loss_type == "grpo":
        weights = mask / np.maximum(mask.sum(axis=1, keepdims=True), 1.0) / N        # [N, T]
    elif loss_type == "dr_grpo":
        weights = mask / (N * (max_completion_length or T))
    else:
        weights = mask / max(float(mask.sum()) if tokens is None else float(tokens), 1.0)
    count = max(float(mask.sum()), 1.0)
    low = (ratio < 1 - epsilon_low) & (A < 0)
    high = (ratio > 1 + epsilon_high) & (A > 0)
    return GrpoLoss(float((per_token * weights).sum(dtype=np.float64)), d_per_token * weights,
                    float((kl * mask).sum(dtype=np.float64)) / count, float(((low | high) * mask).sum()) / count)
