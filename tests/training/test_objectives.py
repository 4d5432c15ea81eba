"""DPO's and GRPO's losses and gradients (qwen_np/training/objectives.py, gradients.token_log_probs) against
TRL 1.16's own code on the same numbers: DPOTrainer._compute_loss over TRL's fused LM head (add_fused_lm_head),
and GRPOTrainer._compute_loss, each run with torch autograd in float64 on a stand-in trainer holding
DPOConfig's / GRPOConfig's defaults. Neither loss is a standalone function in TRL 1.16 (both are methods that
read the trainer's settings and log its metrics), so the stand-in gives them what they read and nothing more."""

from __future__ import annotations

import os
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from qwen_np.training import gradients, objectives

torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
from transformers import PretrainedConfig  # noqa: E402
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer  # noqa: E402
from trl.trainer.utils import add_fused_lm_head, nanstd, selective_log_softmax  # noqa: E402

RELATIVE = 1e-6
V = 11


def relative_error(actual: np.ndarray | float, expected: np.ndarray | float) -> float:
    """max |actual - expected| / max(|expected|), over every entry."""
    actual, expected = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    return float(np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-300))


class Accelerator:
    """What the two losses ask of accelerate on one process: the device, and gathers that gather nothing."""

    device = torch.device("cpu")
    num_processes = 1
    sync_gradients = True

    @staticmethod
    def gather(x: Any) -> Any:
        return x

    gather_for_metrics = gather

    @staticmethod
    def reduce(x: Any, reduction: str = "sum") -> Any:
        return x


class LogitsModel(torch.nn.Module):
    """A causal LM whose backbone's last hidden state is `logits` [B, W, V] and whose LM head is the identity:
    TRL's fused LM head (add_fused_lm_head) on it computes its log-probs from exactly those logits."""

    def __init__(self, logits: Any) -> None:
        super().__init__()
        self.config = PretrainedConfig()
        self.hidden = logits
        self.head = torch.nn.Linear(V, V, bias=False).double()
        self.head.weight.data = torch.eye(V, dtype=torch.float64)
        self.head.weight.requires_grad_(False)

    def forward(self, input_ids: Any = None, **kwargs: Any) -> Any:
        return SimpleNamespace(logits=self.hidden)

    @property
    def base_model(self) -> Any:
        return lambda *args, **kwargs: SimpleNamespace(last_hidden_state=self.hidden)

    def get_output_embeddings(self) -> Any:
        return self.head


def stand_in(config: Any, **attributes: Any) -> SimpleNamespace:
    return SimpleNamespace(args=config, accelerator=Accelerator(), model=SimpleNamespace(training=True),
                           _metrics=defaultdict(lambda: defaultdict(list)), aux_loss_enabled=False, **attributes)


def preference_batch(seed: int, pairs: int = 3, width: int = 9) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(logits [2P, W, V] float64, ids [2P, W], completion mask [2P, W], reference log-probs [2P]): rows chosen
    then rejected, as TRL's batches; each row a prompt then a completion of its own length, then padding."""
    rng = np.random.default_rng(seed)
    logits = 2.0 * rng.standard_normal((2 * pairs, width, V))
    ids = rng.integers(0, V, size=(2 * pairs, width))
    completion = np.zeros((2 * pairs, width), dtype=bool)
    for row in range(2 * pairs):
        start = int(rng.integers(1, 4))
        completion[row, start:int(rng.integers(start + 1, width + 1))] = True
    return logits, ids, completion, rng.normal(-12.0, 3.0, size=2 * pairs)


def ours_dpo(logits: np.ndarray, ids: np.ndarray, completion: np.ndarray, reference: np.ndarray,
             beta: float) -> tuple[float, np.ndarray]:
    """qwen_np's DPO loss and d loss / d logits on the batch (the same path step.dpo_loss_and_gradients takes)."""
    P = len(ids) // 2
    log_probs, probs = gradients.token_log_probs(logits[:, :-1], ids[:, 1:])         # [2P, W-1]
    mask = completion[:, 1:]
    sequence = (log_probs * mask).sum(axis=1)
    result = objectives.dpo_loss(sequence[:P], sequence[P:], reference[:P], reference[P:], beta)
    d_sequence = np.concatenate([result.d_chosen, result.d_rejected])
    d_logits = np.zeros_like(logits)
    d_logits[:, :-1] = gradients.token_log_probs_backward(d_sequence[:, None] * mask, probs, ids[:, 1:])
    return result.loss, d_logits


