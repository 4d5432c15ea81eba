"""A qwen3moe GGUF as llama.cpp's convert_hf_to_gguf.py writes one from a transformers Qwen3MoeForCausalLM: its
Qwen2MoeModel stacks each layer's experts into one 3-D tensor per projection ([E, out, in], blk.N.ffn_*_exps) and
names every tensor by gguf's TensorNameMap for QWEN3MOE, with the expert counts in the metadata. Written here
with the gguf package the same way, F32 (transformers' logits) and Q8_0 (the logits of its dequantization),
then read by qwen_np: each expert a slice of its stacked tensor, read, held and checked as a matrix."""

import shutil
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GGML

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch  # noqa: E402

import qwen_np  # noqa: E402
from qwen_np.core.sampling import SamplingParams  # noqa: E402
from qwen_np.errors import QwenNPError  # noqa: E402
from qwen_np.files.gguf_export import write_gguf_tensors  # noqa: E402
from qwen_np.files.tokenizer import Tokenizer  # noqa: E402
from tests.conftest import BUNDLED  # noqa: E402
from tests.files.test_gguf import export  # noqa: E402

from tests.reference import hf_reference as hf  # noqa: E402
from tests.reference.logit_match import assert_logits_match  # noqa: E402

pytestmark = pytest.mark.slow      # torch and transformers

LAYERS, EXPERTS, VOCAB = 2, 4, 320
# llama.cpp's qwen3moe runs every layer sparse and renormalises the chosen experts' weights.
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, num_experts=EXPERTS,
              num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)


def converted(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The checkpoint's tensors under llama.cpp's names, each layer's experts stacked per projection (as
    Qwen2MoeModel.modify_tensors does before map_tensor_name)."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, LAYERS)
    out = {}
    for name, value in state.items():
        if ".mlp.experts." in name:
            continue
        out[names.get_name(name, try_suffixes=(".weight",))] = value
    for i in range(LAYERS):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            stacked = np.stack([state[f"model.layers.{i}.mlp.experts.{e}.{proj}.weight"] for e in range(EXPERTS)])
            out[names.get_name(f"model.layers.{i}.mlp.experts.{proj}.weight", try_suffixes=(".weight",))] = stacked
    return out


