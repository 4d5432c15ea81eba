"""A model's trained arrays: fresh ones as transformers initialises Qwen3 (init_parameters), the model whose
weights they are (model_from_parameters: updating them in place trains it), and the config.json a run
writes beside them (hf_config)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..core.ablations import model_class
from ..core.config import Qwen3Config, expected_tensors, layer_tensors
from ..core.model import Qwen3Model, layer_weights
from .data import END_OF_TEXT_ID


def init_parameters(config: Qwen3Config, seed: int) -> dict[str, np.ndarray]:
    """Fresh weights as transformers initialises Qwen3: matrices N(0, 0.02), RMSNorm weights 1."""
    rng = np.random.default_rng(seed)
    params = {}
    for name, shape in expected_tensors(config).items():
        if len(shape) == 1:
            params[name] = np.ones(shape, dtype=np.float32)
        else:
            params[name] = (0.02 * rng.standard_normal(shape)).astype(np.float32)
    return params


def model_from_parameters(config: Qwen3Config, params: dict[str, np.ndarray]) -> Qwen3Model:
    """A Qwen3Model whose weights ARE these arrays (no copies): updating them in place trains it."""
    layers = [layer_weights({key: params[spec.name.format(i=i)] for key, spec in layer_tensors(config, i).items()})
              for i in range(config.num_hidden_layers)]
    embed = params["model.embed_tokens.weight"]
    head = embed if config.tie_word_embeddings else params["lm_head.weight"]
    return model_class(config)(config, embed, layers, params["model.norm.weight"], head)


def hf_config(model_config: dict[str, Any]) -> dict[str, Any]:
    """A complete config.json that transformers and qwen_np both load (a Qwen3-MoE's, model_type "qwen3_moe", names
    its own class)."""
    moe = model_config.get("model_type") == "qwen3_moe"
    return {"architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"], "model_type": "qwen3",
            "attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu", "initializer_range": 0.02,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1_000_000.0, "rope_scaling": None, "use_sliding_window": False, "sliding_window": None,
            "bos_token_id": END_OF_TEXT_ID, "eos_token_id": END_OF_TEXT_ID, "torch_dtype": "bfloat16",
            "use_cache": True, **model_config}
