"""bench.moe's pieces on a tiny Qwen3-MoE (the real-shape run is a benchmark, not a test): the random Q4_K_M
GGUF bench.gguf_kinds writes for a MoE (llama.cpp's mix over the stacked expert tensors, the router F32, each
expert its own blocks), the bytes a token reads (K of E experts), and the prefill measurement's grouped and
per-token MoE blocks giving the same output."""

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GGML
from gguf import GGUFReader

import qwen_np
from bench import gguf_kinds
from bench.moe import prefill_run
from qwen_np.core.config import Qwen3Config
from qwen_np.core.sampling import SamplingParams
from qwen_np.files.gguf_export import write_gguf_tensors
from qwen_np.files.tokenizer import Tokenizer
from tests.conftest import BUNDLED

LAYERS, EXPERTS, TOP_K = 2, 8, 2
# Rows of 256 values: whole K-quant blocks. use_more_bits(1, 2) holds, use_more_bits(0, 2) does not.
CONFIG = Qwen3Config(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=LAYERS,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=EXPERTS,
                     num_experts_per_tok=TOP_K, moe_intermediate_size=256, norm_topk_prob=True,
                     tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("moe") / "tiny-q4_k_m.gguf"
    write_gguf_tensors(path, CONFIG, Tokenizer.from_folder(BUNDLED), SamplingParams(), gguf_kinds.random_tensor,
                       gguf_kinds.q4_k_m(CONFIG), name="tiny-moe")
    return path


def test_the_random_q4_k_m_moe_file_has_llama_cpps_kinds_and_distinct_experts(moe_gguf) -> None:
    tensors = {t.name: t for t in GGUFReader(moe_gguf).tensors}
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type == GGML.F32          # the router is never quantized
    assert tensors["blk.0.ffn_down_exps.weight"].tensor_type == GGML.Q4_K
    assert tensors["blk.1.ffn_down_exps.weight"].tensor_type == GGML.Q6_K         # use_more_bits' layer
    assert tensors["blk.1.ffn_gate_exps.weight"].tensor_type == GGML.Q4_K
    assert tensors["output.weight"].tensor_type == GGML.Q6_K
    gate = tensors["blk.0.ffn_gate_exps.weight"]
    assert list(gate.shape) == [CONFIG.hidden_size, CONFIG.moe_intermediate_size, EXPERTS]   # ggml order, experts last
    experts = np.asarray(gate.data).reshape(EXPERTS, -1)
    assert len({bytes(e) for e in experts}) == EXPERTS                           # each seeded by its own name


def test_a_decode_step_reads_k_of_e_experts_and_grouped_prefill_matches_per_token(moe_gguf) -> None:
    model = qwen_np.load_model(moe_gguf, memory="stored", max_tokens=32)
    everything = sum(int(m.nbytes) for layer in model.layers for m in layer.matrices()) + int(model.lm_head.nbytes)
    experts = sum(int(m.nbytes) for layer in model.layers for e in layer.experts for m in e)
    assert gguf_kinds.per_token_bytes(model) == everything - experts + experts * TOP_K // EXPERTS
    result = prefill_run(model, tokens=24, sampled_layers=LAYERS)
    assert result["moe_layers"] == [0, 1]
    assert result["moe_relative_difference"] < 1e-5
    assert result["moe_per_token_cpu_s"] > 0 and result["prefill_forward_s"] > 0
