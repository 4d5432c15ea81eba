"""Live cross-check: qwen_np vs transformers' Qwen3ForCausalLM on freshly built random models.

Each test builds a random BF16-exact model with transformers (tests/reference/hf_reference.py),
computes FP32 eager logits, saves the model as a BF16 safetensors checkpoint, loads that
with qwen_np and compares the logits at every position. Skipped where the `reference`
extra (torch + transformers) is not installed. Run with `pytest -s` to see the errors.
"""

import gc
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import qwen_np  # noqa: E402

from tests.reference.hf_reference import (  # noqa: E402
    build_reference_model,
    make_config,
    random_token_ids,
    reference_logits,
    save_bf16_checkpoint,
)
from tests.reference.logit_match import assert_logits_match  # noqa: E402

pytestmark = pytest.mark.slow      # torch and transformers, at up to Qwen3-8B's width

SMALL_PROMPT_TOKENS = 40

# (id, make_config arguments, seed): shapes the stored fixtures do not already pin down.
SMALL_MODELS = [
    pytest.param(dict(vocab_size=1000, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, head_dim=32,
                      tie_word_embeddings=True), 11, id="tied-mha-head_dim_gt_hidden_over_heads"),
    pytest.param(dict(vocab_size=777, hidden_size=80, intermediate_size=224, num_hidden_layers=3,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=8,
                      tie_word_embeddings=False, rope_theta=1e4, rms_norm_eps=1e-5), 12,
                 id="untied-gqa2-head_dim_lt_hidden_over_heads-theta1e4-eps1e5"),
    pytest.param(dict(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                      num_attention_heads=16, num_key_value_heads=4, head_dim=8,
                      tie_word_embeddings=False), 13, id="untied-gqa4-head_dim_equals_hidden_over_heads"),
    pytest.param(dict(vocab_size=640, hidden_size=96, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=1, head_dim=40,
                      tie_word_embeddings=True), 14, id="tied-mqa8-head_dim_gt_hidden_over_heads"),
]

# Qwen3-8B layer and vocabulary shapes (its config.json on the Hub), truncated to two decoder layers.
QWEN3_8B_WIDTH = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                      num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6)
QWEN3_8B_WIDTH_PROMPT_TOKENS = 16


def transformers_logits_and_checkpoint(model_args: dict, seed: int, prompt_tokens: int,
                                       directory: Path, max_shard_size: str = "50GB"
                                       ) -> tuple[np.ndarray, np.ndarray]:
    """Build a random transformers model, return (input_ids, FP32 logits), save it as BF16.

    The torch model is released before returning so that, at 8B width, qwen_np can load
    the checkpoint without a second full copy of the weights being alive.
    """
    config = make_config(**model_args)
    model = build_reference_model(config, seed=seed)
    input_ids = random_token_ids(config.vocab_size, prompt_tokens, seed=seed)
    logits = reference_logits(model, input_ids)
    save_bf16_checkpoint(model, directory, max_shard_size=max_shard_size)
    del model
    gc.collect()
    return input_ids, logits


@pytest.mark.parametrize("model_args, seed", SMALL_MODELS)
def test_matches_transformers_on_random_small_models(model_args: dict, seed: int,
                                                     tmp_path: Path,
                                                     request: pytest.FixtureRequest) -> None:
    """qwen_np logits equal transformers' at every position of a 40-token prompt."""
    input_ids, expected = transformers_logits_and_checkpoint(
        model_args, seed, SMALL_PROMPT_TOKENS, tmp_path)
    logits = qwen_np.load_model(tmp_path).forward(input_ids)
    error = assert_logits_match(logits, expected, request.node.callspec.id)
    print(f"\n{request.node.callspec.id}: max relative error {error:.2e}")


def test_matches_transformers_at_qwen3_8b_width(tmp_path: Path) -> None:
    """At full Qwen3-8B width (4096 hidden, 32/8 heads of 128, 12288 MLP, 151936 vocab,
    untied; 2 layers, ~1.6B parameters) qwen_np matches transformers at every position,
    loading a checkpoint sharded over several files."""
    input_ids, expected = transformers_logits_and_checkpoint(
        QWEN3_8B_WIDTH, 8, QWEN3_8B_WIDTH_PROMPT_TOKENS, tmp_path, max_shard_size="1GB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    logits = qwen_np.load_model(tmp_path).forward(input_ids)
    error = assert_logits_match(logits, expected, "Qwen3-8B width")
    print(f"\nQwen3-8B width, 2 layers: max relative error {error:.2e}")
