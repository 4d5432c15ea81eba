"""A Qwen3-MoE's backward by hand (gradients.moe_backward, route_backward, load_balancing_loss) against float64
central differences and against torch autograd of transformers' Qwen3MoeForCausalLM, its loss with the
load-balancing term; and `train` training one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from qwen_np.cli import main
from qwen_np.core import layers
from qwen_np.core.config import Qwen3Config
from qwen_np.engine.loading import load_model
from qwen_np.errors import QwenNPError
from qwen_np.training import gradients, lora
from qwen_np.training.parameters import hf_config, init_parameters, model_from_parameters
from qwen_np.training.run_state import load_state
from qwen_np.training.step import loss_and_gradients, router_loss
from tests.reference.finite_differences import central_difference
from tests.reference.logit_match import max_relative_error
from tests.training.test_gradients import assert_central_differences, micro_model
from tests.training.test_training import write_text

MICRO = dict(vocab_size=13, hidden_size=8, intermediate_size=12, num_attention_heads=4, num_key_value_heads=2,
             head_dim=4, max_position_embeddings=16, rope_theta=100.0, num_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=6, router_aux_loss_coef=0.3)
# Both renormalisations, each with a dense layer among the sparse ones (transformers' two rules for it).
MICRO_MOES = [pytest.param(dict(num_hidden_layers=2, norm_topk_prob=True, mlp_only_layers=(0,), tie_word_embeddings=False),
                           id="normalized-mlp_only_layers"),
              pytest.param(dict(num_hidden_layers=2, norm_topk_prob=False, decoder_sparse_step=2, tie_word_embeddings=True),
                           id="unnormalized-sparse_step2")]
STEP = 1e-6                      # central differences' h


def top_k_margin(logits: np.ndarray, top_k: int) -> float:
    """The smallest gap, over the rows, between the K-th and the (K+1)-th router logit: central differences of a
    step much smaller than it never move a token to another expert (where the loss jumps)."""
    ordered = -np.sort(-logits.reshape(-1, logits.shape[-1]), axis=-1)
    return float((ordered[:, top_k - 1] - ordered[:, top_k]).min())


def moe_block(rng: np.random.Generator, N: int = 6, D: int = 5, E: int = 4, Fe: int = 3):
    x = rng.standard_normal((N, D))
    router = rng.standard_normal((E, D))
    experts = [tuple(rng.standard_normal(shape) * 0.7 for shape in ((Fe, D), (Fe, D), (D, Fe))) for _ in range(E)]
    return x, router, experts


@pytest.mark.parametrize("normalize", [True, False], ids=["norm_topk_prob", "raw_top_k"])
def test_moe_block_backward_is_the_derivative_of_the_block(normalize: bool) -> None:
    """d <g, moe(x)> + <c, router logits> by central differences in float64, for x, the router and every expert's
    three matrices: the routing weights' path through the softmax (renormalised or not) and the experts' SwiGLU.
    The second term stands for the load-balancing loss's gradient, which enters through the logits."""
    rng = np.random.default_rng(46)
    x, router, experts = moe_block(rng)
    top_k = 2
    assert top_k_margin(x @ router.T, top_k) > 1e3 * STEP
    d_out, c = rng.standard_normal(x.shape), rng.standard_normal((len(x), len(router)))

    def objective() -> float:
        return float(np.vdot(d_out, layers.moe(x, router, experts, top_k, normalize)) + np.vdot(c, x @ router.T))

    dx, grads = gradients.moe_backward(d_out, x, x @ router.T, router, experts, top_k, normalize, c)
    checked = {"x": (x, dx), "router": (router, grads["router"])}
    checked.update({f"experts.{e}.{key}": (w, grads[f"experts.{e}.{key}"])
                    for e, expert in enumerate(experts) for key, w in zip(("gate_proj", "up_proj", "down_proj"), expert)})
    for name, (p, analytic) in checked.items():
        numeric = central_difference(objective, p, STEP)
        assert np.abs(analytic - numeric).max() <= 1e-7 * max(1.0, np.abs(numeric).max()), name


