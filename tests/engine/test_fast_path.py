"""The fast path (qwen_np/engine/fast.py) gives the readable path's logits, in every memory mode and cache use.

Both paths run the same math; only the FP32 rounding of BLAS sums may differ, so their logits must match
(tests/reference/logit_match.py: within 1e-5 x max(1, max|logit|), the same token at every position).
"""

from __future__ import annotations

import threading
import tracemalloc
from pathlib import Path
from typing import Callable

import ml_dtypes
import numpy as np
import pytest

import qwen_np
from qwen_np.engine import fast, runtime
from qwen_np.numbers import numerics
from qwen_np.numbers.numerics import Panels, StoredRows, held, panels, upcast
from tests.reference.logit_match import assert_logits_match

# (name, config overrides): GQA groups 1/2/4, head_dim above and below D/H, tied and untied heads.
SHAPES = {
    "mha_narrow_untied": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=6),
    "gqa2_wide_tied": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
    "gqa4_untied": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=12),
}
MODES = ("auto", "fp32", "bf16", "int8")      # auto: FP32 as numerics.Panels in the fast model
PROMPT = np.array([5, 17, 3, 88, 42, 9, 61, 0, 95, 33, 7, 70])


@pytest.fixture(params=sorted(SHAPES), scope="module")
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.conftest import write_random_checkpoint

    return write_random_checkpoint(tmp_path_factory.mktemp(request.param), seed=len(request.param),
                                   num_hidden_layers=3, **SHAPES[request.param])


def load_pair(folder: Path, memory: str) -> tuple[qwen_np.Qwen3Model, qwen_np.Qwen3Model]:
    return (qwen_np.load_model(folder, memory=memory, max_tokens=64, fast=True),
            qwen_np.load_model(folder, memory=memory, max_tokens=64, fast=False))


@pytest.mark.parametrize("memory", MODES)
def test_full_sequence_without_cache(checkpoint: Path, memory: str) -> None:
    fast_model, plain_model = load_pair(checkpoint, memory)
    assert fast_model.fast and not plain_model.fast
    assert_logits_match(fast_model.forward(PROMPT), plain_model.forward(PROMPT), f"{memory} no cache")
    assert_logits_match(fast_model.forward(PROMPT[:1]), plain_model.forward(PROMPT[:1]), f"{memory} one token")


@pytest.mark.parametrize("memory", MODES)
def test_prefill_then_decode_with_cache(checkpoint: Path, memory: str) -> None:
    """Prefill a prompt, then decode token by token (each step attends over the whole cache)."""
    fast_model, plain_model = load_pair(checkpoint, memory)
    fast_cache, plain_cache = fast_model.new_cache(32), plain_model.new_cache(32)
    assert_logits_match(fast_model.forward(PROMPT[:7], fast_cache), plain_model.forward(PROMPT[:7], plain_cache),
                       f"{memory} prefill")
    for step, token in enumerate(PROMPT[7:]):
        assert_logits_match(fast_model.forward([token], fast_cache), plain_model.forward([token], plain_cache),
                           f"{memory} decode step {step}")
    assert fast_cache.length == plain_cache.length == len(PROMPT)
    np.testing.assert_allclose(fast_cache.keys[:, :len(PROMPT)], plain_cache.keys[:, :len(PROMPT)], rtol=0, atol=1e-5)
    np.testing.assert_allclose(fast_cache.values[:, :len(PROMPT)], plain_cache.values[:, :len(PROMPT)], rtol=0, atol=1e-5)


@pytest.mark.parametrize("memory", MODES)
def test_chunked_prefill_matches_one_uncached_pass(checkpoint: Path, memory: str) -> None:
    """Prefill in chunks of 5, 4 and 3 tokens (masks offset by the cache) == one plain pass."""
    fast_model, plain_model = load_pair(checkpoint, memory)
    cache = fast_model.new_cache(32)
    chunks = [fast_model.forward(PROMPT[a:b], cache) for a, b in ((0, 5), (5, 9), (9, 12))]
    assert_logits_match(np.concatenate(chunks), plain_model.forward(PROMPT), f"{memory} chunked prefill")


