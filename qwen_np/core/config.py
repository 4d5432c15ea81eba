"""Qwen3 hyper-parameters: a dataclass read from a checkpoint's config.json, named presets, and the
one table of the checkpoint's tensors (names and shapes).

Shape comments throughout qwen_np use one dimension vocabulary, defined once here in DIMENSIONS:
T tokens, S cached positions, D hidden size, H query heads, KVH key/value heads, Dh head_dim,
F MLP width, V vocabulary, L layers.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import QwenNPError

DIMENSIONS = {
    "T": "tokens in this forward call",
    "S": "positions attended to (cached + new; = T without a cache)",
    "D": "hidden_size: the width of the residual stream",
    "H": "num_attention_heads: query heads",
    "KVH": "num_key_value_heads: key/value heads",
    "Dh": "head_dim: the width of one head (read from config, not D/H)",
    "F": "intermediate_size: the MLP width",
    "V": "vocab_size: one logit per token id",
    "L": "num_hidden_layers: decoder layers",
    "E": "num_experts: the experts of a sparse (mixture-of-experts) layer",
    "K": "num_experts_per_tok: the experts a token runs through in a sparse layer",
    "Fe": "moe_intermediate_size: one expert's MLP width",
}
Shape = tuple[str, ...]   # a shape in those symbols, e.g. ("H*Dh", "D"); a bare integer string is a constant


# The ablations (walkthrough: "Ablations"): fields no released Qwen3 sets, each of which takes one piece of
# the architecture away so a learner can train without it and measure what it was for. Their defaults are
# Qwen3's, so a config.json without them is Qwen3 unchanged. transformers does not know them: a checkpoint
# that sets one loads in qwen_np only. MHA / GQA / MQA need no field of their own: num_key_value_heads.
ABLATION_CHOICES: dict[str, tuple[Any, ...]] = {
    "use_rope": (True, False),              # False: no rotary position embedding (only the causal mask orders tokens)
    "use_qk_norm": (True, False),           # False: no RMSNorm of each query and key head (no q_norm / k_norm weights)
    "norm_position": ("pre", "post"),       # "post": each block's norm after its residual sum (the 2017 Transformer)
    "use_residual": (True, False),          # False: each block's output replaces the stream instead of adding to it
    "mlp_type": ("swiglu", "gelu"),         # "gelu": down(gelu(up(x))), no gate_proj (GPT-2's MLP)
}

# The largest rms_norm_eps a config may hold: 100 times the largest of released models (1e-5; Qwen3: 1e-6).
MAX_RMS_NORM_EPS = 1e-3


@dataclass(frozen=True)
class Yarn:
    """YaRN's RoPE scaling (config.json's rope_scaling / rope_parameters with rope_type "yarn"): the context
    grows `factor` times past the `original_max_position_embeddings` positions the model was trained on.
    Slow frequencies are interpolated (divided by factor), fast ones kept, a linear ramp between the
    dimensions that turn beta_slow and beta_fast times over the original window (layers.yarn_inverse_frequencies);
    cos and sin are multiplied by attention_factor (0.1 ln(factor) + 1 unless given). As transformers'
    _compute_yarn_parameters."""

    factor: float
    original_max_position_embeddings: int
    attention_factor: float
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True           # the ramp's ends rounded outwards to whole dimensions (floor / ceil)


@dataclass(frozen=True)
class Qwen3Config:
    """The fields of config.json that change the forward pass (and a few that describe the model)."""

    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    rope_scaling: Yarn | None = None        # None: plain RoPE (every released Qwen3 as shipped)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 151643
    eos_token_id: int | list[int] | None = 151645
    torch_dtype: str = "bfloat16"
    # The ablations (ABLATION_CHOICES); Qwen3 by default.
    use_rope: bool = True
    use_qk_norm: bool = True
    norm_position: str = "pre"
    use_residual: bool = True
    mlp_type: str = "swiglu"
    # Qwen3-MoE (model_type "qwen3_moe"): a sparse layer's MLP is num_experts SwiGLUs of moe_intermediate_size,
    # num_experts_per_tok of them chosen per token by a router (layers.moe). Layer i is sparse unless it is in
    # mlp_only_layers or (i + 1) % decoder_sparse_step != 0 (sparse_layer). num_experts 0: dense Qwen3.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False              # the chosen experts' probabilities renormalised to sum 1
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001       # training's load-balancing loss weight (the forward ignores it)

    @property
    def is_moe(self) -> bool:
        """Whether this is a Qwen3-MoE (some layers sparse)."""
        return self.num_experts > 0

    @property
    def model_type(self) -> str:
        return "qwen3_moe" if self.is_moe else "qwen3"

    @property
    def architecture(self) -> str:
        """The transformers class config.json names (its "architectures")."""
        return "Qwen3MoeForCausalLM" if self.is_moe else "Qwen3ForCausalLM"

    def sparse_layer(self, i: int) -> bool:
        """Whether layer i's MLP is a mixture of experts, transformers' rule (Qwen3MoeDecoderLayer)."""
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def ablations(self) -> dict[str, Any]:
        """The ablation fields this config sets away from Qwen3 ({} for every released model)."""
        return {name: getattr(self, name) for name, choices in ABLATION_CHOICES.items() if getattr(self, name) != choices[0]}

    @property
    def group_size(self) -> int:
        """Query heads that share one key/value head (GQA): query head h reads KV head h // group_size."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def eos_token_ids(self) -> list[int]:
        """eos_token_id as a list (config.json may hold one id or several)."""
        return id_list(self.eos_token_id)

    def to_dict(self) -> dict[str, Any]:
        """The fields as config.json holds them; an ablation field only where it is set (a Qwen3's dict is Qwen3's)."""
        fields = {key: value for key, value in asdict(self).items() if key not in ABLATION_CHOICES or key in self.ablations}
        if self.is_moe:
            fields["mlp_only_layers"] = list(self.mlp_only_layers)
        else:                                                  # a dense Qwen3's dict is Qwen3's
            for key in MOE_FIELDS:
                del fields[key]
        if self.rope_scaling is None:
            del fields["rope_scaling"]
        else:                                                  # transformers' spelling: the type named in the object
            fields["rope_scaling"] = {"rope_type": "yarn", **fields["rope_scaling"]}
        return fields

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "Qwen3Config":
        """Validate a config.json dict, in either the original Qwen3 style or the newer transformers style."""
        _check_supported(raw, source)
        rope = _rope_parameters(raw, source)
        try:
            config = cls(
                vocab_size=int(raw["vocab_size"]),
                hidden_size=int(raw["hidden_size"]),
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=int(raw["num_attention_heads"]),
                num_key_value_heads=int(_given(raw, "num_key_value_heads", raw["num_attention_heads"])),
                # transformers' Qwen3Config defaults head_dim to 128 (not hidden/heads) when absent.
                head_dim=int(_given(raw, "head_dim", 128)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=_rope_theta(rope, raw),
                max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),   # transformers' default
                rope_scaling=yarn_parameters(rope, raw.get("max_position_embeddings", 32768)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_id=raw.get("eos_token_id"),
                # Old files write torch_dtype, transformers >= 4.56 writes dtype.
                torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"),
                **{name: raw.get(name, choices[0]) for name, choices in ABLATION_CHOICES.items()},
                **(_moe_fields(raw) if raw.get("model_type") == "qwen3_moe" else {}),
            )
        except KeyError as missing:
            raise QwenNPError(f"{source}: missing required field {missing}") from None
        except (TypeError, ValueError) as bad:
            raise QwenNPError(f"{source}: bad value ({bad})") from None
        config.validate(source)
        return config

    def validate(self, source: str = "config") -> None:
        """Reject shapes the network cannot run; every message names the field."""
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise QwenNPError(f"{source}: {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise QwenNPError(f"{source}: num_attention_heads ({self.num_attention_heads}) is not divisible "
                              f"by num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise QwenNPError(f"{source}: head_dim must be even for RoPE, got {self.head_dim}")
        if not (self.rms_norm_eps > 0 and self.rope_theta > 0):
            raise QwenNPError(f"{source}: rms_norm_eps and rope_theta must be positive")
        # eps only keeps RMSNorm from dividing by zero: one near the activations' mean square would replace the
        # normalization (1e30 makes every layer's output ~0). A RoPE base must be finite.
        if not self.rms_norm_eps <= MAX_RMS_NORM_EPS:
            raise QwenNPError(f"{source}: rms_norm_eps is {self.rms_norm_eps}; it must be at most {MAX_RMS_NORM_EPS}")
        if not math.isfinite(self.rope_theta):
            raise QwenNPError(f"{source}: rope_theta must be finite, got {self.rope_theta}")
        if self.rope_scaling is not None:
            yarn = self.rope_scaling
            if not (math.isfinite(yarn.factor) and yarn.factor >= 1):
                raise QwenNPError(f"{source}: rope_scaling factor must be a finite number >= 1, got {yarn.factor}")
            if yarn.original_max_position_embeddings <= 0:
                raise QwenNPError(f"{source}: rope_scaling original_max_position_embeddings must be positive, "
                                  f"got {yarn.original_max_position_embeddings}")
            if not (math.isfinite(yarn.attention_factor) and yarn.attention_factor > 0):
                raise QwenNPError(f"{source}: rope_scaling attention_factor must be positive, got {yarn.attention_factor}")
            if not (0 < yarn.beta_slow <= yarn.beta_fast and math.isfinite(yarn.beta_fast)):
                raise QwenNPError(f"{source}: rope_scaling needs 0 < beta_slow <= beta_fast, got beta_fast="
                                  f"{yarn.beta_fast}, beta_slow={yarn.beta_slow}")
        if self.is_moe:
            self._validate_moe(source)
        for name, choices in ABLATION_CHOICES.items():
            value = getattr(self, name)
            # type() as well: 1 == True in Python, and "use_rope": 1 in a JSON file is a mistake worth naming.
            if not any(type(value) is type(choice) and value == choice for choice in choices):
                raise QwenNPError(f"{source}: {name} must be one of {', '.join(json.dumps(c) for c in choices)}, "
                                  f"got {json.dumps(value)}")


    def _validate_moe(self, source: str) -> None:
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise QwenNPError(f"{source}: num_experts_per_tok must be between 1 and num_experts ({self.num_experts}), "
                              f"got {self.num_experts_per_tok}")
        for name in ("moe_intermediate_size", "decoder_sparse_step"):
            if getattr(self, name) <= 0:
                raise QwenNPError(f"{source}: {name} must be positive, got {getattr(self, name)}")
        outside = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if outside:
            raise QwenNPError(f"{source}: mlp_only_layers holds {outside[0]}, not a layer of {self.num_hidden_layers}")
        if self.ablations:
            raise QwenNPError(f"{source}: the ablations ({', '.join(self.ablations)}) are of dense Qwen3, not Qwen3-MoE")


MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
              "mlp_only_layers", "router_aux_loss_coef")


def _moe_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """A qwen3_moe config.json's expert fields, with transformers' defaults (Qwen3MoeConfig). num_experts is
    num_local_experts in files transformers >= 5 writes."""
    experts = _given(raw, "num_experts", _given(raw, "num_local_experts", 128))
    return {"num_experts": int(experts), "num_experts_per_tok": int(_given(raw, "num_experts_per_tok", 8)),
            "moe_intermediate_size": int(_given(raw, "moe_intermediate_size", 768)),
            "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
            "decoder_sparse_step": int(_given(raw, "decoder_sparse_step", 1)),
            "mlp_only_layers": tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
            "router_aux_loss_coef": float(_given(raw, "router_aux_loss_coef", 0.001))}


def id_list(ids: int | list[int] | None) -> list[int]:
    """A token id field of a config file (absent, one id, or a list of ids) as a list."""
    return [] if ids is None else [ids] if isinstance(ids, int) else list(ids)


def _given(raw: dict[str, Any], key: str, default: Any) -> Any:
    """raw[key], or the default when the key is absent or null (0 is a value, and validate() sees it)."""
    value = raw.get(key)
    return default if value is None else value


def _check_supported(raw: dict[str, Any], source: str) -> None:
    """Refuse what this implementation does not compute, rather than compute it wrongly."""
    model_type = raw.get("model_type")
    if model_type not in ("qwen3", "qwen3_moe"):
        raise QwenNPError(f"{source}: model_type {model_type!r} is not supported (only 'qwen3' and 'qwen3_moe'; "
                          "Qwen2 and others are different networks)")
    if raw.get("use_sliding_window"):
        raise QwenNPError(f"{source}: use_sliding_window=true is not supported (every released Qwen3 uses full attention)")
    layer_types = raw.get("layer_types") or []
    if not isinstance(layer_types, list):
        raise QwenNPError(f"{source}: layer_types must be a list, got {layer_types!r}")
    if any(kind != "full_attention" for kind in layer_types):
        raise QwenNPError(f"{source}: layer_types other than 'full_attention' are not supported")
    if raw.get("attention_bias"):
        raise QwenNPError(f"{source}: attention_bias=true is not supported (Qwen3 has no q/k/v/o bias)")
    if raw.get("hidden_act", "silu") != "silu":
        raise QwenNPError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported (Qwen3 uses silu)")


TRANSFORMERS_DEFAULT_ROPE_THETA = 10000.0


def _rope_parameters(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """The RoPE object, `rope_parameters` (transformers >= 5) or `rope_scaling` (Qwen3 as released; null there),
    with its type checked: plain RoPE or YaRN, any other scaling refused by name."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise QwenNPError(f"{source}: rope_parameters / rope_scaling must be an object or null, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise QwenNPError(f"{source}: rope scaling {rope_type!r} is not supported (only default RoPE and 'yarn'; "
                          "remove rope_scaling to run at the native context length)")
    unknown = sorted(set(params) - YARN_KEYS) if rope_type == "yarn" else []
    if unknown:              # mscale and mscale_all_dim only change the default attention factor: read below
        raise QwenNPError(f"{source}: rope_scaling key {unknown[0]!r} is not a YaRN parameter qwen_np knows")
    return params


def _rope_theta(params: dict[str, Any], raw: dict[str, Any]) -> float:
    """RoPE base from `rope_theta` (Qwen3 as released) or `rope_parameters` (transformers >= 5)."""
    theta = params.get("rope_theta", raw.get("rope_theta"))
    # Absent everywhere, transformers falls back to its standard RoPE base 10000 (not Qwen3's 1e6).
    return float(TRANSFORMERS_DEFAULT_ROPE_THETA if theta is None else theta)


YARN_KEYS = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "attention_factor",
             "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"}


def yarn_parameters(params: dict[str, Any], max_position_embeddings: int) -> Yarn | None:
    """YaRN's parameters as transformers' _compute_yarn_parameters resolves them (None for plain RoPE): the
    original window defaults to max_position_embeddings, a missing factor to the ratio of the two; the
    attention factor, unless given, is 0.1 ln(factor) + 1 (or the ratio of two such terms when mscale and
    mscale_all_dim are both set); beta_fast / beta_slow default to 32 / 1 (also when 0 or null, as there)."""
    if params.get("rope_type", params.get("type")) != "yarn":
        return None
    original = int(params.get("original_max_position_embeddings") or max_position_embeddings)
    factor = params.get("factor")
    factor = float(max_position_embeddings / original if factor is None else factor)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
                            if mscale and mscale_all_dim else yarn_mscale(factor))
    return Yarn(factor=factor, original_max_position_embeddings=original, attention_factor=float(attention_factor),
                beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                truncate=bool(params.get("truncate", True)))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term: 0.1 mscale ln(factor) + 1 (1 for no scaling)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file that must hold an object (config.json, generation_config.json, tokenizer_config.json)."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise QwenNPError(f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as bad:     # RecursionError: [[[[...
        raise QwenNPError(f"{path}: not valid JSON ({bad})") from None
    if not isinstance(raw, dict):
        raise QwenNPError(f"{path}: expected a JSON object")
    return raw


def load_config(folder: str | Path) -> Qwen3Config:
    """Read and validate `folder/config.json` (loading.read_config also reads a GGUF file's)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise QwenNPError(f"{path}: config.json not found (is this a Hugging Face checkpoint folder?)")
    return Qwen3Config.from_dict(read_json_object(path), source=str(path))


# Published shapes of the Qwen3 family (the model cards' config.json files), so shapes, parameter counts and memory can be
# computed with no weights at all.
PRESETS: dict[str, Qwen3Config] = {
    "qwen3-0.6b": Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                              num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-1.7b": Qwen3Config(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                              num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-4b": Qwen3Config(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                            num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-8b": Qwen3Config(),
    "qwen3-14b": Qwen3Config(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                             num_attention_heads=40, num_key_value_heads=8),
    "qwen3-32b": Qwen3Config(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                             num_attention_heads=64, num_key_value_heads=8),
    # Qwen3-MoE: 128 experts of 768, 8 a token (intermediate_size is what a dense layer among them would have).
    "qwen3-30b-a3b": Qwen3Config(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                                 num_attention_heads=32, num_key_value_heads=4, num_experts=128,
                                 num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
}


def preset(name: str) -> Qwen3Config:
    """A named preset ('qwen3-8b', ...); the error lists the known names."""
    key = name.lower()
    if key not in PRESETS:
        raise QwenNPError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}", "preset")
    return PRESETS[key]


# --- The checkpoint's tensors ---------------------------------------------------------------------

@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: its Hugging Face name ("{i}" stands for the layer index) and its shape."""

    name: str
    shape: Shape


# Every tensor of one decoder layer, keyed by the attribute name model.LayerWeights gives it. Linear
# weights are [out, in], as nn.Linear stores them. load_model lays a layer's matrices out in memory
# in this order, so q|k|v and gate|up lie back to back (the fast path multiplies each as one matrix).
LAYER_TENSORS: dict[str, TensorSpec] = {
    "input_layernorm": TensorSpec("model.layers.{i}.input_layernorm.weight", ("D",)),
    "q_proj": TensorSpec("model.layers.{i}.self_attn.q_proj.weight", ("H*Dh", "D")),
    "k_proj": TensorSpec("model.layers.{i}.self_attn.k_proj.weight", ("KVH*Dh", "D")),
    "v_proj": TensorSpec("model.layers.{i}.self_attn.v_proj.weight", ("KVH*Dh", "D")),
    "q_norm": TensorSpec("model.layers.{i}.self_attn.q_norm.weight", ("Dh",)),   # one weight shared by every head
    "k_norm": TensorSpec("model.layers.{i}.self_attn.k_norm.weight", ("Dh",)),
    "o_proj": TensorSpec("model.layers.{i}.self_attn.o_proj.weight", ("D", "H*Dh")),
    "post_attention_layernorm": TensorSpec("model.layers.{i}.post_attention_layernorm.weight", ("D",)),
    "gate_proj": TensorSpec("model.layers.{i}.mlp.gate_proj.weight", ("F", "D")),
    "up_proj": TensorSpec("model.layers.{i}.mlp.up_proj.weight", ("F", "D")),
    "down_proj": TensorSpec("model.layers.{i}.mlp.down_proj.weight", ("D", "F")),
}
# A sparse layer's MLP (Qwen3-MoE) in the place of gate_proj, up_proj and down_proj: the router, and each
# expert's SwiGLU, stored one tensor per expert as released ("{e}": the expert's index).
ROUTER = TensorSpec("model.layers.{i}.mlp.gate.weight", ("E", "D"))
EXPERT_TENSORS: dict[str, TensorSpec] = {
    key: TensorSpec(f"model.layers.{{i}}.mlp.experts.{{e}}.{key}.weight", shape)
    for key, shape in (("gate_proj", ("Fe", "D")), ("up_proj", ("Fe", "D")), ("down_proj", ("D", "Fe")))}
DENSE_MLP = ("gate_proj", "up_proj", "down_proj")
# The tensors outside the layers, keyed by the Qwen3Model attribute that holds them. A checkpoint
# with tie_word_embeddings has no lm_head: the LM head is the embedding table itself.
MODEL_TENSORS: dict[str, TensorSpec] = {
    "embed_tokens": TensorSpec("model.embed_tokens.weight", ("V", "D")),
    "norm": TensorSpec("model.norm.weight", ("D",)),
    "lm_head": TensorSpec("lm_head.weight", ("V", "D")),
}

# Derived from the two tables, each named once: the 2-D weights of a layer, in memory order (q, k, v,
# o, gate, up, down: also the target_modules names peft gives them), and the full names of the tensors
# outside the layers.
LAYER_MATRICES: tuple[str, ...] = tuple(key for key, spec in LAYER_TENSORS.items() if len(spec.shape) == 2)
LAYER_TENSOR_NAMES: dict[str, str] = {key: spec.name for key, spec in LAYER_TENSORS.items()}   # key -> "{i}" template
EMBED_TOKENS = MODEL_TENSORS["embed_tokens"].name
FINAL_NORM = MODEL_TENSORS["norm"].name
LM_HEAD = MODEL_TENSORS["lm_head"].name
_MATRIX_NAMES = re.compile("|".join(
    re.escape(spec.name).replace(re.escape("{i}"), r"\d+").replace(re.escape("{e}"), r"\d+")
    for spec in [*LAYER_TENSORS.values(), *MODEL_TENSORS.values(), ROUTER, *EXPERT_TENSORS.values()]
    if len(spec.shape) == 2))


def layer_tensors(config: Qwen3Config, i: int) -> dict[str, TensorSpec]:
    """Layer i's tensors: LAYER_TENSORS less the ones an ablation removes (q_norm and k_norm without QK-norm,
    gate_proj in a GELU MLP); a sparse layer's MLP (config.sparse_layer) is "router" and each expert's
    "experts.{e}.gate_proj", ... (their names' "{e}" filled in, "{i}" left) in the dense MLP's place."""
    removed = {"q_norm", "k_norm"} if not config.use_qk_norm else set()
    removed |= {"gate_proj"} if config.mlp_type == "gelu" else set()
    if not config.sparse_layer(i):
        return {key: spec for key, spec in LAYER_TENSORS.items() if key not in removed}
    specs = {key: spec for key, spec in LAYER_TENSORS.items() if key not in removed | set(DENSE_MLP)}
    specs["router"] = ROUTER
    specs.update({f"experts.{e}.{key}": TensorSpec(spec.name.replace("{e}", str(e)), spec.shape)
                  for e in range(config.num_experts) for key, spec in EXPERT_TENSORS.items()})
    return specs


def is_matrix(name: str) -> bool:
    """Whether a checkpoint tensor name is a 2-D weight: a layer's projection, the embedding or the LM head."""
    return _MATRIX_NAMES.fullmatch(name) is not None


def dimensions(config: Qwen3Config, tokens: int = 1, positions: int | None = None) -> dict[str, int]:
    """The value of every symbol for `tokens` new tokens attending to `positions` (default: tokens)."""
    return {"T": tokens, "S": tokens if positions is None else positions, "D": config.hidden_size,
            "H": config.num_attention_heads, "KVH": config.num_key_value_heads, "Dh": config.head_dim,
            "F": config.intermediate_size, "V": config.vocab_size, "L": config.num_hidden_layers,
            "E": config.num_experts, "K": config.num_experts_per_tok, "Fe": config.moe_intermediate_size}


def evaluate(expression: str, dims: dict[str, int]) -> int:
    """The value of a product of symbols and integers, e.g. "2*T*H*Dh" -> 2 * T * H * Dh."""
    return math.prod(int(f) if f.isdigit() else dims[f] for f in expression.split("*"))


def resolve(shape: Shape, dims: dict[str, int]) -> list[int]:
    """A symbolic shape in numbers: ("H*Dh", "D") -> [H * Dh, D]."""
    return [evaluate(axis, dims) for axis in shape]


def expected_tensors(config: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """Every tensor name the config implies, with its shape, in model order: the embedding, layer by
    layer, the final norm, then lm_head (absent when it is tied)."""
    dims = dimensions(config)
    specs = [MODEL_TENSORS["embed_tokens"]]
    specs += [TensorSpec(spec.name.format(i=i), spec.shape)
              for i in range(config.num_hidden_layers) for spec in layer_tensors(config, i).values()]
    specs += [MODEL_TENSORS["norm"]] + ([] if config.tie_word_embeddings else [MODEL_TENSORS["lm_head"]])
    return {spec.name: tuple(resolve(spec.shape, dims)) for spec in specs}


def tensor_shapes(config: Qwen3Config) -> list[tuple[tuple[int, ...], int]]:
    """(shape, how many tensors have it) for the tensors of MODEL_TENSORS and the layers' (a sparse layer's
    experts counted together): what counting needs, without a name per layer (a config is counted before its
    layers are checked against a header)."""
    dims = dimensions(config)
    own = [MODEL_TENSORS["embed_tokens"], MODEL_TENSORS["norm"]] + ([] if config.tie_word_embeddings
                                                                     else [MODEL_TENSORS["lm_head"]])
    layer_shapes: Counter[tuple[int, ...]] = Counter(
        tuple(resolve(spec.shape, dims)) for i in range(config.num_hidden_layers)
        for key, spec in layer_tensors(config, i).items() if not key.startswith("experts."))
    sparse = sum(config.sparse_layer(i) for i in range(config.num_hidden_layers))
    experts = [(tuple(resolve(spec.shape, dims)), sparse * config.num_experts) for spec in EXPERT_TENSORS.values()]
    return ([(tuple(resolve(spec.shape, dims)), 1) for spec in own] + list(layer_shapes.items())
            + [entry for entry in experts if entry[1]])


def parameter_count(config: Qwen3Config) -> int:
    """Parameters in the checkpoint (the LM head counted only when it is not tied to the embedding)."""
    return sum(math.prod(shape) * count for shape, count in tensor_shapes(config))


def active_parameter_count(config: Qwen3Config) -> int:
    """Parameters one token computes with: all of them but, in each sparse layer, the experts it is not routed
    to (num_experts - num_experts_per_tok of them). A dense Qwen3's: parameter_count."""
    sparse = sum(config.sparse_layer(i) for i in range(config.num_hidden_layers))
    expert = sum(math.prod(resolve(spec.shape, dimensions(config))) for spec in EXPERT_TENSORS.values())
    return parameter_count(config) - sparse * (config.num_experts - config.num_experts_per_tok) * expert
