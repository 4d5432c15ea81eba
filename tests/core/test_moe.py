"""Qwen3-MoE (model_type qwen3_moe) against transformers' Qwen3MoeForCausalLM on small random models: the logits
at every position, whole and through the KV cache, and the greedy tokens, on the readable and the fast path; the
config's sparse layers and parameter counts; `python -m qwen_np generate` on a saved MoE folder.

The models cover both values of norm_topk_prob, dense layers among sparse ones (mlp_only_layers, and
decoder_sparse_step 2), one expert a token and several, tied and untied heads."""

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch  # noqa: E402

import qwen_np  # noqa: E402
from qwen_np.core.config import active_parameter_count, parameter_count  # noqa: E402

from qwen_np.files.adapter import read_adapter  # noqa: E402
from qwen_np.files.tokenizer import Tokenizer  # noqa: E402
from tests.commands.test_cli import ids_line  # noqa: E402
from tests.conftest import HANG_SECONDS, QWEN3_RANDOM  # noqa: E402
from tests.reference.hf_reference import (  # noqa: E402
    build_reference_model,
    make_moe_config,
    random_token_ids,
    reference_logits,
    save_bf16_checkpoint,
)
from tests.reference.logit_match import assert_logits_match  # noqa: E402

pytestmark = pytest.mark.slow      # torch and transformers

PROMPT_TOKENS = 24
PREFIX_TOKENS = 10                 # cached in one pass, then the rest one token at a time
NEW_TOKENS = 8
SHAPE = dict(vocab_size=400, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, moe_intermediate_size=32)
MODELS = [
    pytest.param(dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                      mlp_only_layers=[1], tie_word_embeddings=False), id="normalized-mlp_only_layers-untied"),
    pytest.param(dict(num_hidden_layers=4, num_experts=6, num_experts_per_tok=3, norm_topk_prob=False,
                      decoder_sparse_step=2, tie_word_embeddings=True), id="unnormalized-sparse_step2-tied"),
    pytest.param(dict(num_hidden_layers=2, num_experts=4, num_experts_per_tok=1, norm_topk_prob=False,
                      tie_word_embeddings=False), id="one-expert-a-token-all-sparse"),
]


@pytest.fixture(scope="module", params=MODELS)
def moe_model(request, tmp_path_factory):
    """(checkpoint folder, the transformers model's sparse layers and parameters, token ids, its logits, its
    greedy tokens), all taken before saving, which casts RoPE's inv_freq buffer to BF16 too."""
    model = build_reference_model(make_moe_config(**SHAPE, **request.param), seed=46)
    ids = random_token_ids(SHAPE["vocab_size"], PROMPT_TOKENS, seed=46)
    expected = reference_logits(model, ids)
    with torch.inference_mode():
        greedy_tokens = model.generate(torch.from_numpy(ids)[None], max_new_tokens=NEW_TOKENS, do_sample=False,
                                       min_new_tokens=NEW_TOKENS)[0, len(ids):].tolist()
    sparse = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in model.model.layers]
    parameters = sum(p.numel() for p in model.parameters())                              # a tied head once
    folder = tmp_path_factory.mktemp("moe")
    save_bf16_checkpoint(model, folder)
    return folder, (sparse, parameters), ids, expected, greedy_tokens


def read_checkpoint_names(folder: Path) -> list[str]:
    """The tensor names of a saved checkpoint's safetensors files."""
    from safetensors import safe_open

    names: list[str] = []
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "np") as handle:
            names += list(handle.keys())
    return names


def greedy(model, ids: np.ndarray, steps: int) -> list[int]:
    """Greedy tokens through the KV cache: the prompt in one pass, then one token a step."""
    cache = model.new_cache(len(ids) + steps)
    logits, tokens = model.forward(ids, cache, last_only=True), []
    for _ in range(steps):
        tokens.append(int(np.argmax(logits[-1])))
        logits = model.forward([tokens[-1]], cache)
    return tokens


def test_sparse_layers_and_parameter_counts_are_transformers(moe_model):
    folder, (theirs, parameters), *_ = moe_model
    config = qwen_np.load_config(folder)
    assert [config.sparse_layer(i) for i in range(config.num_hidden_layers)] == theirs
    assert True in theirs
    assert parameter_count(config) == parameters
    unused = sum(theirs) * (config.num_experts - config.num_experts_per_tok) * 3 * SHAPE["hidden_size"] * 32
    assert active_parameter_count(config) == parameter_count(config) - unused