def test_memory_modes_agree(checkpoint: Path) -> None:
    """BF16-stored weights upcast exactly, so fp32 and bf16 residency give the same logits."""
    fp32, _ = load_pair(checkpoint, "fp32")
    bf16, _ = load_pair(checkpoint, "bf16")
    assert isinstance(bf16.lm_head, StoredRows) and bf16.lm_head.dtype == ml_dtypes.bfloat16
    assert isinstance(fp32.lm_head, np.ndarray) and fp32.lm_head.dtype == np.float32
    assert_logits_match(bf16.forward(PROMPT), fp32.forward(PROMPT), "bf16 vs fp32 residency")


def test_f32_checkpoint_kept_as_stored(make_checkpoint: Callable[..., Path]) -> None:
    """"bf16" residency keeps whatever the file stores; an F32 file maps as FP32 and skips the upcast."""
    folder = make_checkpoint(dtype="F32", num_attention_heads=8, num_key_value_heads=2)
    fast_model, plain_model = load_pair(folder, "bf16")
    assert fast_model.lm_head.dtype == np.float32 and not fast_model.lm_head.flags.writeable
    assert_logits_match(fast_model.forward(PROMPT), plain_model.forward(PROMPT), "F32 stored, mapped")


def test_trace_takes_the_readable_path(checkpoint: Path) -> None:
    """A traced call must see every intermediate, so it always runs the plain code."""
    model, _ = load_pair(checkpoint, "fp32")
    names: list[str] = []
    model.forward(PROMPT[:3], trace=lambda name, value: names.append(name))
    assert "model.layers.0.self_attn.q_norm" in names and names[-1] == "lm_head"


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_streamed_bf16_rows_split_over_threads(checkpoint: Path, threads: int) -> None:
    """The row split between streaming threads covers every row once, for any thread count."""
    fast_model, plain_model = load_pair(checkpoint, "bf16")
    before = runtime.threads()
    try:
        runtime.set_threads(threads)
        assert_logits_match(fast_model.forward(PROMPT), plain_model.forward(PROMPT), f"{threads} threads")
        assert all(info["num_threads"] == threads for info in runtime.blas_info())
    finally:
        runtime.set_threads(before)


def test_bf16_decode_never_materialises_a_whole_fp32_weight(make_checkpoint: Callable[..., Path]) -> None:
    """A decode step in bf16 mode upcasts blocks of rows, never a whole FP32 copy of lm_head."""
    folder = make_checkpoint(vocab_size=16384, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=32)
    model = qwen_np.load_model(folder, memory="bf16", max_tokens=16)
    cache = model.new_cache(16)
    model.forward(PROMPT[:4], cache)
    model.forward([1], cache)                     # first decode step allocates the reused buffers
    lm_head_fp32 = model.lm_head.nbytes * 2       # 8 MiB: FP32 is twice the stored BF16
    tracemalloc.start()
    try:
        model.forward([2], cache)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert isinstance(model.lm_head, StoredRows)
    assert peak < lm_head_fp32 / 8, f"decode step peaked at {peak} bytes; lm_head in FP32 is {lm_head_fp32}"


def test_scratch_is_reused_by_its_thread_grown_when_too_small_and_never_shared_between_threads() -> None:
    """numerics.scratch, the fast path's per-block buffers: the same memory each call of a thread (no fresh
    pages per block), another thread's own."""
    first = numerics.scratch("test.scratch", (64, 32))
    smaller = numerics.scratch("test.scratch", (16,), np.int32)
    assert first.shape == (64, 32) and first.dtype == np.float32 and first.flags.c_contiguous
    assert np.shares_memory(first, smaller) and smaller.shape == (16,) and smaller.dtype == np.int32
    elsewhere: list[np.ndarray] = []
    worker = threading.Thread(target=lambda: elsewhere.append(numerics.scratch("test.scratch", (64, 32))))
    worker.start()
    worker.join()
    assert not np.shares_memory(first, elsewhere[0])
    grown = numerics.scratch("test.scratch", (128, 32))
    assert not np.shares_memory(first, grown) and np.shares_memory(grown, numerics.scratch("test.scratch", (64, 32)))


