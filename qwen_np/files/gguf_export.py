"""Writing a GGUF llama.cpp loads (`export`): write_gguf (a checkpoint's tensors, one converted at a time)
and write_gguf_tensors (each tensor's data from a function: bench's random files), with the metadata
llama.cpp's convert_hf_to_gguf.py writes for Qwen3 and the tokenizer as gguf_tokenizer writes it."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as GGML
from gguf import GGUFWriter, LlamaFileType

from .checkpoint import Checkpoint
from ..core.defaults import GGUF_FILE_TYPES
from ..core.config import Qwen3Config, expected_tensors, yarn_mscale
from ..errors import QwenNPError
from ..numbers.numerics import upcast
from ..core.sampling import SamplingParams
from .gguf_metadata import ARCHITECTURE, MOE_ARCHITECTURE, expert_slice, gguf_tensor_name
from .gguf_tokenizer import add_vocabulary
from .tokenizer import Tokenizer

# --type -> (the ggml type of every matrix, llama.cpp's general.file_type). Norm weights (1-D) are always
# F32, as llama.cpp's converter writes them.
FILE_TYPES = dict(zip(GGUF_FILE_TYPES, [(GGML.F32, LlamaFileType.ALL_F32), (GGML.F16, LlamaFileType.MOSTLY_F16),
                                        (GGML.BF16, LlamaFileType.MOSTLY_BF16), (GGML.Q8_0, LlamaFileType.MOSTLY_Q8_0),
                                        (GGML.Q4_0, LlamaFileType.MOSTLY_Q4_0)], strict=True))   # the names: --help's
# The types GGUFWriter takes as NumPy element arrays; it takes every other type as bytes.
PLAIN_NUMPY: dict[GGML, np.dtype] = {GGML.F32: np.dtype(np.float32), GGML.F16: np.dtype(np.float16)}


def write_gguf(path: str | Path, checkpoint: Checkpoint, tokenizer: Tokenizer, sampling: SamplingParams,
               file_type: str = "f16", name: str = "qwen3") -> list[str]:
    """Write the checkpoint as a GGUF llama.cpp loads: metadata, tokenizer, chat template, tensors
    (streamed: one tensor converted at a time). Atomic: written under a temporary name in the same
    folder and renamed at the end, so an error leaves no file at `path`. Returns notes for the user."""
    def encoded(hf: str, gguf_name: str, shape: tuple[int, ...], kind: GGML) -> np.ndarray:
        return _encoded(upcast(checkpoint.read(hf)), kind, gguf_name)

    return write_gguf_tensors(path, checkpoint.config, tokenizer, sampling, encoded, file_type, name)


# (Hugging Face name, GGUF name, NumPy shape, ggml type) -> the tensor's data as GGUFWriter takes it: an
# F32/F16 array of that shape, or for a quantized type the uint8 array of gguf.quants.quant_shape_to_byte_shape.
TensorData = Callable[[str, str, tuple[int, ...], GGML], np.ndarray]


@dataclass(frozen=True)
class Mix:
    """A file type whose matrices differ in type, as llama.cpp's K-quant mixes choose per tensor (Q4_K_M:
    Q4_K, with Q6_K for the output and some layers' attn_v and ffn_down): the general.file_type it
    declares, and each matrix's type by its GGUF name."""

    file_type: LlamaFileType
    matrix_type: Callable[[str], GGML]


def write_gguf_tensors(path: str | Path, config: Qwen3Config, tokenizer: Tokenizer, sampling: SamplingParams,
                       tensor_data: TensorData, file_type: str | Mix = "f16", name: str = "qwen3") -> list[str]:
    """write_gguf with each tensor's data from tensor_data(...), called once per tensor in file order and
    written at once (so the model never has to be in memory: bench/big_models.py writes random blocks).
    file_type: a FILE_TYPES name, or a Mix (bench/gguf_kinds.py's random K-quant files)."""
    path = Path(path)
    if isinstance(file_type, Mix):
        llama_file_type, matrix_type = file_type.file_type, file_type.matrix_type
    else:
        kind, llama_file_type = FILE_TYPES[file_type]
        matrix_type = lambda gguf_name: kind                                          # noqa: E731
    _check_llama_cpp_runs(config)
    layout = _layout(config)                                    # GGUF name -> (its HF tensors, their shape)
    kinds = {gguf_name: _tensor_type(shape, matrix_type(gguf_name)) for gguf_name, (_, shape) in layout.items()}
    notes = [f"{gguf_name} stays F16: its rows ({shape[-1]} values) are not whole {matrix_type(gguf_name).name} blocks"
             for gguf_name, (_, shape) in layout.items() if len(shape) == 2 and kinds[gguf_name] != matrix_type(gguf_name)]
    temporary = path.with_name(f".{path.name}.{os.getpid()}.partial")
    writer = GGUFWriter(temporary, MOE_ARCHITECTURE if config.is_moe else ARCHITECTURE)
    try:
        _add_metadata(writer, config, llama_file_type, name, sampling)
        notes += add_vocabulary(writer, tokenizer, config)
        for gguf_name, (sources, shape) in layout.items():
            stacked = (len(sources), *shape) if len(sources) > 1 else shape
            writer.add_tensor_info(gguf_name, *_stored_layout(stacked, kinds[gguf_name]), raw_dtype=kinds[gguf_name])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for gguf_name, (sources, shape) in layout.items():
            parts = [tensor_data(hf, gguf_name, shape, kinds[gguf_name]) for hf in sources]
            writer.write_tensor_data(parts[0] if len(parts) == 1 else np.stack(parts))
        writer.close()
        os.replace(temporary, path)
    finally:
        writer.close()
        temporary.unlink(missing_ok=True)
    return notes