def test_an_expert_no_token_chose_gets_a_zero_gradient() -> None:
    rng = np.random.default_rng(1)
    x, router, experts = moe_block(rng)
    x[:, 0], router[:, 0], router[3, 0] = 1.0, 0.0, -100.0     # a constant feature that only expert 3's logit reads
    logits = x @ router.T
    assert not (layers.route(logits, 2, True)[0] == 3).any()
    _, grads = gradients.moe_backward(rng.standard_normal(x.shape), x, logits, router, experts, 2, True)
    assert all(not grads[f"experts.3.{key}"].any() for key in ("gate_proj", "up_proj", "down_proj"))
    assert grads["experts.0.up_proj"].any()


def test_load_balancing_loss_is_k_balanced_and_e_collapsed_and_its_gradient_is_the_derivative() -> None:
    """Uniform probabilities with every expert equally loaded give K; a router sure of the same K experts for every
    token gives E (f_e = 1 and P_e = 1/K on those K). Its gradient, by central differences, with f held (a top-k
    count: piecewise constant)."""
    E, K, N = 6, 2, 12
    balanced = np.zeros((N, E))
    balanced[np.arange(N), np.arange(N) % E] = balanced[np.arange(N), (np.arange(N) + 1) % E] = 1e-9   # a tie-break
    assert gradients.load_balancing_loss([balanced], K)[0] == pytest.approx(K)
    collapsed = np.zeros((N, E))
    collapsed[:, :K] = 30.0
    assert gradients.load_balancing_loss([collapsed, collapsed], K)[0] == pytest.approx(E, rel=1e-6)
    rng = np.random.default_rng(2)
    logits = [rng.standard_normal((3, 4, E)), rng.standard_normal((3, 4, E))]       # two sparse layers, [B, T, E]
    assert min(top_k_margin(r, K) for r in logits) > 1e3 * STEP
    loss, d_logits = gradients.load_balancing_loss(logits, K)
    for layer, analytic in zip(logits, d_logits):
        assert analytic.shape == layer.shape
        numeric = central_difference(lambda: gradients.load_balancing_loss(logits, K)[0], layer, STEP)
        assert np.abs(analytic - numeric).max() <= 1e-8


@pytest.mark.slow
@pytest.mark.parametrize("shape", MICRO_MOES)
def test_every_moe_gradient_matches_float64_central_differences(shape: dict) -> None:
    """d loss / d w for EVERY scalar weight of a micro Qwen3-MoE (attention, the dense layer, the router, every
    expert), the loss with its load-balancing term, in float64; with recomputation, the same bits."""
    config = Qwen3Config(**MICRO, **shape)
    model, _, batch = micro_model(config)
    tape = gradients.forward_with_tape(model, batch[:, :-1])[1]
    assert len(tape.router_logits) == 1 and min(top_k_margin(r, 2) for r in tape.router_logits.values()) > 1e3 * STEP
    assert router_loss(model, tape)[0] > 0.3 * 2 * 0.999           # the coefficient times (at least about) K
    assert_central_differences(config, recompute_too=True)


TORCH_SHAPE = dict(vocab_size=64, hidden_size=24, intermediate_size=40, num_attention_heads=6, num_key_value_heads=3,
                   head_dim=10, moe_intermediate_size=16)
TORCH_MOES = [
    pytest.param(dict(num_hidden_layers=3, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                      tie_word_embeddings=False), id="normalized-mlp_only_layers-untied"),
    pytest.param(dict(num_hidden_layers=4, num_experts=5, num_experts_per_tok=3, norm_topk_prob=False,
                      decoder_sparse_step=2, tie_word_embeddings=True), id="unnormalized-sparse_step2-tied"),
]


