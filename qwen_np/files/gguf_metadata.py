"""What a GGUF's metadata says of its model: the Qwen3Config (read_config, checked against the tensors the
file holds), the sampling defaults (read_sampling), and the llama.cpp name of each Hugging Face tensor name
(gguf_tensor_name).

* Metadata is key/value pairs: `general.architecture` ("qwen3"), the shape under `qwen3.*`, the
  tokenizer under `tokenizer.ggml.*` and `tokenizer.chat_template`. The vocabulary size is the length
  of the token list; the LM head is tied when there is no `output.weight` tensor (llama.cpp then
  uses `token_embd.weight` for both, as transformers does with tie_word_embeddings).
* Tensor names are llama.cpp's (`blk.N.attn_q.weight`), mapped to the Hugging Face names of
  config.LAYER_TENSORS / MODEL_TENSORS by gguf's own TensorNameMap for the QWEN3 architecture.
* A Qwen3-MoE is `general.architecture` "qwen3moe" (keys under `qwen3moe.*`, expert_count, expert_used_count,
  expert_feed_forward_length); its router is `blk.N.ffn_gate_inp.weight` and its experts are stacked, one 3-D
  tensor per projection (`blk.N.ffn_gate_exps.weight`, [E, Fe, D] in NumPy order, as llama.cpp's converter
  stacks them): expert e of it is the checkpoint's `model.layers.N.mlp.experts.e.gate_proj.weight`
  (expert_slice). llama.cpp runs every qwen3moe layer sparse and renormalises the chosen experts' weights.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
from gguf import Keys

from ..core.config import LAYER_TENSORS, MODEL_TENSORS, Qwen3Config, Yarn, yarn_parameters
from ..errors import QwenNPError
from .gguf_reader import metadata_value, CheckedReader, tensors_by_name, open_reader

ARCHITECTURE = "qwen3"
MOE_ARCHITECTURE = "qwen3moe"
# llama.cpp also ends generation at these tokens whatever eos_token_id says (llama-vocab.cpp finds its
# end-of-generation set by token text); Qwen3's generation_config.json lists both too.
END_OF_GENERATION = ("<|im_end|>", "<|endoftext|>")


def _arch(name: str, arch: str = ARCHITECTURE) -> str:
    return name.format(arch=arch)


# Every qwen3.* key qwen_np knows: those read_config reads, and two it checks against them (vocab_size, the
# token list's length; rope.dimension_count, head_dim: Qwen3 rotates whole heads). Any other key of the
# architecture could change the network (RoPE scaling factors, a sliding window, ...), and a misspelt one
# would leave its setting at a default: a file with one is refused rather than run without it.
# YaRN's keys (_yarn): a file with type "yarn" needs the first two.
YARN_KEYS = (Keys.Rope.SCALING_FACTOR, Keys.Rope.SCALING_ORIG_CTX_LEN, Keys.Rope.SCALING_YARN_BETA_FAST,
             Keys.Rope.SCALING_YARN_BETA_SLOW)
DENSE_KEYS = (
    Keys.LLM.BLOCK_COUNT, Keys.LLM.CONTEXT_LENGTH, Keys.LLM.EMBEDDING_LENGTH, Keys.LLM.FEED_FORWARD_LENGTH,
    Keys.LLM.VOCAB_SIZE, Keys.Attention.HEAD_COUNT, Keys.Attention.HEAD_COUNT_KV, Keys.Attention.KEY_LENGTH,
    Keys.Attention.VALUE_LENGTH, Keys.Attention.LAYERNORM_RMS_EPS, Keys.Rope.FREQ_BASE, Keys.Rope.DIMENSION_COUNT,
    Keys.Rope.SCALING_TYPE, *YARN_KEYS)
EXPERT_KEYS = (Keys.LLM.EXPERT_COUNT, Keys.LLM.EXPERT_USED_COUNT, Keys.LLM.EXPERT_FEED_FORWARD_LENGTH,
               Keys.LLM.EXPERT_WEIGHTS_NORM)
ARCH_KEYS = frozenset(_arch(key) for key in DENSE_KEYS)
MOE_ARCH_KEYS = frozenset(_arch(key, MOE_ARCHITECTURE) for key in (*DENSE_KEYS, *EXPERT_KEYS))
LAYER_INDEX = re.compile(r"blk\.(\d+)\.")        # the N of a llama.cpp layer tensor name (blk.N.attn_q.weight)


def read_config(path: str | Path) -> Qwen3Config:
    """The Qwen3Config a GGUF's metadata describes (llama.cpp's convert_hf_to_gguf.py wrote it from config.json),
    checked against the tensors the file holds."""
    reader = open_reader(path)
    source = str(reader.path)
    arch = metadata_value(reader, Keys.General.ARCHITECTURE, str)
    if arch not in (ARCHITECTURE, MOE_ARCHITECTURE):
        raise QwenNPError(f"{source}: general.architecture is {arch!r}; qwen_np runs {ARCHITECTURE!r} and "
                          f"{MOE_ARCHITECTURE!r} models (Qwen2, Llama and others are different networks)")
    known = MOE_ARCH_KEYS if arch == MOE_ARCHITECTURE else ARCH_KEYS
    unknown = sorted(key for key in reader.fields if key.startswith(f"{arch}.") and key not in known)
    if unknown:
        raise QwenNPError(f"{source}: metadata key {unknown[0]!r} is not a {arch} setting qwen_np knows "
                          "(it may change the network, so the file is refused rather than run without it)")

    def arch_key(name: str) -> str:                  # this file's architecture's key
        return name.format(arch=arch)

    heads = metadata_value(reader, arch_key(Keys.Attention.HEAD_COUNT), int)
    hidden = metadata_value(reader, arch_key(Keys.LLM.EMBEDDING_LENGTH), int)
    head_dim = metadata_value(reader, arch_key(Keys.Attention.KEY_LENGTH), int, hidden // max(heads, 1))   # llama.cpp's default
    tokens = metadata_value(reader, Keys.Tokenizer.LIST, list)
    eos = _end_of_generation(reader, tokens)
    for key, value in ((Keys.Attention.VALUE_LENGTH, head_dim), (Keys.Rope.DIMENSION_COUNT, head_dim),
                       (Keys.LLM.VOCAB_SIZE, len(tokens))):
        if (given := metadata_value(reader, arch_key(key), int, value)) != value:
            raise QwenNPError(f"{source}: {arch_key(key)} is {given}, not {value} "
                              "(Qwen3 has one head_dim for keys, values and RoPE, and a logit per token of the list)")
    config = Qwen3Config(
        vocab_size=len(tokens),
        hidden_size=hidden,
        intermediate_size=metadata_value(reader, arch_key(Keys.LLM.FEED_FORWARD_LENGTH), int),
        num_hidden_layers=_layer_count(reader, arch),
        num_attention_heads=heads,
        num_key_value_heads=metadata_value(reader, arch_key(Keys.Attention.HEAD_COUNT_KV), int, heads),
        head_dim=head_dim,
        rms_norm_eps=_f32_decimal(metadata_value(reader, arch_key(Keys.Attention.LAYERNORM_RMS_EPS), (int, float))),
        rope_theta=_f32_decimal(metadata_value(reader, arch_key(Keys.Rope.FREQ_BASE), (int, float),
                                               10000.0)),  # llama.cpp's default
        max_position_embeddings=(context := metadata_value(reader, arch_key(Keys.LLM.CONTEXT_LENGTH), int)),
        rope_scaling=_yarn(reader, arch_key, context),
        tie_word_embeddings=gguf_tensor_name(MODEL_TENSORS["lm_head"].name) not in tensors_by_name(reader),
        bos_token_id=token_id_of(reader, Keys.Tokenizer.BOS_ID, tokens),
        eos_token_id=eos[0] if len(eos) == 1 else eos or None,
        torch_dtype="float32",     # what a GGUF's weights compute in here, whatever they are stored as
        **(_experts(reader, arch_key) if arch == MOE_ARCHITECTURE else {}),
    )
    config.validate(source)
    return config


def _yarn(reader: CheckedReader, key: Callable[[str], str], context: int) -> Yarn | None:
    """A file's YaRN RoPE scaling (rope.scaling.type "yarn", as convert_hf_to_gguf.py writes Qwen's documented
    rope_scaling: factor and original_context_length, the betas where given), resolved with config.json's defaults
    (config.yarn_parameters: the attention factor 0.1 ln(factor) + 1, as llama.cpp's rope computes it from the
    factor). A file with an attention factor of its own is refused by the unknown-key rule: llama.cpp multiplies
    its yarn_attn_factor into that term, where transformers' attention_factor replaces it."""
    scaling = metadata_value(reader, key(Keys.Rope.SCALING_TYPE), str, "none")
    given = {name: metadata_value(reader, key(name), (int, float), None) for name in YARN_KEYS}
    if scaling == "none":
        if extra := [key(name) for name, value in given.items() if value is not None]:
            raise QwenNPError(f"{reader.path}: {extra[0]} is set but {key(Keys.Rope.SCALING_TYPE)} is not 'yarn'")
        return None
    if scaling != "yarn":
        raise QwenNPError(f"{reader.path}: {key(Keys.Rope.SCALING_TYPE)} is {scaling!r}; only default RoPE and 'yarn' "
                          "are supported")
    for required in (Keys.Rope.SCALING_FACTOR, Keys.Rope.SCALING_ORIG_CTX_LEN):
        if given[required] is None:
            raise QwenNPError(f"{reader.path}: YaRN scaling needs {key(required)}")
    return yarn_parameters({"rope_type": "yarn", "factor": _f32_decimal(given[Keys.Rope.SCALING_FACTOR]),
                            "original_max_position_embeddings": int(given[Keys.Rope.SCALING_ORIG_CTX_LEN]),
                            "beta_fast": given[Keys.Rope.SCALING_YARN_BETA_FAST],
                            "beta_slow": given[Keys.Rope.SCALING_YARN_BETA_SLOW]}, context)


