"""`inspect`'s memory breakdown: inference (weights, KV cache, buffers) and training (memory.training_memory)."""

from __future__ import annotations

import json

import pytest

from qwen_np import preset
from qwen_np.cli import main
from qwen_np.errors import QwenNPError
from qwen_np.inspection import inspect_report
from qwen_np.memory import kv_cache_bytes_per_token, training_memory

BANDWIDTH = 10e9


def test_training_memory_is_the_trainers_estimate_and_adds_up():
    config = preset("qwen3-0.6b")
    memory = inspect_report(config, 7, "qwen3-0.6b", BANDWIDTH, context=512, batch_size=4)["memory"]
    estimate = training_memory(config, 4, 512)
    assert {k: memory["training"][k] for k in estimate} == estimate
    assert memory["training"]["total"] == sum(v for k, v in estimate.items() if k != "activations_per_token")
    assert memory["training"]["adamw"] == 2 * memory["training"]["weights"] == 2 * memory["inference"]["weights"]["fp32"]


def test_kv_cache_and_activations_grow_with_the_chosen_context():
    config = preset("qwen3-8b")
    short, long = (inspect_report(config, 7, "8b", BANDWIDTH, context=n)["memory"] for n in (1024, 2048))
    assert short["inference"]["kv_cache_fp32"] == 1024 * kv_cache_bytes_per_token(config, 4)
    assert long["inference"]["kv_cache_fp32"] == 2 * short["inference"]["kv_cache_fp32"]
    assert long["training"]["activations"] > 2 * short["training"]["activations"]   # attention grows with T too
    assert long["inference"]["weights"] == short["inference"]["weights"]


def test_inspect_flags_reach_the_memory_breakdown(capsys):
    assert main(["inspect", "--preset", "qwen3-0.6b", "--context", "300", "--batch-size", "3", "--json"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    assert (memory["context"], memory["training"]["batch_size"]) == (300, 3)


def test_a_zero_batch_is_refused_naming_the_flag():
    with pytest.raises(QwenNPError, match="--batch-size"):
        inspect_report(preset("qwen3-0.6b"), 7, "x", BANDWIDTH, batch_size=0)