def _check_llama_cpp_runs(config: Qwen3Config) -> None:
    """Refuse what a GGUF llama.cpp loads cannot say: its qwen3moe graph runs every layer sparse and renormalises
    the chosen experts' weights; its YaRN computes the attention factor from the factor (0.1 ln(factor) + 1, an
    attention factor written in the file multiplying it, where transformers' replaces it) and always rounds the
    ramp's ends to whole dimensions."""
    if (yarn := config.rope_scaling) is not None and (
            not yarn.truncate or abs(yarn.attention_factor - yarn_mscale(yarn.factor)) > 1e-12):
        raise QwenNPError("a YaRN rope_scaling with its own attention_factor (or mscale) or truncate false is not "
                          "written as GGUF: llama.cpp computes the attention factor from the factor and truncates", "model")
    if config.is_moe and not all(map(config.sparse_layer, range(config.num_hidden_layers))):
        raise QwenNPError("a Qwen3-MoE with dense layers (mlp_only_layers, decoder_sparse_step) is not written as "
                          "GGUF: llama.cpp's qwen3moe runs every layer sparse", "model")
    if config.is_moe and not config.norm_topk_prob:
        raise QwenNPError("a Qwen3-MoE with norm_topk_prob false is not written as GGUF: llama.cpp's qwen3moe "
                          "renormalises the chosen experts' weights", "model")


def _layout(config: Qwen3Config) -> dict[str, tuple[list[str], tuple[int, ...]]]:
    """Each GGUF tensor: the Hugging Face tensors it holds and their shape. One each, but a Qwen3-MoE's experts:
    a layer's E matrices of one projection stacked into one [E, rows, columns] tensor, as llama.cpp's
    converter writes them (Qwen2MoeModel)."""
    layout: dict[str, tuple[list[str], tuple[int, ...]]] = {}
    for hf, shape in expected_tensors(config).items():
        stacked = expert_slice(hf, config.num_hidden_layers)
        gguf_name = gguf_tensor_name(hf, config.num_hidden_layers) if stacked is None else stacked[0]
        layout.setdefault(gguf_name, ([], shape))[0].append(hf)       # experts in order: expected_tensors'
    return layout


def _encoded(values: np.ndarray, kind: GGML, name: str) -> np.ndarray:
    """FP32 values in `kind` (gguf.quants.quantize), refusing F16 overflow: a cast past 65504 would write inf."""
    with np.errstate(over="ignore"):
        encoded = gguf.quants.quantize(values, kind)
    if kind == GGML.F16 and not np.isfinite(encoded).all() and np.isfinite(values).all():
        raise QwenNPError(f"tensor {name!r} has values beyond F16's largest (65504, it holds "
                          f"{float(np.max(np.abs(values))):.4g}); use `file_type` bf16 or f32", "file_type")
    return encoded


def _tensor_type(shape: tuple[int, ...], matrix_type: GGML) -> GGML:
    """F32 for 1-D tensors; the asked type for matrices, or F16 where a row is not whole blocks of the
    quantized type (llama.cpp's converter falls back to F16 the same way)."""
    if len(shape) == 1:
        return GGML.F32
    block, _ = gguf.GGML_QUANT_SIZES[matrix_type]
    return matrix_type if shape[-1] % block == 0 else GGML.F16


def _stored_layout(shape: tuple[int, ...], kind: GGML) -> tuple[Sequence[int], np.dtype, int]:
    """(shape, dtype, bytes) as GGUFWriter.add_tensor_info takes them: elements for F32/F16, bytes for the rest."""
    if kind in PLAIN_NUMPY:
        return shape, PLAIN_NUMPY[kind], math.prod(shape) * PLAIN_NUMPY[kind].itemsize
    byte_shape = gguf.quants.quant_shape_to_byte_shape(shape, kind)
    return byte_shape, np.dtype(np.uint8), math.prod(byte_shape)


def _add_metadata(writer: GGUFWriter, config: Qwen3Config, file_type: int, name: str, sampling: SamplingParams) -> None:
    """The keys llama.cpp's convert_hf_to_gguf.py writes for Qwen3 (TextModel.set_gguf_parameters; a Qwen3-MoE's
    expert counts as Qwen2MoeModel's), plus
    the sampling defaults (general.sampling.*, which llama.cpp reads as its defaults)."""
    writer.add_name(name)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    if (yarn := config.rope_scaling) is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(yarn.factor)
        writer.add_rope_scaling_orig_ctx_len(yarn.original_max_position_embeddings)
        if (yarn.beta_fast, yarn.beta_slow) != (32.0, 1.0):            # llama.cpp's defaults, and transformers'
            writer.add_rope_scaling_yarn_beta_fast(yarn.beta_fast)
            writer.add_rope_scaling_yarn_beta_slow(yarn.beta_slow)
    if config.is_moe:
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_sampling_temp(sampling.temperature)
    writer.add_sampling_top_k(sampling.top_k)
    writer.add_sampling_top_p(sampling.top_p)
    writer.add_sampling_min_p(sampling.min_p)
    writer.add_sampling_penalty_repeat(sampling.repetition_penalty)