def _experts(reader: CheckedReader, key: Callable[[str], str]) -> dict[str, Any]:
    """A qwen3moe file's expert fields: llama.cpp's qwen3moe graph runs every layer sparse and renormalises the
    chosen experts' weights (build_moe_ffn with norm_w), unless expert_weights_norm says otherwise."""
    return {"num_experts": metadata_value(reader, key(Keys.LLM.EXPERT_COUNT), int),
            "num_experts_per_tok": metadata_value(reader, key(Keys.LLM.EXPERT_USED_COUNT), int),
            "moe_intermediate_size": metadata_value(reader, key(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH), int),
            "norm_topk_prob": metadata_value(reader, key(Keys.LLM.EXPERT_WEIGHTS_NORM), bool, True)}


def _layer_count(reader: CheckedReader, arch: str) -> int:
    """block_count, which must be the number of layers the tensors hold (checked before anything lists a
    layer's tensors: a block_count of 2^32 would have 11 x 2^32 names listed; one below the file's layers
    would run the model without its last layers)."""
    key = _arch(Keys.LLM.BLOCK_COUNT, arch)
    declared = metadata_value(reader, key, int)
    held = 1 + max((int(match[1]) for tensor in reader.tensors if (match := LAYER_INDEX.match(tensor.name))), default=-1)
    if declared > held:
        missing = gguf_tensor_name(LAYER_TENSORS["input_layernorm"].name.format(i=held), held + 1)
        raise QwenNPError(f"{reader.path}: {key} is {declared} but the file's tensors hold {held} layers "
                          f"(tensor {missing!r} is missing)")
    if declared < held:
        extra = [tensor.name for tensor in reader.tensors
                 if (match := LAYER_INDEX.match(tensor.name)) and int(match[1]) >= max(declared, 0)]
        raise QwenNPError(f"{reader.path}: {key} is {declared} but the file holds tensors of {held} layers "
                          f"({len(extra)} tensors the metadata does not account for, from {extra[0]!r})")
    return declared