def test_fp32_load_fuses_projections_without_copying(checkpoint: Path) -> None:
    """load_model puts a layer's matrices back to back, so q|k|v and gate|up are views, not copies."""
    model = qwen_np.load_model(checkpoint, memory="fp32", max_tokens=16, fast=True)
    for i, w in enumerate(model.layers):
        qkv, gate_up = model.fused_weights(i)
        block = w.o_proj.base
        assert qkv.base is block and gate_up.base is block
        np.testing.assert_array_equal(qkv, np.concatenate([w.q_proj, w.k_proj, w.v_proj]))


def test_back_to_back_view_finds_what_back_to_back_carved_as_a_view_and_nothing_else() -> None:
    """The fast path's fused q|k|v is loading.back_to_back's memory, never a copy (which would go stale when
    training updates the layer's own arrays in place); anything not laid out so is multiplied part by part."""
    from qwen_np.engine.loading import back_to_back

    q, k, v, o = back_to_back([(4, 3), (2, 3), (2, 3), (3, 4)])
    joined = fast.back_to_back_view([q, k, v])
    assert joined is not None and joined.shape == (8, 3) and joined.base is q.base
    q[0, 0] = 7.0                                                    # an update in place is seen
    np.testing.assert_array_equal(joined, np.concatenate([q, k, v]))
    assert fast.back_to_back_view([q, v]) is None                    # same allocation, a gap between
    assert fast.back_to_back_view([k, q]) is None                    # back to back, but out of order
    assert fast.back_to_back_view([v, o]) is None                    # adjacent, rows of another width
    assert fast.back_to_back_view([q, np.ones((2, 3), np.float32)]) is None     # separate allocations
    assert fast.back_to_back_view([q.T, k.T]) is None                # not C-contiguous


def test_fast_path_sees_weights_updated_in_place_or_replaced(checkpoint: Path) -> None:
    """Training updates the weights in place (or assigns new arrays): the next forward must use them."""
    fast_model, plain_model = load_pair(checkpoint, "fp32")
    fast_model.forward(PROMPT)                                        # fused views and buffers exist now
    for model in (fast_model, plain_model):
        w = model.layers[1]
        w.q_proj *= 1.5
        w.up_proj[:] = w.up_proj[::-1]
        w.k_norm += 0.25
        w.gate_proj = w.gate_proj * 0.5                               # a new array, not in place
    assert_logits_match(fast_model.forward(PROMPT), plain_model.forward(PROMPT), "after updates")