@pytest.mark.parametrize("fast", [False, True], ids=["readable", "fast"])
def test_moe_logits_match_transformers_whole_and_through_the_cache(moe_model, fast):
    folder, _, ids, expected, _ = moe_model
    model = qwen_np.load_model(folder, fast=fast)
    assert model.fast == fast
    assert_logits_match(model.forward(ids), expected, "whole prompt")
    cache = model.new_cache(PROMPT_TOKENS)
    steps = [model.forward(ids[:PREFIX_TOKENS], cache)] + [model.forward(ids[t:t + 1], cache)
                                                           for t in range(PREFIX_TOKENS, PROMPT_TOKENS)]
    assert_logits_match(np.concatenate(steps), expected, "through the KV cache")
    # Two sequences in one batch: each routed as alone (the experts' rows gathered across both).
    both = model.forward_batch([ids, ids[:7]], [None, None])
    assert_logits_match(both, np.concatenate([expected, expected[:7]]), "a batch of two")


@pytest.mark.parametrize("memory", ["bf16", "int8", "q4_0"])
def test_moe_runs_in_every_memory_mode_the_fast_path_as_the_readable(moe_model, memory):
    """Experts held as stored (BF16: exact here), as int8 rows or as q4_0 blocks: both paths multiply each kind."""
    folder, _, ids, expected, _ = moe_model
    readable = qwen_np.load_model(folder, memory=memory, fast=False)
    fast = qwen_np.load_model(folder, memory=memory)
    assert readable.plan.mode == fast.plan.mode == memory
    logits = readable.forward(ids)
    assert_logits_match(fast.forward(ids), logits, f"fast vs readable, {memory}")
    if memory == "bf16":
        assert_logits_match(logits, expected, "BF16 as stored vs transformers")


@pytest.mark.parametrize("fast", [False, True], ids=["readable", "fast"])
def test_moe_greedy_tokens_are_transformers(moe_model, fast):
    folder, _, ids, _, theirs = moe_model
    assert greedy(qwen_np.load_model(folder, fast=fast), ids, NEW_TOKENS) == theirs


def test_a_loaded_moe_trains_every_tensor_and_lora_refuses_it_by_name(moe_model, tmp_path):
    """Every tensor of the checkpoint gets a gradient (tests/training/test_moe_gradients.py checks their values);
    LoRA adapters are refused."""
    folder, _, ids, _, _ = moe_model
    model = qwen_np.load_model(folder, memory="fp32", fast=False)
    loss, grads = qwen_np.loss_and_gradients(model, ids[None, :8])
    assert np.isfinite(loss) and sorted(grads) == sorted(read_checkpoint_names(folder))
    with pytest.raises(qwen_np.QwenNPError, match="lora: .* LoRA adapters are read for dense Qwen3 only"):
        read_adapter(tmp_path, model.config)


def test_generate_runs_a_saved_moe_folder(tmp_path, env):
    """`python -m qwen_np generate` on a Qwen3-MoE checkpoint with Qwen3's tokenizer: transformers' greedy tokens."""
    config = make_moe_config(**{**SHAPE, "vocab_size": 151936}, num_hidden_layers=2, num_experts=4,
                             num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=True)
    reference = build_reference_model(config, seed=7)
    prompt = Tokenizer.from_folder(QWEN3_RANDOM).encode("Hello, world")
    with torch.inference_mode():
        theirs = reference.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                    min_new_tokens=6)[0, len(prompt):].tolist()
    save_bf16_checkpoint(reference, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(QWEN3_RANDOM / name, tmp_path / name)
    result = subprocess.run([sys.executable, "-m", "qwen_np", "generate", "-m", str(tmp_path), "--no-chat",
                             "--temperature", "0", "-n", "6", "--verbose", "Hello, world"],
                            cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, timeout=HANG_SECONDS)
    assert result.returncode == 0, result.stderr.decode()
    lines = result.stderr.decode().splitlines()
    assert ids_line(lines, "prompt ids:") == prompt
    assert ids_line(lines, "generated ids:") == theirs