def token_id_of(reader: CheckedReader, key: str, tokens: list[str]) -> int | None:
    """A token id key (absent: None), which must index the token list."""
    token_id = metadata_value(reader, key, int, None)
    if token_id is not None and not 0 <= token_id < len(tokens):
        raise QwenNPError(f"{reader.path}: {key} {token_id} is not a token id (the vocabulary has {len(tokens)})")
    return token_id


def _f32_decimal(value: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it: GGUF stores eps, freq_base and
    the sampling settings as f32, so config.json's 1e-6 comes back as 9.999999974752427e-07 (the same
    float32, which is what the forward pass adds) and top_p 0.95 as 0.949999988; this gives 1e-06 and 0.95."""
    with np.errstate(over="ignore"):            # a float64 value past float32's range becomes inf (config refuses it)
        return float(str(np.float32(value)))


def _end_of_generation(reader: CheckedReader, tokens: list[str]) -> list[int]:
    """eos_token_id (and an EOT id, if any), then the END_OF_GENERATION tokens the vocabulary has."""
    ids = [token_id_of(reader, key, tokens) for key in (Keys.Tokenizer.EOS_ID, Keys.Tokenizer.EOT_ID)]
    by_text = {token: i for i, token in enumerate(tokens) if token in END_OF_GENERATION}
    return list(dict.fromkeys([i for i in ids if i is not None] + [by_text[t] for t in END_OF_GENERATION if t in by_text]))


@functools.lru_cache(maxsize=2)
def _name_map(layers: int, arch: gguf.MODEL_ARCH) -> gguf.TensorNameMap:
    return gguf.get_tensor_name_map(arch, layers)


EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+\.weight)")


def expert_slice(hf_name: str, layers: int) -> tuple[str, int] | None:
    """Where one expert's matrix lies in a qwen3moe GGUF: (the stacked tensor's llama.cpp name, the expert's index
    along its first NumPy axis) for model.layers.N.mlp.experts.E.<proj>.weight; None for any other name."""
    match = EXPERT.fullmatch(hf_name)
    return None if match is None else (gguf_tensor_name(f"{match[1]}.{match[3]}", layers), int(match[2]))


def gguf_tensor_name(hf_name: str, layers: int = 1) -> str:
    """The llama.cpp name of a Hugging Face tensor name (model.layers.3.mlp.up_proj.weight -> blk.3.ffn_up.weight;
    a Qwen3-MoE's router and stacked experts, model.layers.3.mlp.experts.up_proj.weight -> blk.3.ffn_up_exps.weight,
    by QWEN3MOE's map: the names of one never mean another tensor in the other)."""
    name = (_name_map(layers, gguf.MODEL_ARCH.QWEN3).get_name(hf_name, try_suffixes=(".weight",))
            or _name_map(layers, gguf.MODEL_ARCH.QWEN3MOE).get_name(hf_name, try_suffixes=(".weight",)))
    if name is None:     # every name of config's tensor table has one (tests/files/test_gguf.py checks)
        raise QwenNPError(f"gguf: no GGUF name for tensor {hf_name!r}")
    return name


def read_sampling(path: str | Path) -> dict[str, Any]:
    """The general.sampling.* defaults as generation_config.json keys (absent keys left out)."""
    reader = open_reader(path)
    keys = {"temperature": Keys.General.SAMPLING_TEMP, "top_k": Keys.General.SAMPLING_TOP_K,
            "top_p": Keys.General.SAMPLING_TOP_P, "min_p": Keys.General.SAMPLING_MIN_P,
            "repetition_penalty": Keys.General.SAMPLING_PENALTY_REPEAT}
    raw = {name: metadata_value(reader, key, (int, float), None) for name, key in keys.items()}
    raw = {name: value if isinstance(value, int) else _f32_decimal(value) for name, value in raw.items() if value is not None}
    if "temperature" in raw:
        raw["do_sample"] = raw["temperature"] > 0
    return raw