def trl_dpo(logits: np.ndarray, ids: np.ndarray, completion: np.ndarray, reference: np.ndarray,
            beta: float) -> tuple[float, np.ndarray]:
    """DPOTrainer._compute_loss (TRL 1.16, dpo_trainer.py: the policy's summed log-probs at lines 1299-1316, the
    sigmoid loss at 1387-1388 and its mean at 1529) on the same batch, with precomputed reference log-probs,
    and the gradient torch autograd gives the logits."""
    config = DPOConfig(output_dir="/tmp/unused", use_cpu=True, bf16=False, beta=beta)
    leaf = torch.tensor(logits, dtype=torch.float64, requires_grad=True)
    model = LogitsModel(leaf)
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    trainer = stand_in(config, beta=config.beta, precompute_ref_logps=True, loss_types=config.loss_type,
                       loss_weights=config.loss_weights or [1.0] * len(config.loss_type), ld_alpha=config.ld_alpha,
                       f_divergence_type=config.f_divergence_type, use_weighting=config.use_weighting,
                       _total_train_tokens=0, _tp_size=1)
    P = len(ids) // 2
    inputs = {"input_ids": torch.tensor(ids), "attention_mask": torch.ones(ids.shape, dtype=torch.long),
              "completion_mask": torch.tensor(completion.astype(np.int64)),
              "ref_chosen_logps": torch.tensor(reference[:P]), "ref_rejected_logps": torch.tensor(reference[P:])}
    loss = DPOTrainer._compute_loss(trainer, model, inputs, False)
    loss.backward()
    return loss.item(), leaf.grad.numpy()


@pytest.mark.parametrize("beta", [0.1, 0.5])
@pytest.mark.parametrize("seed", [0, 1])
def test_dpo_loss_and_its_logit_gradient_are_trls(seed: int, beta: float) -> None:
    logits, ids, completion, reference = preference_batch(seed)
    loss, d_logits = ours_dpo(logits, ids, completion, reference, beta)
    expected_loss, expected = trl_dpo(logits, ids, completion, reference, beta)
    assert relative_error(loss, expected_loss) <= RELATIVE
    assert relative_error(d_logits, expected) <= RELATIVE
    assert np.abs(expected).max() > 1e-3, "a batch whose gradient is not all but zero"


def test_dpo_default_beta_and_loss_are_trls_defaults() -> None:
    config = DPOConfig(output_dir="/tmp/unused", use_cpu=True, bf16=False)
    assert config.loss_type == ["sigmoid"] and config.f_divergence_type == "reverse_kl"
    assert objectives.DPO_BETA == config.beta


def test_dpo_accuracy_and_margin_are_trls_reward_figures() -> None:
    result = objectives.dpo_loss(np.array([-3.0, -5.0]), np.array([-4.0, -4.0]), np.array([-3.5, -5.0]),
                                 np.array([-3.5, -3.0]), beta=0.5)
    np.testing.assert_allclose(result.chosen_rewards, [0.25, 0.0])
    np.testing.assert_allclose(result.rejected_rewards, [-0.25, -0.5])
    assert result.accuracy == 1.0 and result.margin == pytest.approx(0.5)


def rollout_batch(seed: int, prompts: int = 2, group: int = 3, width: int = 7) -> dict[str, np.ndarray]:
    """G completions of each of P prompts: the policy's logits [N, T, V] over each completion token, the
    tokens [N, T], a mask of ragged lengths [N, T], the sampling policy's and the reference's log-probs [N, T]
    (off the policy's by 0.4 std: many ratios outside [0.8, 1.2], so the clip acts), rewards [P, G]."""
    rng = np.random.default_rng(seed)
    N = prompts * group
    logits = 1.5 * rng.standard_normal((N, width, V))
    tokens = rng.integers(0, V, size=(N, width))
    mask = np.zeros((N, width), dtype=bool)
    for row in range(N):
        mask[row, :int(rng.integers(1, width + 1))] = True
    policy = gradients.token_log_probs(logits, tokens)[0]
    return {"logits": logits, "tokens": tokens, "mask": mask, "old": policy + 0.4 * rng.standard_normal(policy.shape),
            "ref": policy + 0.4 * rng.standard_normal(policy.shape), "rewards": rng.normal(size=(prompts, group))}


def ours_grpo(batch: dict[str, np.ndarray], advantages: np.ndarray, loss_type: str,
              beta: float) -> tuple[objectives.GrpoLoss, np.ndarray]:
    log_probs, probs = gradients.token_log_probs(batch["logits"], batch["tokens"])
    result = objectives.grpo_loss(log_probs, batch["old"], advantages, batch["mask"], loss_type, beta, batch["ref"],
                                  max_completion_length=10)
    return result, gradients.token_log_probs_backward(result.d_log_probs, probs, batch["tokens"])


