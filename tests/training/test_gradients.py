"""The hand-written backward pass (qwen_np/training/gradients.py) against torch autograd and finite differences."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from qwen_np.training import gradients
from qwen_np.core import layers
from qwen_np.core.config import Qwen3Config
from qwen_np.engine.loading import load_model
from qwen_np.training.parameters import init_parameters, model_from_parameters
from qwen_np.core.model import Qwen3Model
from qwen_np.training.step import loss_and_gradients, router_loss
from tests.reference.finite_differences import central_difference
from tests.reference.logit_match import max_relative_error

FIXTURES = Path(__file__).parents[1] / "fixtures" / "gradients"
GRADIENT_FIXTURES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())
LOSS_RELATIVE = 1e-6          # the bounds against torch: loss relative error, and each gradient's
GRADIENT_RELATIVE = 1e-5      # max|diff| / max(1, max|reference|): logit_match's measure


@pytest.mark.parametrize("name", GRADIENT_FIXTURES)
def test_loss_and_every_gradient_match_torch_autograd(name: str) -> None:
    reference = np.load(FIXTURES / name / "reference.npz")
    model = load_model(FIXTURES / name, memory="fp32")
    loss, grads = loss_and_gradients(model, reference["batch"])
    expected = {key[len("grad/"):]: reference[key] for key in reference.files if key.startswith("grad/")}
    assert sorted(grads) == sorted(expected), "one gradient per checkpoint tensor, named as in the checkpoint"
    assert abs(loss - float(reference["loss"])) <= LOSS_RELATIVE * float(reference["loss"])
    for tensor, ref in expected.items():
        assert grads[tensor].shape == ref.shape and grads[tensor].dtype == np.float32, tensor
        assert max_relative_error(grads[tensor], ref) <= GRADIENT_RELATIVE, tensor


def test_gradient_fixtures_cover_the_issue_configs() -> None:
    configs = [json.loads((FIXTURES / name / "config.json").read_text()) for name in GRADIENT_FIXTURES]
    batches = [np.load(FIXTURES / name / "reference.npz")["batch"] for name in GRADIENT_FIXTURES]
    tied = {c["tie_word_embeddings"] for c in configs}
    kinds = {"mha" if c["num_key_value_heads"] == c["num_attention_heads"] else
             "mqa" if c["num_key_value_heads"] == 1 else "gqa" for c in configs}
    assert tied == {True, False} and kinds == {"mha", "mqa", "gqa"}
    assert any(c["head_dim"] * c["num_attention_heads"] != c["hidden_size"] for c in configs)
    assert any(b.shape[0] > 1 for b in batches)


@pytest.mark.slow
def test_loss_and_gradients_match_torch_live(tmp_path: Path) -> None:
    """A fresh random model each run, checked against transformers + torch autograd directly."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.reference.hf_reference import build_reference_model, make_config, save_bf16_checkpoint

    config = make_config(vocab_size=64, hidden_size=24, intermediate_size=40, num_hidden_layers=3,
                         num_attention_heads=6, num_key_value_heads=3, head_dim=10, tie_word_embeddings=False)
    reference = build_reference_model(config, seed=5)
    batch = np.random.default_rng(5).integers(0, 64, size=(3, 12))
    ids = torch.from_numpy(batch)
    reference.train()
    torch_loss = reference(input_ids=ids, labels=ids).loss
    torch_loss.backward()
    expected = {n: p.grad.numpy().copy() for n, p in reference.named_parameters()}
    save_bf16_checkpoint(reference, tmp_path)
    loss, grads = loss_and_gradients(load_model(tmp_path, memory="fp32"), batch)
    assert abs(loss - torch_loss.item()) <= LOSS_RELATIVE * torch_loss.item()
    assert sorted(grads) == sorted(expected)
    for tensor, ref in expected.items():
        assert max_relative_error(grads[tensor], ref) <= GRADIENT_RELATIVE, tensor


MICRO = dict(vocab_size=13, hidden_size=8, intermediate_size=12, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=4, max_position_embeddings=16)


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False])
def test_every_gradient_matches_float64_central_differences(tied: bool) -> None:
    """d loss / d w for EVERY scalar weight of a micro model, in float64, by (L(w+h) - L(w-h)) / 2h."""
    assert_central_differences(Qwen3Config(**MICRO, tie_word_embeddings=tied, rope_theta=100.0))


# Every ablation (config.ABLATION_CHOICES) and two together: post-norm's blocks without their residual.
ABLATIONS = [{"use_rope": False}, {"use_qk_norm": False}, {"norm_position": "post"}, {"use_residual": False},
             {"mlp_type": "gelu"}, {"norm_position": "post", "use_residual": False}]


