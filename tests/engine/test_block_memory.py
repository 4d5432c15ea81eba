"""--memory q8_0 and q4_0: every matrix held as llama.cpp's blocks of 32 (formats.FormatRows), the bytes of
gguf's own quantizers, and the logits of the FP32 model whose matrices were rounded through the format,
on the fast path and the readable one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import qwen_np
from qwen_np.precision import lab as precision
from qwen_np.core.config import LAYER_MATRICES
from qwen_np.numbers.names import HELD_FORMATS
from qwen_np.numbers.formats import FormatRows
from qwen_np.engine.memory import plan_memory, weight_bytes
from tests.reference.logit_match import assert_logits_match

gguf = pytest.importorskip("gguf")            # ggml's own Python library: the reference quantizers

PROMPT = np.array([3, 17, 5, 42, 8, 23, 11, 2, 60, 33])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.conftest import write_random_checkpoint

    return write_random_checkpoint(tmp_path_factory.mktemp("c"), seed=11, hidden_size=64, intermediate_size=96,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128)


def ggml_bytes(held: FormatRows) -> np.ndarray:
    """The held parts laid out as ggml's blocks: per block its FP16 scale, then its codes."""
    codes, scales = held.parts
    rows, blocks = scales.shape
    return np.concatenate([scales.view(np.uint8).reshape(rows, blocks, 2),
                           codes.view(np.uint8).reshape(rows, blocks, -1)], axis=-1).reshape(rows, -1)


@pytest.mark.parametrize("fmt", HELD_FORMATS)
def test_every_matrix_holds_the_bytes_of_ggufs_quantizer(checkpoint: Path, fmt: str) -> None:
    fp32 = qwen_np.load_model(checkpoint, memory="fp32", fast=False)
    blocks = qwen_np.load_model(checkpoint, memory=fmt, fast=False)
    kind = getattr(gguf.GGMLQuantizationType, fmt.upper())
    pairs = [(getattr(a, key), getattr(b, key)) for a, b in zip(fp32.layers, blocks.layers) for key in LAYER_MATRICES]
    pairs += [(fp32.embed_tokens, blocks.embed_tokens), (fp32.lm_head, blocks.lm_head)]
    for reference, held in pairs:
        assert isinstance(held, FormatRows) and held.shape == reference.shape
        assert np.array_equal(ggml_bytes(held), gguf.quants.quantize(reference, kind))


@pytest.mark.parametrize("fast", [False, True], ids=["readable", "fast"])
@pytest.mark.parametrize("fmt", HELD_FORMATS)
def test_block_weights_give_the_logits_of_the_rounded_fp32_model(checkpoint: Path, fmt: str, fast: bool) -> None:
    rounded = precision.formatted_model(qwen_np.load_model(checkpoint, memory="fp32", fast=False), fmt)
    want = rounded.forward(PROMPT)
    model = qwen_np.load_model(checkpoint, memory=fmt, fast=fast)
    got = model.forward(PROMPT)
    assert_logits_match(got, want, f"{fmt} full pass")
    cache = model.new_cache(16)                                    # decode through the cache: the same logits
    model.forward(PROMPT[:6], cache)
    steps = np.concatenate([model.forward([t], cache) for t in PROMPT[6:]])
    assert_logits_match(steps, want[6:], f"{fmt} decode")


@pytest.mark.parametrize("fmt", HELD_FORMATS)
def test_the_plan_counts_the_blocks_and_their_scales(checkpoint: Path, fmt: str) -> None:
    model = qwen_np.load_model(checkpoint, memory=fmt)
    held = sum(getattr(w, key).nbytes for w in model.layers for key in LAYER_MATRICES) + model.embed_tokens.nbytes
    held += 0 if model.lm_head is model.embed_tokens else model.lm_head.nbytes
    norms = sum(w.input_layernorm.nbytes + w.post_attention_layernorm.nbytes + w.q_norm.nbytes + w.k_norm.nbytes
                for w in model.layers) + model.norm.nbytes
    assert model.plan.mode == fmt and model.plan.weight_bytes[fmt] == weight_bytes(model.config, fmt) == held + norms
    big = plan_memory(qwen_np.preset("qwen3-8b"), 4096, fmt, available=64 * 2**30)
    assert big.weight_bytes[fmt] / big.weight_bytes["bf16"] == pytest.approx({"q8_0": 8.5, "q4_0": 4.5}[fmt] / 16, rel=1e-3)
