"""Randomised, BF16-exact transformers Qwen3 models used as the FP32 ground truth.

Every model built here

* runs the eager attention path in FP32 (spec §1.6: SDPA orders the arithmetic
  differently, so it is not the reference formula);
* has ALL weights random, the RMSNorm weights included: their init value of 1 would hide
  q_norm/k_norm placement bugs and input/post-attention norm mix-ups;
* holds weights that are exactly representable in BF16, so the FP32 reference and the
  BF16 checkpoint written from the same model describe the very same function.

Needs the `reference` extra (torch + transformers).
"""

import os
from pathlib import Path

# Hub kernels could replace RMSNorm/RoPE with other code (spec §1.4). The variable is
# read when transformers is imported, so it must be set before the import below.
os.environ.setdefault("USE_HUB_KERNELS", "NO")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import PreTrainedModel, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402
from transformers.integrations import hub_kernels  # noqa: E402

# Norm weights are drawn as 1 + NORM_WEIGHT_SPREAD * N(0, 1): far enough from 1 that a
# misplaced or missing norm changes the logits visibly.
NORM_WEIGHT_SPREAD = 0.5


def make_config(
    *,
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    head_dim: int,
    tie_word_embeddings: bool,
    rope_theta: float = 1e6,
    rms_norm_eps: float = 1e-6,
    rope_scaling: dict | None = None,
    max_position_embeddings: int = 40960,
) -> Qwen3Config:
    """Return a Qwen3 config for the eager FP32 reference path.

    `rope_theta` is always passed explicitly because Qwen3Config's default (1e4) is not the
    released models' value (1e6). `rope_scaling`: more RoPE parameters (YaRN's). Other fields
    follow Qwen3-8B (spec §2.1); bos/eos are placed inside the small vocabularies so the saved configs stay self-consistent.
    """
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta, **(rope_scaling or {})},
        rms_norm_eps=rms_norm_eps,
        max_position_embeddings=max_position_embeddings,
        max_window_layers=num_hidden_layers,
        bos_token_id=vocab_size - 2,
        eos_token_id=vocab_size - 1,
        attn_implementation="eager",
    )


def make_moe_config(*, num_experts: int, num_experts_per_tok: int, moe_intermediate_size: int, norm_topk_prob: bool,
                    decoder_sparse_step: int = 1, mlp_only_layers: list[int] | None = None, **dense) -> Qwen3MoeConfig:
    """make_config's model as a Qwen3-MoE (Qwen3MoeConfig): its layers sparse by transformers' rule."""
    fields = make_config(**dense).to_dict()
    for key in ("model_type", "architectures", "transformers_version", "max_window_layers", "layer_types", "dtype",
                "use_sliding_window", "sliding_window"):
        fields.pop(key, None)
    return Qwen3MoeConfig(**fields, num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
                          moe_intermediate_size=moe_intermediate_size, norm_topk_prob=norm_topk_prob,
                          decoder_sparse_step=decoder_sparse_step, mlp_only_layers=mlp_only_layers,
                          attn_implementation="eager")


def build_reference_model(config: Qwen3Config | Qwen3MoeConfig, seed: int) -> PreTrainedModel:
    """Build an FP32 eager Qwen3ForCausalLM (Qwen3MoeForCausalLM for a Qwen3MoeConfig) with random BF16-exact
    weights, the router's included.

    Deterministic in `seed`: parameters are filled in `named_parameters` order from one
    seeded generator (a tied lm_head is the embedding and is filled once).
    """
    _assert_no_hub_kernels()
    kind = Qwen3MoeForCausalLM if isinstance(config, Qwen3MoeConfig) else Qwen3ForCausalLM
    model = kind(config).to(torch.float32).eval()
    assert model.config._attn_implementation == "eager"
    if config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            _fill_random_(parameter, name, generator)
            parameter.copy_(parameter.to(torch.bfloat16))
    return model


def reference_logits(model: Qwen3ForCausalLM, input_ids: np.ndarray) -> np.ndarray:
    """Return FP32 logits [T, vocab] for every position of one sequence, without a cache."""
    with torch.inference_mode():
        output = model(input_ids=torch.from_numpy(input_ids)[None], use_cache=False)
    return output.logits[0].numpy().astype(np.float32, copy=True)


def rope_inv_freq(model: Qwen3ForCausalLM) -> np.ndarray:
    """Return the FP32 RoPE inverse frequencies [head_dim / 2] transformers uses (spec §1.10)."""
    return model.model.rotary_emb.inv_freq.numpy().astype(np.float32, copy=True)


def save_bf16_checkpoint(
    model: Qwen3ForCausalLM, directory: Path, max_shard_size: int | str = "50GB"
) -> None:
    """Write `model` as a BF16 safetensors checkpoint exactly as `save_pretrained` does.

    The model is converted to BF16 in place (halving its memory); since its weights are
    BF16-exact, nothing is rounded. A smaller `max_shard_size` produces several shard files
    plus `model.safetensors.index.json`.
    """
    model.to(torch.bfloat16).save_pretrained(directory, max_shard_size=max_shard_size)


def random_token_ids(vocab_size: int, length: int, seed: int) -> np.ndarray:
    """Return deterministic random token ids (int64 [length]) drawn uniformly over the vocab."""
    return np.random.default_rng(seed).integers(0, vocab_size, size=length, dtype=np.int64)


def _fill_random_(parameter: torch.Tensor, name: str, generator: torch.Generator) -> None:
    """Overwrite one parameter in place with random values of a realistic scale.

    Matrices get std 1/sqrt(fan_in) (shape[-1] for Linear [out, in], Embedding [vocab, hidden]
    and the experts' stacked [E, out, in]) so activations and logits stay of order one at any width; RMSNorm
    vectors get 1 + NORM_WEIGHT_SPREAD * N(0, 1).
    """
    parameter.normal_(generator=generator)
    if parameter.ndim == 1:
        assert name.endswith("norm.weight"), f"unexpected vector parameter {name}"
        parameter.mul_(NORM_WEIGHT_SPREAD).add_(1.0)
    else:
        parameter.mul_(parameter.shape[-1] ** -0.5)


def _assert_no_hub_kernels() -> None:
    """Fail if transformers may swap in hub kernels (e.g. imported before our env default)."""
    assert not hub_kernels._kernels_enabled, (
        "transformers hub kernels are enabled; set USE_HUB_KERNELS=NO for reference runs"
    )