def torch_gradients(model, moe_intermediate_size: int) -> dict[str, np.ndarray]:
    """Every parameter's .grad by checkpoint name: transformers keeps a sparse layer's experts stacked
    (experts.gate_up_proj [E, 2 Fe, D], gate rows first; experts.down_proj [E, D, Fe]); the checkpoint, one per expert."""
    out: dict[str, np.ndarray] = {}
    for name, parameter in model.named_parameters():
        g = parameter.grad.numpy()
        if name.endswith("mlp.experts.gate_up_proj"):
            for e in range(g.shape[0]):
                out[f"{name[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = g[e, :moe_intermediate_size]
                out[f"{name[:-len('gate_up_proj')]}{e}.up_proj.weight"] = g[e, moe_intermediate_size:]
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(g.shape[0]):
                out[f"{name[:-len('down_proj')]}{e}.down_proj.weight"] = g[e]
        else:
            out[name] = g
    return out


@pytest.mark.slow
@pytest.mark.parametrize("shape", TORCH_MOES)
def test_moe_loss_and_gradients_match_transformers_autograd_with_the_load_balancing_loss(shape: dict, tmp_path: Path) -> None:
    """Qwen3MoeForCausalLM with output_router_logits: its loss (cross-entropy + router_aux_loss_coef x
    load_balancing_loss_func over the sparse layers) and torch autograd's gradient of every tensor."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.reference.hf_reference import build_reference_model, make_moe_config, save_bf16_checkpoint

    config = make_moe_config(**TORCH_SHAPE, **shape)
    config.router_aux_loss_coef, config.output_router_logits = 0.25, True    # large: its gradient must show
    reference = build_reference_model(config, seed=5)
    batch = np.random.default_rng(5).integers(0, TORCH_SHAPE["vocab_size"], size=(3, 12))
    ids = torch.from_numpy(batch)
    reference.train()
    # Inputs batch[:, :-1] predicting batch[:, 1:], as loss_and_gradients reads a batch: the router's loss is over
    # the positions the model reads, so transformers must read the same ones (labels shifted by hand).
    output = reference(input_ids=ids[:, :-1], labels=ids[:, :-1], shift_labels=ids[:, 1:].contiguous())
    output.loss.backward()
    expected = torch_gradients(reference, TORCH_SHAPE["moe_intermediate_size"])
    aux = output.aux_loss.item()
    save_bf16_checkpoint(reference, tmp_path)
    model = load_model(tmp_path, memory="fp32")
    assert model.config.router_aux_loss_coef == 0.25
    loss, grads = loss_and_gradients(model, batch)
    assert abs(loss - output.loss.item()) <= 1e-6 * output.loss.item()
    tape = gradients.forward_with_tape(model, batch[:, :-1])[1]
    assert abs(router_loss(model, tape)[0] - 0.25 * aux) <= 1e-6 * aux
    assert sorted(grads) == sorted(expected)
    for tensor, ref in expected.items():
        assert max_relative_error(grads[tensor], ref) <= 1e-5, tensor


TINY_MOE = dict(model_type="qwen3_moe", vocab_size=300, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=4, max_position_embeddings=64,
                tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                norm_topk_prob=True, mlp_only_layers=[0], router_aux_loss_coef=0.01)


@pytest.mark.slow
def test_train_trains_a_tiny_moe_and_exports_a_qwen3_moe(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(hf_config(TINY_MOE)))
    data = write_text(tmp_path / "text.txt")
    assert main(["train", "--out", str(tmp_path / "run"), "--data", str(data), "--config", str(config), "--batch-size", "4",
                 "--context", "16", "--eval-every", "10", "--warmup", "2", "--lr", "1e-2", "--steps", "20"]) == 0
    meta = load_state(tmp_path / "run" / "last.safetensors")[3]
    assert meta["evals"][-1]["loss_per_token"] < meta["evals"][0]["loss_per_token"]
    exported = json.loads((tmp_path / "run" / "model" / "config.json").read_text())
    assert exported["model_type"] == "qwen3_moe" and exported["architectures"] == ["Qwen3MoeForCausalLM"]
    model = load_model(tmp_path / "run" / "model", memory="fp32")
    assert model.config.sparse_layer(1) and not model.config.sparse_layer(0)
    assert model.forward([1, 2, 3]).shape == (3, TINY_MOE["vocab_size"])


def test_lora_on_a_moe_is_refused_by_name() -> None:
    config = Qwen3Config.from_dict(hf_config({**TINY_MOE, "vocab_size": 13}))
    model = model_from_parameters(config, init_parameters(config, seed=0))
    lora.add_adapters(model, rank=2)
    with pytest.raises(QwenNPError, match="LoRA on a Qwen3-MoE"):
        loss_and_gradients(model, np.zeros((1, 4), dtype=np.int64))


@pytest.mark.slow
def test_recorded_moe_run_repeats_its_first_steps() -> None:
    """The walkthrough's MoE run (chapter 12, docs/figures/moe.json) is recorded: its first steps must still come out
    of the code, to rtol 1e-3 (the record's 4 digits, and the BLAS kernel's last bits)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[2] / "tools" / "walkthrough"))
    import walkthrough_moe

    walkthrough_moe.check_first_steps(walkthrough_moe.load_record())     # raises naming the step
