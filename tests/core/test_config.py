"""config.json in both styles, validation with clear messages, and the published presets."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import QWEN3_RANDOM, TINY_CONFIG
from qwen_np.core.config import MOE_FIELDS, active_parameter_count
from qwen_np.engine.budget import context_for, model_context
from qwen_np import PRESETS, Qwen3Config, QwenNPError, load_config, parameter_count, preset

QWEN3_8B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}


def test_original_qwen3_8b_config_reads_as_the_8b_preset():
    assert Qwen3Config.from_dict(QWEN3_8B_CONFIG) == PRESETS["qwen3-8b"]


def test_new_transformers_style_config_reads_the_same():
    new_style = {k: v for k, v in QWEN3_8B_CONFIG.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
    new_style.update(rope_parameters={"rope_type": "default", "rope_theta": 1000000}, dtype="bfloat16",
                     layer_types=["full_attention"] * 36)
    assert Qwen3Config.from_dict(new_style) == PRESETS["qwen3-8b"]


def test_head_dim_comes_from_config_not_hidden_over_heads():
    config = Qwen3Config.from_dict({**TINY_CONFIG, "hidden_size": 32, "num_attention_heads": 4, "head_dim": 24})
    assert config.head_dim == 24
    assert preset("qwen3-0.6b").head_dim == 128 != 1024 // 16


@pytest.mark.parametrize("change, message", [
    ({"model_type": "qwen2_moe"}, "model_type 'qwen2_moe' is not supported"),
    ({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 5},
     "num_experts_per_tok must be between 1 and num_experts (4), got 5"),
    ({"model_type": "qwen3_moe", "mlp_only_layers": [7]}, "mlp_only_layers holds 7, not a layer of"),
    ({"model_type": "qwen3_moe", "moe_intermediate_size": 0}, "moe_intermediate_size must be positive"),
    ({"model_type": "qwen3_moe", "use_qk_norm": False}, "are of dense Qwen3, not Qwen3-MoE"),
    ({"num_key_value_heads": 3}, "not divisible by num_key_value_heads (3)"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "rope scaling 'dynamic' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 0.5}}, "rope_scaling factor must be a finite number >= 1"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "low_freq_factor": 1}},
     "rope_scaling key 'low_freq_factor' is not a YaRN parameter"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 1, "beta_slow": 2}},
     "needs 0 < beta_slow <= beta_fast"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e6}}, "rope scaling 'linear' is not supported"),
    ({"use_sliding_window": True}, "use_sliding_window=true is not supported"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ({"attention_bias": True}, "attention_bias=true is not supported"),
    ({"hidden_size": 0}, "hidden_size must be positive"),
    ({"head_dim": 15}, "head_dim must be even"),
    ({"vocab_size": "lots"}, "bad value"),
    ({"rope_scaling": "linear"}, "rope_parameters / rope_scaling must be an object"),
    ({"layer_types": "full_attention"}, "layer_types must be a list"),
    ({"num_key_value_heads": 0}, "num_key_value_heads must be positive"),
    ({"head_dim": 0}, "head_dim must be positive"),
    ({"use_rope": "no"}, 'use_rope must be one of true, false, got "no"'),
    ({"use_qk_norm": 0}, "use_qk_norm must be one of true, false, got 0"),
    ({"norm_position": "sandwich"}, 'norm_position must be one of "pre", "post", got "sandwich"'),
    ({"use_residual": None}, "use_residual must be one of true, false, got null"),
    ({"mlp_type": "relu"}, 'mlp_type must be one of "swiglu", "gelu", got "relu"'),
])
def test_invalid_configs_are_refused_with_the_field_named(change, message):
    with pytest.raises(QwenNPError) as error:
        Qwen3Config.from_dict({**TINY_CONFIG, **change})
    assert message in str(error.value)


def test_qwens_documented_yarn_reads_in_both_spellings_and_reaches_131072_positions():
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    old = Qwen3Config.from_dict({**QWEN3_8B_CONFIG, "rope_scaling": yarn})
    new = Qwen3Config.from_dict({**QWEN3_8B_CONFIG, "rope_scaling": None,
                                 "rope_parameters": {**yarn, "rope_theta": 1000000}})
    assert old == new and old.rope_scaling is not None
    assert old.rope_scaling.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1)
    assert (old.max_position_embeddings, model_context(old)) == (40960, 131072)
    assert context_for(old, 131072, param="ctx_size") == 131072
    with pytest.raises(QwenNPError, match="between 1 and the model's context \\(131072 positions, YaRN"):
        context_for(old, 131073, param="ctx_size")
    assert context_for(PRESETS["qwen3-8b"], None, default=None) == 40960      # plain RoPE: its own window


# Qwen3-30B-A3B's config.json on the Hub.
QWEN3_30B_A3B_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
    "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_qwen3_30b_a3b_config_reads_as_its_preset_with_30_5b_parameters_3_3b_active():
    config = Qwen3Config.from_dict(QWEN3_30B_A3B_CONFIG)
    assert config == PRESETS["qwen3-30b-a3b"] and config.is_moe and all(map(config.sparse_layer, range(48)))
    assert (round(parameter_count(config) / 1e9, 1), round(active_parameter_count(config) / 1e9, 1)) == (30.5, 3.4)
    assert Qwen3Config.from_dict({"model_type": config.model_type, **config.to_dict()}) == config
    renamed = {("num_local_experts" if k == "num_experts" else k): v for k, v in QWEN3_30B_A3B_CONFIG.items()}
    assert Qwen3Config.from_dict(renamed) == config                 # as transformers >= 5 writes it


def test_a_dense_configs_dict_has_no_expert_fields():
    assert not set(MOE_FIELDS) & set(PRESETS["qwen3-8b"].to_dict())
    assert active_parameter_count(PRESETS["qwen3-8b"]) == parameter_count(PRESETS["qwen3-8b"])


def test_missing_required_field_is_named():
    config = dict(TINY_CONFIG)
    del config["hidden_size"]
    with pytest.raises(QwenNPError, match="missing required field 'hidden_size'"):
        Qwen3Config.from_dict(config)


def test_load_config_reads_a_bare_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B_CONFIG))
    assert load_config(tmp_path).num_hidden_layers == 36


@pytest.mark.parametrize("name, params", [("qwen3-0.6b", 596_049_920), ("qwen3-8b", 8_190_735_360)])
def test_preset_parameter_counts_match_published_figures(name, params):
    assert parameter_count(preset(name)) == params


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(QwenNPError, match="qwen3-8b"):
        preset("qwen3-7b")


def test_qwen3s_tokenizer_config_agrees_with_the_presets_eos():
    path = QWEN3_RANDOM / "tokenizer_config.json"           # Qwen3's official file (tests/files/test_tokenizer.py)
    tokenizer_config = json.loads(path.read_text())
    assert tokenizer_config["added_tokens_decoder"][str(PRESETS["qwen3-8b"].eos_token_id)]["content"] == "<|im_end|>"


@pytest.mark.slow
def test_fields_left_out_take_transformers_defaults():
    bare = {k: v for k, v in TINY_CONFIG.items() if k not in ("rope_theta", "max_position_embeddings", "rms_norm_eps")}
    config = Qwen3Config.from_dict(bare)
    assert (config.rope_theta, config.max_position_embeddings, config.rms_norm_eps) == (10000.0, 32768, 1e-6)
    transformers = pytest.importorskip("transformers")
    theirs = transformers.Qwen3Config(**{k: v for k, v in bare.items() if k != "architectures"})
    assert theirs.rope_parameters["rope_theta"] == config.rope_theta
    assert theirs.max_position_embeddings == config.max_position_embeddings


@pytest.mark.parametrize("text, message", [("[1, 2]", "expected a JSON object"), (b"\xff\xfe{", "not valid JSON")])
def test_config_json_that_is_not_an_object_or_not_utf8_is_reported(tmp_path, text, message):
    path = tmp_path / "config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(QwenNPError, match=message):
        load_config(tmp_path)