@pytest.mark.slow
@pytest.mark.parametrize("ablation", ABLATIONS, ids=lambda a: "+".join(f"{k}={v}" for k, v in a.items()))
def test_every_ablation_gradient_matches_float64_central_differences(ablation: dict) -> None:
    """The backward of each ablated layer (residual_block_backward, gelu_mlp_backward, the skipped RoPE and
    QK-norm), every scalar weight by central differences; with recomputation, the same bits."""
    assert_central_differences(Qwen3Config(**MICRO, tie_word_embeddings=True, rope_theta=100.0, **ablation),
                               recompute_too=True)


def micro_model(config: Qwen3Config) -> tuple[Qwen3Model, dict[str, np.ndarray], np.ndarray]:
    """A float64 model of `config` with its weights spread around their initial values, and a batch [2, 7]."""
    rng = np.random.default_rng(3)
    params = {n: (p.astype(np.float64) + (0.3 if p.ndim == 1 else 0.25) * rng.standard_normal(p.shape))
              for n, p in init_parameters(config, seed=3).items()}
    return model_from_parameters(config, params), params, rng.integers(0, config.vocab_size, size=(2, 7))


def assert_central_differences(config: Qwen3Config, recompute_too: bool = False) -> None:
    """Every scalar weight's gradient against central differences of the training loss (a Qwen3-MoE's with its
    load-balancing term, router_loss)."""
    model, params, batch = micro_model(config)
    _, grads = loss_and_gradients(model, batch)
    assert sorted(grads) == sorted(params), "one gradient per tensor the config has"
    if recompute_too:
        _, recomputed = loss_and_gradients(model, batch, recompute=True)
        assert all(np.array_equal(recomputed[name], g) for name, g in grads.items())

    def loss() -> float:
        logits, tape = gradients.forward_with_tape(model, batch[:, :-1])
        return gradients.cross_entropy(logits, batch[:, 1:])[0] + router_loss(model, tape)[0]

    for name, p in params.items():
        numeric = central_difference(loss, p)
        assert np.abs(grads[name] - numeric).max() <= 1e-7 * max(1.0, np.abs(numeric).max()), name


def test_gelu_backward_is_the_derivative_of_gelu() -> None:
    """gelu_backward against central differences of layers.gelu, over the range where the tanh bends and saturates."""
    x = np.linspace(-8, 8, 401)
    h = 1e-6
    numeric = (layers.gelu(x + h) - layers.gelu(x - h)) / (2 * h)
    assert np.abs(gradients.gelu_backward(np.ones_like(x), x) - numeric).max() < 1e-8


def test_rope_backward_is_the_transpose_of_rope() -> None:
    """<rope(x), y> == <x, rope_backward(y)> for any x, y: the backward is the forward's adjoint."""
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((2, 2, 5, 3, 8))
    cos, sin = layers.rope_angles(layers.rope_inverse_frequencies(8, 1e4), np.arange(5))
    lhs = np.vdot(layers.rope(x, cos.astype(np.float64), sin.astype(np.float64)), y)
    rhs = np.vdot(x, gradients.rope_backward(y, cos.astype(np.float64), sin.astype(np.float64)))
    assert abs(lhs - rhs) < 1e-12 * abs(lhs)


def test_embedding_gradient_adds_up_repeated_tokens() -> None:
    d_out = np.ones((1, 3, 2), dtype=np.float32)
    d_table = gradients.embed_backward(d_out, np.array([[4, 1, 4]]), vocab_size=5)
    assert d_table[4].tolist() == [2.0, 2.0] and d_table[1].tolist() == [1.0, 1.0] and d_table[0].tolist() == [0, 0]


def test_masked_positions_pass_back_no_gradient() -> None:
    rng = np.random.default_rng(1)
    scores = layers.causal_mask(rng.standard_normal((1, 2, 4, 4)).astype(np.float32), np.arange(4))
    d_scores = gradients.softmax_backward(rng.standard_normal((1, 2, 4, 4)).astype(np.float32), layers.softmax(scores))
    assert np.all(d_scores[..., np.triu_indices(4, 1)[0], np.triu_indices(4, 1)[1]] == 0)


def test_cross_entropy_is_the_mean_negative_log_likelihood() -> None:
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((2, 3, 7)).astype(np.float32) * 4
    targets = rng.integers(0, 7, size=(2, 3))
    loss, d_logits = gradients.cross_entropy(logits, targets)
    log_probs = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    assert abs(loss + np.take_along_axis(log_probs, targets[..., None], -1).mean()) < 1e-6
    assert np.allclose(d_logits.sum(-1), 0, atol=1e-7)            # softmax minus one-hot sums to 0
