"""`inspect`'s memory breakdown: inference (weights, KV cache, buffers) and training (step_memory.training_memory)."""

from __future__ import annotations

import json

import pytest

from qwen_np import preset
from qwen_np.cli import main
from qwen_np.errors import QwenNPError
from qwen_np.inspection import inspect_report
from qwen_np.engine.step_memory import attention_probabilities, training_memory, training_peak, training_remedies, training_total
from qwen_np.engine.memory import kv_cache_bytes_per_token

BANDWIDTH = 10e9


def test_training_memory_is_the_trainers_estimate_and_adds_up():
    config = preset("qwen3-0.6b")
    memory = inspect_report(config, 7, "qwen3-0.6b", BANDWIDTH, context=512, batch_size=4)["memory"]
    estimate = training_memory(config, 4, 512)
    assert {k: memory["training"][k] for k in estimate} == estimate
    assert memory["training"]["total"] == training_total(estimate)
    assert memory["training"]["adamw"] == 2 * memory["training"]["weights"] == 2 * memory["inference"]["weights"]["fp32"]


def test_kv_cache_and_activations_grow_with_the_chosen_context():
    config = preset("qwen3-8b")
    short, long = (inspect_report(config, 7, "8b", BANDWIDTH, context=n)["memory"] for n in (1024, 2048))
    assert short["inference"]["kv_cache_fp32"] == 1024 * kv_cache_bytes_per_token(config, 4)
    assert long["inference"]["kv_cache_fp32"] == 2 * short["inference"]["kv_cache_fp32"]
    assert long["training"]["attention_probabilities"] == 4 * short["training"]["attention_probabilities"]  # T x T
    rest = [m["training"]["activations"] - m["training"]["attention_probabilities"] for m in (short, long)]
    assert rest[1] == 2 * rest[0]                                   # everything else: linear in T
    assert long["inference"]["weights"] == short["inference"]["weights"]


@pytest.mark.slow
def test_inspect_flags_reach_the_memory_breakdown(capsys):
    assert main(["inspect", "--preset", "qwen3-0.6b", "--context", "300", "--batch-size", "3", "--json"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    assert (memory["context"], memory["training"]["batch_size"]) == (300, 3)


def test_a_zero_batch_is_refused_naming_the_parameter():
    with pytest.raises(QwenNPError, match="^batch_size: must be at least 1, got 0"):
        inspect_report(preset("qwen3-0.6b"), 7, "x", BANDWIDTH, batch_size=0)


def test_each_remedy_saves_what_it_removes_for_qwen3_8b_at_4096_tokens():
    """inspect's remedies where the forward's end is the peak (the tape, its attention probabilities stacked
    once more, the logits: all of them per token): a quarter of the batch cuts that by 4, --grad-accum 4 as
    much (the gradients kept to add into come after the forward), BF16 halves the tape, --recompute keeps
    one layer's activations; weights, gradients and AdamW stay."""
    config = preset("qwen3-8b")
    training = inspect_report(config, 7, "8b", BANDWIDTH, context=4096, batch_size=16)["memory"]["training"]
    tape, remedies = training["activations"], training["remedies"]
    assert training["peak"] == "forward"
    per_token = training["total"] - training["weights"] - training["adamw"]
    assert remedies["grad_accum_4"] == remedies["quarter_batch"]
    assert remedies["quarter_batch"]["saves"] == per_token - per_token // 4
    assert remedies["bf16_activations"]["saves"] == tape // 2
    L = config.num_hidden_layers
    assert remedies["recompute"]["saves"] > training["attention_probabilities"] * (L - 1) / L
    assert remedies["all_three"]["saves"] > max(r["saves"] for name, r in remedies.items() if name != "all_three")


def test_grad_accum_keeps_one_more_set_of_gradients_where_the_backward_is_the_peak():
    config = preset("qwen3-0.6b")
    remedies = training_remedies(config, 4, 128)
    assert training_peak(remedies["quarter_batch"]) == training_peak(remedies["grad_accum_4"]) == "backward"
    assert remedies["grad_accum_4"]["total"] - remedies["quarter_batch"]["total"] == remedies["baseline"]["gradients"]


def test_recompute_keeps_each_layers_input_and_one_layers_activations():
    config = preset("qwen3-0.6b")
    full, recomputed = training_memory(config, 2, 256), training_memory(config, 2, 256, recompute=True)
    L, D = config.num_hidden_layers, config.hidden_size
    layer = (full["activations_per_token"] - 4 * 2 * D) // L                 # one layer's, per token
    assert recomputed["activations_per_token"] == full["activations_per_token"] - (L - 1) * layer + (L - 1) * 4 * D
    assert attention_probabilities(config, 2, 256, recompute=True) * L == attention_probabilities(config, 2, 256)
    assert attention_probabilities(config, 2, 256) == 4 * L * config.num_attention_heads * 256 * 256 * 2
