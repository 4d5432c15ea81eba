"""YaRN (rope_scaling {"rope_type": "yarn"}) against transformers' Qwen3ForCausalLM: its inverse frequencies and
attention factor, and the logits at positions past the original window, readable and fast paths, whole and
through the KV cache. A small original window (32 positions) makes an 80-token prompt reach 2.5 times past it (the
context grows 3-8 times)."""

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import qwen_np  # noqa: E402
from qwen_np.core.model import rope_frequencies  # noqa: E402
from qwen_np.engine.budget import model_context  # noqa: E402

from tests.reference import hf_reference as hf  # noqa: E402
from tests.reference.logit_match import assert_logits_match  # noqa: E402

pytestmark = pytest.mark.slow      # torch and transformers

ORIGINAL_WINDOW = 32
PROMPT_TOKENS = 80
PREFIX_TOKENS = 20               # cached in one pass, then the rest one token at a time

# (YaRN parameters, the ramp's shape): Qwen's documented form; explicit betas and attention factor, no truncation.
YARN = [
    pytest.param({"factor": 4.0}, id="qwen-documented"),
    pytest.param({"factor": 3.0, "beta_fast": 16, "beta_slow": 2, "attention_factor": 1.3, "truncate": False},
                 id="explicit-untruncated"),
    pytest.param({"factor": 8.0, "mscale": 1.0, "mscale_all_dim": 0.5}, id="mscale"),
]
MODEL = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, tie_word_embeddings=False, rope_theta=1e4)


@pytest.fixture(scope="module", params=YARN)
def yarn_model(request, tmp_path_factory):
    """(checkpoint folder, token ids, transformers' logits, its inv_freq and attention factor)."""
    scaling = {"rope_type": "yarn", "original_max_position_embeddings": ORIGINAL_WINDOW, **request.param}
    # The config's own window is the original one (as transformers expects: factor x it is the new context).
    model = hf.build_reference_model(hf.make_config(**MODEL, rope_scaling=scaling, max_position_embeddings=ORIGINAL_WINDOW),
                                  seed=46)
    ids = hf.random_token_ids(MODEL["vocab_size"], PROMPT_TOKENS, seed=46)
    expected = hf.reference_logits(model, ids)
    rotary = model.model.rotary_emb
    inv_freq, attention_factor = rotary.inv_freq.numpy().copy(), rotary.attention_scaling
    folder = tmp_path_factory.mktemp("yarn")
    hf.save_bf16_checkpoint(model, folder)              # the model in BF16 from here
    return folder, ids, expected, inv_freq, attention_factor


def test_yarn_frequencies_and_attention_factor_are_transformers(yarn_model):
    folder, _, _, inv_freq, attention_factor = yarn_model
    ours, scale = rope_frequencies(qwen_np.load_config(folder))
    np.testing.assert_allclose(ours, inv_freq, rtol=2e-7)          # 1 ulp at most: torch's FP32 pow
    assert scale == pytest.approx(attention_factor, rel=1e-12)


@pytest.mark.parametrize("fast", [False, True], ids=["readable", "fast"])
def test_yarn_logits_match_transformers_past_the_original_window(yarn_model, fast):
    folder, ids, expected, _, _ = yarn_model
    model = qwen_np.load_model(folder, fast=fast, memory="fp32")
    assert_logits_match(model.forward(ids), expected, "whole prompt")
    cache = model.new_cache(PROMPT_TOKENS)
    steps = [model.forward(ids[:PREFIX_TOKENS], cache)] + [model.forward(ids[t:t + 1], cache)
                                                           for t in range(PREFIX_TOKENS, PROMPT_TOKENS)]
    assert_logits_match(np.concatenate(steps), expected, "through the KV cache")


def test_yarn_config_round_trips_and_extends_the_context(yarn_model):
    folder, *_ = yarn_model
    config = qwen_np.load_config(folder)
    assert qwen_np.Qwen3Config.from_dict({"model_type": "qwen3", **config.to_dict()}) == config
    assert config.max_position_embeddings == ORIGINAL_WINDOW
    assert model_context(config) == int(config.rope_scaling.factor * ORIGINAL_WINDOW) > PROMPT_TOKENS