def trl_grpo(batch: dict[str, np.ndarray], advantages: np.ndarray, loss_type: str,
             beta: float) -> tuple[float, np.ndarray, dict[str, Any]]:
    """GRPOTrainer._compute_loss (TRL 1.16, grpo_trainer.py lines 3020-3180: the ratio at 3076-3095, the k3 KL and
    its bias correction at 3098-3104, the clipped loss at 3110-3119, each loss type's average at 3153-3180) on
    the batch, the per-token log-probs from the logits by TRL's selective_log_softmax, as its
    _get_per_token_logps_and_entropies takes them; returns the loss, d loss / d logits and TRL's metrics."""
    config = GRPOConfig(output_dir="/tmp/unused", use_cpu=True, bf16=False, loss_type=loss_type, beta=beta,
                        max_completion_length=10)
    leaf = torch.tensor(batch["logits"], dtype=torch.float64, requires_grad=True)
    tokens = torch.tensor(batch["tokens"])

    def per_token_logps(model: Any, input_ids: Any, attention_mask: Any, logits_to_keep: int,
                        **kwargs: Any) -> tuple[Any, Any, None]:
        assert logits_to_keep == tokens.shape[1]
        return selective_log_softmax(leaf, tokens), torch.zeros(tokens.shape, dtype=torch.float64), None

    trainer = stand_in(config, beta=config.beta, loss_type=config.loss_type, epsilon_low=config.epsilon,
                       epsilon_high=config.epsilon_high if config.epsilon_high is not None else config.epsilon,
                       importance_sampling_level=config.importance_sampling_level,
                       off_policy_mask_threshold=config.off_policy_mask_threshold,
                       top_entropy_quantile=config.top_entropy_quantile, use_vllm=config.use_vllm,
                       vllm_importance_sampling_correction=config.vllm_importance_sampling_correction,
                       max_completion_length=config.max_completion_length, current_gradient_accumulation_steps=1,
                       _entropy_bonus_enabled=False, _get_per_token_logps_and_entropies=per_token_logps)
    N = len(tokens)
    mask = torch.tensor(batch["mask"].astype(np.int64))
    inputs = {"prompt_ids": torch.zeros((N, 2), dtype=torch.long), "prompt_mask": torch.ones((N, 2), dtype=torch.long),
              "completion_ids": tokens, "completion_mask": mask, "advantages": torch.tensor(advantages),
              "old_per_token_logps": torch.tensor(batch["old"]), "ref_per_token_logps": torch.tensor(batch["ref"]),
              "num_items_in_batch": mask.sum()}
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    loss.backward()
    return loss.item(), leaf.grad.numpy(), {key: values[-1] for key, values in trainer._metrics["train"].items()}


def trl_advantages(rewards: np.ndarray, scale_rewards: str) -> np.ndarray:
    """GRPOTrainer's advantages for one reward function (grpo_trainer.py lines 2761-2787, "sum_then_normalize"),
    the groups' std by TRL's nanstd."""
    r = torch.tensor(rewards.reshape(-1))
    G = rewards.shape[1]
    mean = r.view(-1, G).mean(dim=1).repeat_interleave(G)
    std = nanstd(r.view(-1, G), dim=1).repeat_interleave(G) if G > 1 else torch.zeros_like(r)
    advantages = r - mean
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    return advantages.numpy()


@pytest.mark.parametrize("scale_rewards", ["group", "none"])
def test_group_advantages_are_trls(scale_rewards: str) -> None:
    rewards = np.random.default_rng(4).normal(size=(3, 4))
    ours = objectives.group_advantages(rewards, scale=scale_rewards != "none").reshape(-1)
    assert relative_error(ours, trl_advantages(rewards, scale_rewards)) <= RELATIVE


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", objectives.LOSS_TYPES)
def test_grpo_loss_and_its_logit_gradient_are_trls_with_the_clip_acting(loss_type: str, beta: float) -> None:
    batch = rollout_batch(seed=7)
    advantages = objectives.group_advantages(batch["rewards"]).reshape(-1)
    ours, d_logits = ours_grpo(batch, advantages, loss_type, beta)
    loss, expected, metrics = trl_grpo(batch, advantages, loss_type, beta)
    assert relative_error(ours.loss, loss) <= RELATIVE
    assert relative_error(d_logits, expected) <= RELATIVE
    assert 0.2 <= metrics["clip_ratio/region_mean"] <= 0.8, "the clip holds some tokens, not all"
    assert ours.clipped == pytest.approx(metrics["clip_ratio/region_mean"])
    if beta:
        assert ours.kl == pytest.approx(metrics["kl"], rel=RELATIVE)


def test_grpo_defaults_are_trls() -> None:
    config = GRPOConfig(output_dir="/tmp/unused", use_cpu=True, bf16=False)
    assert (config.loss_type, config.beta, config.epsilon, config.scale_rewards) == ("dapo", 0.0, objectives.EPSILON, "group")
    assert config.epsilon_high is None and config.use_bias_correction_kl and config.importance_sampling_level == "token"