def write_gguf(path: Path, tensors: dict[str, np.ndarray], kind: GGML, experts_norm: bool | None = None) -> Path:
    """The converter's metadata for Qwen3-MoE (TextModel and Qwen2MoeModel.set_gguf_parameters) and tensors:
    matrices as `kind`, norms F32."""
    writer = gguf.GGUFWriter(path, "qwen3moe")
    writer.add_block_count(LAYERS)
    writer.add_context_length(40960)
    writer.add_embedding_length(CONFIG["hidden_size"])
    writer.add_feed_forward_length(CONFIG["intermediate_size"])
    writer.add_head_count(CONFIG["num_attention_heads"])
    writer.add_head_count_kv(CONFIG["num_key_value_heads"])
    writer.add_key_length(CONFIG["head_dim"])
    writer.add_value_length(CONFIG["head_dim"])
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_expert_count(EXPERTS)
    writer.add_expert_used_count(CONFIG["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(CONFIG["moe_intermediate_size"])
    if experts_norm is not None:
        writer.add_expert_weights_norm(experts_norm)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(VOCAB)])
    for name, value in tensors.items():
        if value.ndim == 1 or kind == GGML.F32:
            writer.add_tensor(name, value.astype(np.float32))
        else:
            writer.add_tensor(name, gguf.quants.quantize(value, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def reference():
    model = hf.build_reference_model(hf.make_moe_config(**CONFIG), seed=46)
    state = {name: value.detach().numpy().copy() for name, value in model.state_dict().items()}
    return model, state, hf.random_token_ids(VOCAB, 20, seed=46)


def with_weights(model, state: dict[str, np.ndarray]):
    """The transformers model with these (per-expert) weights, in its own stacked layout."""
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            experts = layer.mlp.experts
            gate_up = [np.concatenate([state[f"model.layers.{i}.mlp.experts.{e}.{p}.weight"] for p in ("gate_proj", "up_proj")])
                       for e in range(EXPERTS)]
            experts.gate_up_proj.copy_(torch.from_numpy(np.stack(gate_up)))
            experts.down_proj.copy_(torch.from_numpy(np.stack([state[f"model.layers.{i}.mlp.experts.{e}.down_proj.weight"]
                                                               for e in range(EXPERTS)])))
        for name, value in state.items():
            if ".mlp.experts." not in name:
                model.get_parameter(name).copy_(torch.from_numpy(value))
    return model


def per_expert(model) -> dict[str, np.ndarray]:
    """The model's tensors as released (one per expert): save_pretrained's names."""
    state = {}
    for name, value in model.state_dict().items():
        array = value.detach().numpy().copy()
        if name.endswith("experts.gate_up_proj"):
            prefix, half = name.removesuffix("gate_up_proj"), array.shape[1] // 2
            for e in range(EXPERTS):
                state[f"{prefix}{e}.gate_proj.weight"] = array[e, :half]
                state[f"{prefix}{e}.up_proj.weight"] = array[e, half:]
        elif name.endswith("experts.down_proj"):
            for e in range(EXPERTS):
                state[f"{name.removesuffix('down_proj')}{e}.down_proj.weight"] = array[e]
        else:
            state[name] = array
    return state


@pytest.mark.parametrize("fast", [False, True], ids=["readable", "fast"])
def test_an_f32_qwen3moe_gguf_gives_transformers_logits(reference, tmp_path, fast):
    model, _, ids = reference
    path = write_gguf(tmp_path / "moe-f32.gguf", converted(per_expert(model)), GGML.F32)
    ours = qwen_np.load_model(path, fast=fast)
    assert ours.config.is_moe and (ours.config.num_experts, ours.config.norm_topk_prob) == (EXPERTS, True)
    assert_logits_match(ours.forward(ids), hf.reference_logits(model, ids), "F32 GGUF")


@pytest.mark.parametrize("memory", ["bf16", "fp32"])
def test_a_q8_0_qwen3moe_gguf_gives_the_logits_of_its_dequantization(reference, tmp_path, memory):
    """Kept as its blocks (each expert's a view of its slice) or widened at load: the logits transformers gives
    with every matrix replaced by its Q8_0 dequantization (a wrong expert slice would be another expert)."""
    model, _, ids = reference
    state = per_expert(model)
    path = write_gguf(tmp_path / "moe-q8_0.gguf", converted(state), GGML.Q8_0)
    rounded = {name: value if value.ndim == 1 else gguf.quants.dequantize(gguf.quants.quantize(value, GGML.Q8_0),
                                                                          GGML.Q8_0).reshape(value.shape)
               for name, value in state.items()}
    expected = hf.reference_logits(with_weights(hf.build_reference_model(hf.make_moe_config(**CONFIG), seed=46), rounded), ids)
    ours = qwen_np.load_model(path, memory=memory)
    assert ours.plan.mode == memory
    assert_logits_match(ours.forward(ids), expected, f"Q8_0 GGUF, {memory}")


def test_expert_weights_norm_false_is_read(reference, tmp_path):
    model, *_ = reference
    path = write_gguf(tmp_path / "moe.gguf", converted(per_expert(model)), GGML.F32, experts_norm=False)
    assert qwen_np.load_model(path).config.norm_topk_prob is False


def test_a_qwen3moe_gguf_missing_an_experts_tensor_is_refused_naming_it(reference, tmp_path):
    model, *_ = reference
    tensors = converted(per_expert(model))
    del tensors["blk.1.ffn_up_exps.weight"]
    with pytest.raises(QwenNPError, match="tensor 'blk.1.ffn_up_exps.weight' .*is missing"):
        qwen_np.load_model(write_gguf(tmp_path / "moe.gguf", tensors, GGML.F32))


@pytest.fixture(scope="module")
def moe_folder(reference, tmp_path_factory):
    """The reference model saved as released (BF16, one tensor per expert) with the bundled model's tokenizer,
    at its 2,048-token vocabulary."""
    model = hf.build_reference_model(hf.make_moe_config(**{**CONFIG, "vocab_size": 2048}), seed=47)
    ids = hf.random_token_ids(2048, 16, seed=3)
    expected = hf.reference_logits(model, ids)      # before saving: that casts RoPE's inv_freq buffer to BF16 too
    state = per_expert(model)
    folder = tmp_path_factory.mktemp("moe")
    hf.save_bf16_checkpoint(model, folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(BUNDLED / name, folder / name)
    return folder, state, ids, expected


@pytest.mark.parametrize("file_type", ["f32", "q8_0"])
def test_export_writes_a_qwen3moe_gguf_as_llama_cpps_converter_lays_it_out(moe_folder, tmp_path, file_type):
    """The same tensor names, shapes and (F32) values as the converter's stacking, its expert counts, and the
    logits back: transformers' for F32, within Q8_0's rounding of them for Q8_0 (the same blocks per expert)."""
    folder, state, ids, expected = moe_folder
    path = export(folder, tmp_path / f"moe-{file_type}.gguf", file_type)
    reader = gguf.GGUFReader(path)
    written = {t.name: np.array(t.data) for t in reader.tensors}
    theirs = converted(state)
    assert {name: tuple(reversed([int(n) for n in t.shape])) for name, t in zip(written, reader.tensors)} == \
        {name: value.shape for name, value in theirs.items()}
    assert str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8") == "qwen3moe"
    assert reader.fields["qwen3moe.expert_count"].parts[-1][0] == EXPERTS
    ours = qwen_np.load_model(path, memory="fp32").forward(ids)
    if file_type == "f32":
        assert all(np.array_equal(written[name], value) for name, value in theirs.items())
        assert_logits_match(ours, expected, "exported F32")
    else:
        assert np.abs(ours - expected).max() < 0.05 * np.abs(expected).max()


def test_export_refuses_a_moe_llama_cpp_would_run_otherwise(tmp_path):
    config = qwen_np.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4,
                                 num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True, mlp_only_layers=(1,))
    tokenizer = Tokenizer.from_folder(BUNDLED)
    with pytest.raises(QwenNPError, match="model: a Qwen3-MoE with dense layers"):
        write_gguf_tensors(tmp_path / "x.gguf", config, tokenizer, SamplingParams(), None, "f32")   # type: ignore[arg-type]
    with pytest.raises(QwenNPError, match="model: a Qwen3-MoE with norm_topk_prob false"):
        write_gguf_tensors(tmp_path / "x.gguf", replace(config, mlp_only_layers=(), norm_topk_prob=False), tokenizer,
                           SamplingParams(), None, "f32")   # type: ignore[arg-type]
    assert not (tmp_path / "x.gguf").exists()
