"""The forward pass: KV cache, chunked prefill, memory modes, and the pieces that are easy to get wrong."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from qwen_np import QwenNPError, load_model
from qwen_np.core import layers
from qwen_np.numbers.numerics import StoredRows
from tests.reference.logit_match import assert_logits_match, max_relative_error

IDS = np.array([5, 17, 42, 3, 3, 88, 61, 0, 95, 12, 7, 30, 64, 2, 9, 50])


@pytest.fixture(params=[("fp32", False), ("bf16", False), ("fp32", True), ("bf16", True)],
                ids=["fp32-readable", "bf16-readable", "fp32-fast", "bf16-fast"])
def model(request, make_checkpoint):
    memory, fast = request.param
    return load_model(make_checkpoint(seed=1, num_key_value_heads=1), memory=memory, fast=fast)


def test_kv_cache_prefill_then_decode_matches_full_forward(model):
    full = model.forward(IDS)
    cache = model.new_cache(len(IDS))
    steps = [model.forward(IDS[:6], cache=cache)]
    steps += [model.forward(IDS[i:i + 1], cache=cache) for i in range(6, len(IDS))]
    assert cache.length == len(IDS)
    assert_logits_match(np.concatenate(steps), full, "prefill 6, then decode")


def test_chunked_prefill_matches_full_forward(model):
    full = model.forward(IDS)
    cache = model.new_cache(32)
    chunks = [model.forward(IDS[a:b], cache=cache) for a, b in ((0, 5), (5, 6), (6, 13), (13, 16))]
    assert_logits_match(np.concatenate(chunks), full, "chunked prefill")


def test_last_only_gives_the_last_row_of_the_full_logits(model):
    full = model.forward(IDS)
    last = model.forward(IDS, last_only=True)
    assert last.shape == (1, full.shape[1])
    assert_logits_match(last, full[-1:], "last_only")
    cache = model.new_cache(len(IDS))
    model.forward(IDS[:9], cache=cache, last_only=True)          # the cache fills for every position
    assert_logits_match(model.forward(IDS[9:], cache=cache, last_only=True), full[-1:], "last_only through the cache")


@pytest.mark.parametrize("memory", ["fp32", "bf16"])
def test_readable_decode_step_projects_only_the_new_token(make_checkpoint, monkeypatch, memory):
    model = load_model(make_checkpoint(seed=1), memory=memory, fast=False)
    cache = model.new_cache(32)
    model.forward(IDS[:10], cache=cache)
    rows_seen = []
    original = layers.linear

    def counting_linear(x, weight):
        rows_seen.append(x.shape[0])
        return original(x, weight)

    monkeypatch.setattr(layers, "linear", counting_linear)
    model.forward(IDS[10:11], cache=cache)
    assert rows_seen and set(rows_seen) == {1}       # every projection saw the one new token only


def test_decode_reads_history_from_the_cache(model):
    # If decode silently ignored the cache (or recomputed from the ids), corrupting it would not matter.
    cache = model.new_cache(32)
    model.forward(IDS[:10], cache=cache)
    honest = model.forward(IDS[10:11], cache=cache)
    cache.truncate(10)
    cache.keys[:, :10] = np.random.default_rng(0).standard_normal(cache.keys[:, :10].shape)
    assert max_relative_error(model.forward(IDS[10:11], cache=cache), honest) > 1e-3


@pytest.mark.parametrize("fast", [False, True], ids=["readable", "fast"])
def test_memory_modes_give_the_same_logits(make_checkpoint, fast):
    folder = make_checkpoint(seed=2, tie_word_embeddings=True)
    fp32 = load_model(folder, memory="fp32", fast=fast)
    bf16 = load_model(folder, memory="bf16", fast=fast)
    assert fp32.plan.mode == "fp32" and bf16.plan.mode == "bf16"
    assert isinstance(bf16.embed_tokens, StoredRows)          # stays in the stored BF16 values
    assert_logits_match(bf16.forward(IDS), fp32.forward(IDS), "bf16 vs fp32")


def test_cache_overflow_is_an_error_not_a_silent_wrap(model):
    cache = model.new_cache(4)
    with pytest.raises(QwenNPError, match="exceed its 4 positions"):
        model.forward(IDS[:5], cache=cache)


@pytest.mark.parametrize("bad", [[], [[1, 2]], [1.5, 2.0], [96], [-1]])
def test_bad_token_ids_are_rejected(model, bad):
    with pytest.raises(QwenNPError, match="token_ids"):
        model.forward(np.array(bad))


@pytest.mark.slow
def test_loading_fp32_holds_no_second_copy_of_the_model(make_checkpoint):
    """Peak resident memory of a fresh process loading in fp32 (fast path: fused q|k|v, gate|up) is the
    FP32 model plus one stored tensor (the reused read buffer), not two copies of anything big.

    Measured with the kernel's high-water mark (VmHWM): the weights live in anonymous mappings that
    tracemalloc does not see.
    """
    folder = make_checkpoint(hidden_size=1024, intermediate_size=3072, vocab_size=16384, num_attention_heads=8,
                             num_key_value_heads=4, head_dim=128, tie_word_embeddings=True)
    script = (
        "import sys, qwen_np\n"
        "def status(key):\n"
        "    return next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith(key))\n"
        "base = status('VmRSS:')\n"
        "model = qwen_np.load_model(sys.argv[1], memory='fp32', fast=True)\n"
        "print(status('VmHWM:') - base, 4 * qwen_np.parameter_count(model.config))\n")
    done = subprocess.run([sys.executable, "-c", script, str(folder)], capture_output=True, text=True, check=True)
    growth, fp32_bytes = (int(v) for v in done.stdout.split())
    largest_stored = 2 * 16384 * 1024                       # the BF16 embedding table
    assert fp32_bytes > 150e6                               # big enough that a second copy would show
    assert fp32_bytes <= growth <= fp32_bytes + largest_stored + 40e6, (growth, fp32_bytes)


def test_gqa_query_head_h_reads_kv_head_h_div_group():
    rng = np.random.default_rng(0)
    T, H, KVH, Dh = 3, 4, 2, 8
    q = rng.standard_normal((T, H, Dh)).astype(np.float32)
    k = rng.standard_normal((T, KVH, Dh)).astype(np.float32)
    scores = layers.attention_scores(q, k)                           # [H, T, S]
    for h in range(H):
        expected = q[:, h] @ k[:, h // (H // KVH)].T * Dh ** -0.5
        assert np.allclose(scores[h], expected, rtol=1e-6)


def test_rope_pairs_dimension_i_with_i_plus_half():
    Dh = 8
    inv_freq = layers.rope_inverse_frequencies(Dh, 10000.0)
    cos, sin = layers.rope_angles(inv_freq, np.array([3]))
    x = np.zeros((1, 1, Dh), np.float32)
    x[0, 0, 1] = 1.0                                                  # only dimension 1 is set
    y = layers.rope(x, cos, sin)[0, 0]
    angle = 3 * inv_freq[1]
    assert np.allclose([y[1], y[1 + Dh // 2]], [np.cos(angle), np.sin(angle)], atol=1e-6)
    assert np.count_nonzero(y) == 2                                   # the pair (1, 5), nothing else


@pytest.mark.slow
def test_rope_inverse_frequencies_match_torch_within_one_ulp_and_negligible_phase():
    torch = pytest.importorskip("torch")
    for head_dim, theta in ((128, 1e6), (64, 1e4), (80, 5e6), (16, 1e6)):
        expected = (1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))).numpy()
        ours = layers.rope_inverse_frequencies(head_dim, theta)
        ulps = np.abs(ours.view(np.int32) - expected.view(np.int32))
        assert ulps.max() <= 1 and ulps.sum() <= 1                    # at most one entry, one ulp
        assert np.abs(ours - expected).max() * 40960 < 2e-6             # phase error at the context end


@pytest.mark.slow
def test_rope_tables_match_torch_at_long_positions():
    torch = pytest.importorskip("torch")
    inv_freq = layers.rope_inverse_frequencies(128, 1e6)
    positions = np.array([0, 1, 999, 4097, 32767, 40959])
    cos, sin = layers.rope_angles(inv_freq, positions)
    freqs = torch.from_numpy(inv_freq)[None, :] * torch.from_numpy(positions).float()[:, None]
    emb = torch.cat([freqs, freqs], dim=-1)
    assert np.abs(cos - emb.cos().numpy()).max() <= 2e-7 and np.abs(sin - emb.sin().numpy()).max() <= 2e-7


def test_rms_norm_uses_weight_times_normalised_x():
    x = np.array([[3.0, 4.0]], np.float32)
    weight = np.array([2.0, 0.5], np.float32)
    rms = np.sqrt((9 + 16) / 2 + 1e-6)
    assert np.allclose(layers.rms_norm(x, weight, 1e-6), [[2 * 3 / rms, 0.5 * 4 / rms]])


def test_silu_does_not_overflow_for_very_negative_inputs():
    with np.errstate(invalid="raise", divide="raise"):
        out = layers.silu(np.array([-1000.0, 0.0, 1000.0], np.float32))
    assert np.array_equal(out, np.array([-0.0, 0.0, 1000.0], np.float32))


def test_layer_weights_hold_exactly_the_tensors_of_the_one_table() -> None:
    """model.LayerWeights and config.LAYER_TENSORS name the same tensors, in the same order; then a sparse
    layer's router and experts (config.ROUTER, EXPERT_TENSORS)."""
    from dataclasses import fields

    from qwen_np.core.config import LAYER_TENSORS
    from qwen_np.core.model import LayerWeights

    assert [f.name for f in fields(LayerWeights)] == [*LAYER_TENSORS, "router", "experts"]