@pytest.mark.parametrize("threads", [2, 3])
def test_prefill_steps_split_by_rows_give_the_same_logits(checkpoint: Path, threads: int,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """With BF16 weights a prompt's norms, RoPE, attention and SiLU run as row slices on our threads."""
    fast_model, plain_model = load_pair(checkpoint, "bf16")
    prompt = np.resize(PROMPT, 23)
    splits: list[int] = []
    original = runtime.split
    monkeypatch.setattr(runtime, "split", lambda n, parts, job: (splits.append(n), original(n, parts, job))[1])
    monkeypatch.setattr(fast, "MIN_ROWS_PER_THREAD", 2)
    before = runtime.threads()
    try:
        runtime.set_threads(threads)
        fast_cache, plain_cache = fast_model.new_cache(40), plain_model.new_cache(40)
        assert_logits_match(fast_model.forward(prompt, fast_cache), plain_model.forward(prompt, plain_cache), "split")
        assert_logits_match(fast_model.forward(prompt[:9], fast_cache), plain_model.forward(prompt[:9], plain_cache),
                           "split, after a cached prefix")
    finally:
        runtime.set_threads(before)
    assert 23 in splits and 9 in splits          # row splits happened (the others split weight rows)


@pytest.mark.parametrize("small_kernel", [True, False], ids=["small-matrix kernel", "GEMVs"])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("memory", MODES)
def test_few_row_products_in_weight_slices_give_the_same_logits(checkpoint: Path, memory: str, threads: int,
                                                               small_kernel: bool,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A few tokens (2..SMALL_M_MAX, or MATVEC_M_MAX) multiply W a few rows at a time, on every thread:
    W_s x^T where BLAS has a small-matrix kernel, else one GEMV per row of x (whatever kernel runs here)."""
    monkeypatch.setattr(runtime, "blas_has_small_matrix_kernel", lambda: small_kernel)
    monkeypatch.setattr(fast, "SMALL_PRODUCT", 3 * 32 * 5)        # M = 3, 32 columns: 5-row slices; else 1 call
    monkeypatch.setattr(fast, "SMALL_ROWS_MIN", 5)                # several per thread, a short last one
    monkeypatch.setattr(fast, "MATVEC_SLICE_BYTES", 4 * 32 * 5)   # 32 columns: 5-row slices
    monkeypatch.setattr(fast, "GIL_FREE_OUTPUT", 1)               # (not widened to let go of the GIL)
    slices: list[int] = []
    for name in ("matmul", "matvec", "dot"):
        original = getattr(np, name)
        monkeypatch.setattr(fast.np, name, lambda a, b, original=original, **kw: (slices.extend((len(a), b.shape[-1])),
                                                                                  original(a, b, **kw))[1])
    fast_model, plain_model = load_pair(checkpoint, memory)
    before = runtime.threads()
    try:
        runtime.set_threads(threads)
        fast_cache, plain_cache = fast_model.new_cache(32), plain_model.new_cache(32)
        chunks = ((0, 3), (3, 4), (4, 20)) if small_kernel else ((0, 3), (3, 4), (4, 13), (13, 20))
        for a, b in chunks:                           # 3 rows, 1 row (a GEMV), 16 (or 9 and 7) rows
            chunk = np.resize(PROMPT, 20)[a:b]
            assert_logits_match(fast_model.forward(chunk, fast_cache), plain_model.forward(chunk, plain_cache),
                               f"{memory}, {threads} threads, tokens {a}-{b}")
    finally:
        runtime.set_threads(before)
    assert 5 in slices                              # weight slices of 5 rows (x W_s^T, or W_s's GEMVs) were multiplied


def test_small_product_rows_slices_only_few_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime, "blas_has_small_matrix_kernel", lambda: True)
    assert fast.small_product_rows(1, 1024) is None               # a GEMV: one call
    assert fast.small_product_rows(fast.SMALL_M_MAX + 1, 1024) is None
    assert fast.small_product_rows(8, 1024) == fast.SMALL_PRODUCT // (8 * 1024)
    assert fast.small_product_rows(16, 10 ** 6) is None           # slices too thin: one call per thread
    assert fast.small_product_rows(5, 256) == fast.SMALL_TN_OUTPUT // 5   # a narrow W: at most 1200 outputs a call


def test_a_few_rows_of_a_small_weight_stay_on_the_calling_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    parts: list[int] = []
    original = runtime.split
    monkeypatch.setattr(runtime, "split", lambda n, count, job: (parts.append(count), original(n, count, job))[1])
    before = runtime.threads()
    try:
        runtime.set_threads(2)
        rng = np.random.default_rng(0)
        for rows, M in ((256, 5), (fast.SPLIT_MIN_BYTES // (4 * 256), 5), (256, fast.SMALL_M_MAX + 1)):
            w, x = rng.standard_normal((rows, 256), dtype=np.float32), rng.standard_normal((M, 256), dtype=np.float32)
            stored = held(w.astype(ml_dtypes.bfloat16)) if M > fast.SMALL_M_MAX else w    # many rows: FP32 takes BLAS
            out = fast.linear(x, stored, np.empty((M, rows), np.float32))
            np.testing.assert_allclose(out, x @ upcast(stored).T, rtol=1e-5, atol=1e-4)   # 256 terms ~25: FP32 order
    finally:
        runtime.set_threads(before)
    assert parts == [1, 2, 2]          # 256 KB at 5 rows: one thread; 4 MiB, or a prompt's rows: both


def test_without_a_small_matrix_kernel_few_rows_are_gemvs_over_slices_that_fit_l2(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime, "blas_has_small_matrix_kernel", lambda: False)
    assert fast.few_rows(fast.MATVEC_M_MAX) and not fast.few_rows(fast.MATVEC_M_MAX + 1) and not fast.few_rows(1)
    assert fast.small_product_rows(5, 1024) == fast.MATVEC_SLICE_BYTES // 4096
    assert fast.small_product_rows(5, 10 ** 6) == 101             # a very wide W: 5 x 101 outputs (GIL_FREE_OUTPUT)
    assert fast.small_product_rows(2, 3072) == 251                # so that np.matvec lets go of the GIL
    assert fast.small_product_rows(fast.MATVEC_M_MAX + 1, 1024) is None
    assert fast.small_product_rows(fast.MATVEC_M_MAX_WIDENED + 1, 1024, widened=True) is None   # a BF16 block: a GEMM


def test_small_matrix_kernel_is_read_from_the_blas_architecture(monkeypatch: pytest.MonkeyPatch) -> None:
    for architecture, has in (("SkylakeX", True), ("Haswell", False), ("Zen", False)):
        monkeypatch.setattr(runtime, "blas_info", lambda a=architecture: [{"architecture": a}])
        runtime.blas_has_small_matrix_kernel.cache_clear()
        assert runtime.blas_has_small_matrix_kernel() is has
    runtime.blas_has_small_matrix_kernel.cache_clear()


# --- Panels: FP32 in the fast path's layout ------------------------------------------------------------

def test_panels_hold_the_same_matrix_and_index_its_rows() -> None:
    P = numerics.PANEL
    w = np.random.default_rng(0).standard_normal((3 * P, 7), dtype=np.float32)
    held_w = panels(w)
    assert held_w.shape == w.shape and held_w.values.shape == (3, 7, P) and held_w.nbytes == w.nbytes
    np.testing.assert_array_equal(upcast(held_w), w)                                   # widen: W's own rows
    block = held_w[P:3 * P]                                                            # whole panels: still Panels
    assert isinstance(block, Panels) and np.shares_memory(block.values, held_w.values)
    np.testing.assert_array_equal(upcast(block), w[P:])
    ids = np.array([5, 0, 3 * P - 1, 5])                                               # embedding rows of some tokens
    np.testing.assert_array_equal(upcast(held_w[ids]), w[ids])
    np.testing.assert_array_equal(upcast(held_w[1:P + 1]), w[1:P + 1])                  # rows across panels: gathered
    assert numerics.panel_shape((P + 1, 7)) is None and numerics.panel_shape((P,)) is None
    with pytest.raises(ValueError, match="panels"):
        panels(w[1:])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("M", [1, 2, 5, 8, 17, 70])
def test_panel_products_equal_the_plain_product_for_any_row_count(M: int, threads: int,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fast, "SPLIT_MIN_BYTES", 0)               # split between the threads even when small
    rng = np.random.default_rng(M)
    w = rng.standard_normal((8 * numerics.PANEL, 96), dtype=np.float32)
    x = rng.standard_normal((M, 96), dtype=np.float32)
    wide = np.full((M, 3 * w.shape[0]), np.nan, np.float32)       # a column slice of a wider buffer, as q|k|v
    before = runtime.threads()
    try:
        runtime.set_threads(threads)
        with runtime.single_threaded_blas():
            fast.linear(x, panels(w), wide[:, w.shape[0]:2 * w.shape[0]])
    finally:
        runtime.set_threads(before)
    np.testing.assert_allclose(wide[:, w.shape[0]:2 * w.shape[0]], x @ w.T, rtol=1e-5, atol=1e-4)
    assert np.isnan(wide[:, :w.shape[0]]).all() and np.isnan(wide[:, 2 * w.shape[0]:]).all()   # nothing else written


def test_auto_holds_fp32_as_panels_in_a_fast_model_and_fp32_by_name_as_arrays(checkpoint: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """memory="fp32" keeps plain [out, in] arrays (what training updates in place); the default holds
    the matrices that split into whole panels as Panels, fused q|k|v and gate|up too, same logits,
    where BLAS has a small-matrix kernel (else plain arrays: a panel's few rows would take the packing GEMM)."""
    monkeypatch.setattr(runtime, "blas_has_small_matrix_kernel", lambda: False)
    assert isinstance(qwen_np.load_model(checkpoint, max_tokens=64).lm_head, np.ndarray)
    monkeypatch.setattr(runtime, "blas_has_small_matrix_kernel", lambda: True)
    auto = qwen_np.load_model(checkpoint, max_tokens=64)
    fp32, plain = load_pair(checkpoint, "fp32")
    assert auto.plan.mode == fp32.plan.mode == "fp32"
    for i, (w, v) in enumerate(zip(auto.layers, fp32.layers)):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            mine, theirs = getattr(w, name), getattr(v, name)
            assert isinstance(theirs, np.ndarray)
            assert isinstance(mine, Panels) == (numerics.panel_shape(theirs.shape) is not None)
            np.testing.assert_array_equal(upcast(mine), theirs)
        qkv, _ = auto.fused_weights(i)
        if all(isinstance(getattr(w, n), Panels) for n in ("q_proj", "k_proj", "v_proj")):
            assert isinstance(qkv, Panels) and np.shares_memory(qkv.values, w.q_proj.values)
    assert not isinstance(qwen_np.load_model(checkpoint, max_tokens=64, fast=False).lm_head, Panels)
    cache = auto.new_cache(32)
    for a, b in ((0, 7), (7, 11), (11, 12)):                      # a prompt, a few tokens, one token
        assert_logits_match(auto.forward(PROMPT[a:b], cache), plain.forward(PROMPT[:b])[a:], f"auto, tokens {a}-{b}")


def test_one_decode_attention_for_sequences_of_different_lengths_in_runs_gives_each_its_own() -> None:
    """A batch's decoding sequences share one softmax array, padded past each one's keys: every row must
    still get layers.attention over its own keys, whatever their lengths and however they are split in runs."""
    from qwen_np.core import layers

    rng = np.random.default_rng(5)
    H, KVH, Dh = 8, 2, 16
    lengths, rows = (1, 23, 7, 40), []
    q = rng.standard_normal((len(lengths), H, Dh), dtype=np.float32)
    expected = []
    for b, S in enumerate(lengths):
        k, v = (rng.standard_normal((S, KVH, Dh), dtype=np.float32) for _ in range(2))
        cuts = sorted({0, S, *rng.integers(1, S + 1, 2).tolist()})                  # 1-3 runs of positions
        rows.append(fast._Decoding(b, [(k[a:z], v[a:z]) for a, z in zip(cuts[:-1], cuts[1:])]))
        expected.append(layers.attention(q[b:b + 1], k, v, np.array([S - 1]))[0])   # [H*Dh]
    out = np.full((len(lengths), H * Dh), np.nan, np.float32)
    fast._decode_attention(q, rows, out)
    for b in range(len(lengths)):
        np.testing.assert_allclose(out[b], expected[b], rtol=1e-5, atol=1e-6, err_msg=f"row {b}")


def test_decode_attention_over_an_int8_cache_applies_the_scales_to_scores_and_weights_as_to_every_code() -> None:
    """An int8 cache's decode step reads its codes widened but unscaled and multiplies the S scores and the S
    weights a head by the key and value scales: layers.attention over code * scale, to FP32 rounding, beside
    an FP32 row in the same call (whose scores the scales must not touch)."""
    from qwen_np.core import layers
    from qwen_np.core.kv_cache import store

    rng = np.random.default_rng(6)
    H, KVH, Dh, S = 8, 2, 16, 29
    q = rng.standard_normal((2, H, Dh), dtype=np.float32)
    k, v = (rng.standard_normal((S, KVH, Dh), dtype=np.float32) * rng.uniform(0.5, 2, (S, KVH, 1)).astype(np.float32)
            for _ in range(2))
    codes = {name: np.zeros((S, KVH, Dh), np.int8) for name in "kv"}
    scales = {name: np.zeros((S, KVH), np.float32) for name in "kv"}
    for name, x in (("k", k), ("v", v)):
        store(codes[name], scales[name], (slice(None),), x)
    assert len(set(scales["k"].ravel().tolist())) > 1, "scales that differ by position and head"
    widened = {name: codes[name] * scales[name][..., None] for name in "kv"}
    rows = [fast._Decoding(0, [(codes["k"].astype(np.float32), codes["v"].astype(np.float32))], scales["k"], scales["v"]),
            fast._Decoding(1, [(k, v)])]
    out = np.full((2, H * Dh), np.nan, np.float32)
    fast._decode_attention(q, rows, out)
    np.testing.assert_allclose(out[0], layers.attention(q[:1], widened["k"], widened["v"], np.array([S - 1]))[0],
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out[1], layers.attention(q[1:], k, v, np.array([S - 1]))[0], rtol=1e-5, atol=1e-6)


# --- Block kinds (numerics.Grouped): codes multiplied, scales and offsets applied per group ------------

def block_weight(kind: str, rows: int, columns: int, seed: int) -> numerics.Grouped:
    """A [rows, columns] weight of a GGUF block kind (random blocks, FP16 scales ~1e-3: values of a
    trained matrix's size) or of --memory q8_0/q4_0 (quantized normal weights)."""
    from tests.conftest import random_blocks
    from qwen_np.numbers.formats import FormatRows, get_format
    from qwen_np.numbers.ggml_blocks import BlockRows
    from qwen_np.numbers.ggml_repacked import REPACKINGS, RepackedRows

    if kind in ("q8_0", "q4_0"):
        w = 0.05 * np.random.default_rng(seed).standard_normal((rows, columns), np.float32)
        return FormatRows(kind, get_format(kind).quantize(w), columns)
    name, _, repacked = kind.partition("-")                          # "KIND-repacked": as a GGUF's load holds it
    values = 256 if name.endswith("_K") else 32
    blocks = random_blocks(name, rows, columns // values, seed, scales=(2e-4, 2e-3))
    assert not repacked or name in REPACKINGS
    return RepackedRows.from_blocks(name, blocks) if repacked else BlockRows(name, blocks)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("M", [1, 2, 5, 8, 16, 17, fast.GROUPED_M_MAX, fast.GROUPED_M_MAX + 1])
@pytest.mark.parametrize("kind", ["Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "q8_0", "q4_0",
                                  "Q8_0-repacked", "Q4_0-repacked", "Q4_K-repacked", "Q6_K-repacked"])
def test_block_kinds_products_equal_the_readable_widen_then_multiply(kind: str, M: int, threads: int,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """fast.linear of a block kind (up to GROUPED_M_MAX rows: scales folded out of the codes' product; more:
    widened blocks) equals layers.linear, the readable definition (widen a block of rows, multiply), for one
    row and a few, split between threads, over several decode calls and tiles with a short last one each."""
    from qwen_np.core import layers

    monkeypatch.setattr(fast, "SPLIT_MIN_BYTES", 0)
    monkeypatch.setattr(fast, "GROUPED_DECODE_VALUES", 37 * 512)     # 37 rows a groups() call,
    monkeypatch.setattr(fast, "GROUPED_BLOCK_BYTES", 4 * 512 * 10)   # 10 a tile
    weight = block_weight(kind, 203, 512, seed=M)
    x = np.random.default_rng(M + 1).standard_normal((M, 512), dtype=np.float32)
    wide = np.full((M, 3 * 203), np.nan, np.float32)                # a column slice of a wider buffer, as q|k|v
    before = runtime.threads()
    try:
        runtime.set_threads(threads)
        with runtime.single_threaded_blas():
            fast.linear(x, weight, wide[:, 203:406])
    finally:
        runtime.set_threads(before)
    want = layers.linear(x, weight)
    assert_logits_match(wide[:, 203:406], want, f"{kind}, {M} rows")            # outputs, held to the one rule
    assert np.isnan(wide[:, :203]).all() and np.isnan(wide[:, 406:]).all()


@pytest.mark.parametrize("M", [2, 5, fast.SMALL_M_MAX])
@pytest.mark.parametrize("kind", ["Q4_K-repacked", "Q8_0-repacked", "q4_0", "Q5_K"])
def test_block_kinds_products_in_small_kernel_tiles_equal_the_readable_path(kind: str, M: int,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Where BLAS has the small-matrix kernel, a few rows' grouped products (groups of 32) run in tiles of
    at most SMALL_TN_OUTPUT / M rows (here forced to 7, with a short last one): the same outputs as
    layers.linear."""
    from qwen_np.core import layers

    monkeypatch.setattr(runtime, "blas_has_small_matrix_kernel", lambda: True)
    monkeypatch.setattr(fast, "SMALL_TN_OUTPUT", 7 * M)
    weight = block_weight(kind, 101, 512, seed=M)
    x = np.random.default_rng(M + 1).standard_normal((M, 512), dtype=np.float32)
    out = np.full((M, 101), np.nan, np.float32)
    with runtime.single_threaded_blas():
        fast.linear(x, weight, out)
    assert_logits_match(out, layers.linear(x, weight), f"{kind}, {M} rows in 7-row tiles")
