"""The KV caches (qwen_np/core/kv_cache.py, contiguous; qwen_np/engine/paged.py, paged) and what the batcher
builds on the paged one: both caches hold the same keys, block tables that scatter a sequence over the pool
give the logits of a full forward pass, a small budget preempts and recomputes rows without changing a
single text, prefix caching prefills only what is new and answers as a cold
run does, unheld cached blocks are evicted least recently used first, and BF16/FP16/int8 caches move the
predictions by a bounded KL divergence (int8: codes within half a scale of each value, the contiguous and
paged caches alike to the bit)."""

from __future__ import annotations

import numpy as np
import pytest

from qwen_np import load_model
from qwen_np.generation.batching import BatchGenerator, Request
from qwen_np.precision.divergence import Comparison
from qwen_np.errors import QwenNPError
from qwen_np.generation.generate import generate
from qwen_np.core.kv_cache import KVCache, kv_dtype, store, widened
from qwen_np.engine.paged import BLOCK_SIZE, BlockPool, PagedKVCache, block_bytes
from qwen_np.engine.sizes import parse_size
from qwen_np.core.sampling import SamplingParams
from qwen_np.files.tokenizer import Tokenizer
from tests.conftest import BUNDLED, QWEN3_RANDOM
from tests.reference.logit_match import RELATIVE_TOLERANCE, assert_logits_match, max_relative_error

GREEDY = SamplingParams(temperature=0)
SEEDED = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=7)


@pytest.fixture(scope="module", params=["fast", "readable"])
def model(request: pytest.FixtureRequest):
    return load_model(QWEN3_RANDOM, fast=request.param == "fast")


def test_the_block_table_maps_position_p_to_slot_p_mod_block_size_of_its_block(model) -> None:
    c, rng = model.config, np.random.default_rng(0)
    pool = BlockPool(c, 8)
    first, second = PagedKVCache(pool, 64), PagedKVCache(pool, 64)
    written: dict[int, list[np.ndarray]] = {id(first): [], id(second): []}
    for cache in (first, second, first, second, second):       # they take blocks in turn
        cache.reserve(BLOCK_SIZE)
        k = rng.standard_normal((BLOCK_SIZE, c.num_key_value_heads, c.head_dim)).astype(np.float32)
        keys, values = cache.append(0, k, -k)
        cache.advance([0] * BLOCK_SIZE)
        written[id(cache)].append(k)
    # Each starts at the lowest free block; first's next one (1) is taken, so it grows in the middle of the
    # longest free stretch (2..7), and second after its own last block: runs that are read in place.
    assert first.table == [0, 5] and second.table == [1, 2, 3]
    assert np.array_equal(pool.keys[0, 2, 20 % BLOCK_SIZE], written[id(second)][1][4])   # position 20: block 2, slot 4
    assert np.array_equal(keys, np.concatenate(written[id(second)])) and np.array_equal(values, -keys)  # in order
    assert [len(k) for k, _ in first.runs(0, 2 * BLOCK_SIZE)] == [BLOCK_SIZE, BLOCK_SIZE]
    assert [len(k) for k, _ in second.runs(0, 40)] == [40]


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["scattered", "in order"])
def test_decode_over_scattered_blocks_equals_the_full_forward(model, kv) -> None:
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, 50)
    full = model.forward(ids)
    pool = BlockPool(model.config, 16)
    if kv == "scattered":
        for odd in range(1, 16, 2):              # every other block held elsewhere: the cache gets 0, 2, 4, 6
            pool.allocate(after=odd - 1)
    cache = PagedKVCache(pool, 64)
    steps = [model.forward(ids[:20], cache)] + [model.forward(ids[i:i + 1], cache) for i in range(20, 50)]
    assert cache.table == ([0, 2, 4, 6] if kv == "scattered" else [0, 1, 2, 3])
    assert_logits_match(np.concatenate(steps), full, f"decode over {kv} blocks")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_contiguous_and_the_paged_cache_hold_the_same_keys_and_give_the_same_logits(model, dtype) -> None:
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, 40)
    contiguous, paged = KVCache(model.config, 48, dtype), PagedKVCache(BlockPool(model.config, 3, dtype), 48)
    logits = {}
    for name, cache in (("contiguous", contiguous), ("paged", paged)):
        steps = [model.forward(ids[:17], cache)] + [model.forward(ids[i:i + 1], cache) for i in range(17, 40)]
        logits[name] = np.concatenate(steps)
        cache.truncate(30)                         # both forget the same positions ...
        logits[name + " again"] = model.forward(ids[30:], cache)       # ... and continue alike
    for name in ("", " again"):              # the fast path reads the two differently: equal up to BLAS sums
        assert_logits_match(logits["contiguous" + name], logits["paged" + name], f"contiguous vs paged{name}")
    for layer in range(model.config.num_hidden_layers):
        keys, values = paged.append(layer, np.zeros((1, *contiguous.keys.shape[2:]), np.float32),
                                    np.zeros((1, *contiguous.keys.shape[2:]), np.float32))
        assert max_relative_error(keys[:40], contiguous.keys[layer, :40].astype(np.float32)) <= RELATIVE_TOLERANCE
        assert max_relative_error(values[:40], contiguous.values[layer, :40].astype(np.float32)) <= RELATIVE_TOLERANCE
    assert contiguous.length == paged.length == 40


def run_batch(generator: BatchGenerator, watch=lambda: None) -> dict[int, list]:
    events: dict[int, list] = {}
    while not generator.idle:
        for row, event in generator.step():
            events.setdefault(row.number, []).append(event)
        watch()
    return events


@pytest.mark.slow
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_many_long_requests_under_a_small_budget_get_their_solo_texts_within_the_budget(model, tok, params) -> None:
    blocks = 24                                   # 384 positions for 6 requests of ~85: they cannot all fit
    pool = BlockPool(model.config, blocks, prefix_caching=True)
    generator = BatchGenerator(model, tok, max_batch=6, pool=pool)
    prompts = [tok.encode(f"Request {i}: tell me a long story about the number {i} and its friends.") for i in range(6)]
    rows = [generator.submit(Request(ids, params, 70)) for ids in prompts]
    held: list[int] = []

    def watch() -> None:
        held.append(sum(len(row.cache.table) for row in generator.rows if row.cache is not None))
        assert pool.used_blocks <= blocks

    events = run_batch(generator, watch)
    assert generator.preemptions > 0 and max(held) <= blocks
    assert pool.keys.nbytes + pool.values.nbytes == blocks * block_bytes(model.config)
    for row, ids in zip(rows, prompts):
        assert events[row.number] == list(generate(model, tok, ids, params, 70)), row.number
    assert pool.used_blocks == 0                 # every block back (some still cached) once all have finished


def test_cancelled_failed_and_finished_rows_give_their_blocks_back(model, tok) -> None:
    pool = BlockPool(model.config, 32, prefix_caching=True)
    generator = BatchGenerator(model, tok, pool=pool)
    rows = [generator.submit(Request(tok.encode(f"Row {i} goes on and on about nothing much."), GREEDY, n))
            for i, n in enumerate((60, 60, 3))]
    for _ in range(5):
        generator.step()
    assert pool.used_blocks > 0 and rows[2].done
    generator.cancel(rows[0])
    generator.fail(RuntimeError("its client broke"), [rows[1]])
    generator.step()
    assert generator.idle and pool.used_blocks == 0


def test_a_request_that_could_never_fit_the_budget_is_refused_at_submit(model, tok) -> None:
    generator = BatchGenerator(model, tok, pool=BlockPool(model.config, 4))     # 64 positions
    with pytest.raises(QwenNPError, match="more than the 64 the whole cache holds"):
        generator.submit(Request(list(range(10)), GREEDY, 55))
    generator.submit(Request(list(range(10)), GREEDY, 54))


def test_a_shared_prefix_is_prefilled_once_and_the_answer_equals_a_cold_run(model, tok) -> None:
    system = tok.encode("You are a helpful assistant who answers every question in full sentences. " * 6)
    first, second = system + tok.encode(" What is a cat?"), system + tok.encode(" Where do penguins live?")
    generator = BatchGenerator(model, tok)
    one = generator.submit(Request(first, GREEDY, 8))
    run_batch(generator)
    before = generator.prefilled_tokens
    two = generator.submit(Request(second, GREEDY, 8))
    events = run_batch(generator)
    shared = len(system) // BLOCK_SIZE * BLOCK_SIZE          # whole blocks of the common prefix
    assert one.cached_tokens == 0 and two.cached_tokens == shared
    assert generator.prefilled_tokens - before == len(second) - shared
    assert events[two.number] == list(generate(model, tok, second, GREEDY, 8))
    assert generator.reused_tokens == shared and generator.prompt_tokens == len(first) + len(second)


def test_a_resent_conversation_reuses_the_previous_turn_and_its_reply(model, tok) -> None:
    generator = BatchGenerator(model, tok)
    turn = tok.encode("Tell me about the sea, the sky and the mountains, in detail please.")
    row = generator.submit(Request(turn, GREEDY, 40))
    run_batch(generator)
    again = generator.submit(Request(turn + row.generated + tok.encode(" And the rivers?"), GREEDY, 4))
    run_batch(generator)
    assert again.cached_tokens == (len(turn) + len(row.generated) - 1) // BLOCK_SIZE * BLOCK_SIZE  # the reply too


def test_unheld_cached_blocks_are_evicted_least_recently_used_first(model) -> None:
    pool = BlockPool(model.config, 3, prefix_caching=True)
    a, b = [list(range(i, i + BLOCK_SIZE)) + [0] for i in (0, 100)]
    for tokens in (a, b):                         # two sequences fill and release one cached block each
        cache = PagedKVCache(pool, 64)
        cache.reserve(len(tokens))
        cache.advance(tokens)
        cache.free()
    assert pool.free_blocks == 3 and pool.used_blocks == 0
    reader = PagedKVCache(pool, 64)
    assert reader.reuse_prefix(a) == BLOCK_SIZE            # a is used again: b is now the least recent
    reader.free()
    pool.allocate()                               # the never-cached block first
    pool.allocate()                               # then evicts b
    assert PagedKVCache(pool, 64).reuse_prefix(b) == 0
    assert PagedKVCache(pool, 64).reuse_prefix(a) == BLOCK_SIZE


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_truncating_into_a_shared_block_copies_it_first(model, dtype) -> None:
    pool = BlockPool(model.config, 4, dtype, prefix_caching=True)
    tokens = list(range(BLOCK_SIZE + 1))
    owner = PagedKVCache(pool, 64)
    model.forward(tokens, owner)
    reader = PagedKVCache(pool, 64)
    assert reader.reuse_prefix(tokens) == BLOCK_SIZE
    kept = pool.keys[:, reader.table[0]].copy()
    reader.truncate(5)
    model.forward([7, 7, 7], reader)              # writes positions 5..7 of its own copy
    assert reader.table[0] != owner.table[0] and np.array_equal(pool.keys[:, owner.table[0]], kept)
    if pool.key_scales is not None:                  # int8: the kept positions' scales came with their codes
        assert np.array_equal(pool.key_scales[:, reader.table[0], :5], pool.key_scales[:, owner.table[0], :5])


@pytest.mark.parametrize("dtype, bound", [("bf16", 1e-4), ("fp16", 1e-6), ("int8", 1e-4)])
def test_a_narrower_cache_shrinks_the_memory_as_block_bytes_says_and_moves_predictions_little(dtype, bound) -> None:
    """KL(FP32 cache || dtype cache) on the bundled Shakespeare model (trained, so its predictions are
    peaked as a real model's are). Measured: BF16 6e-6 nats mean, FP16 9e-8, int8 2.7e-5 (max 2.3e-4),
    top token always the same. Bytes: half of FP32's; int8 a byte a value and an FP32 scale per Dh values."""
    model, tok = load_model(BUNDLED), Tokenizer.from_folder(BUNDLED)
    ids = tok.encode("HAMLET:\nTo be, or not to be, that is the question:\nWhether 'tis nobler in the mind to "
                     "suffer\nThe slings and arrows of outrageous fortune,\nOr to take arms against a sea of troubles\n" * 4)
    caches = {name: model.new_cache(len(ids), name) for name in ("fp32", dtype)}
    logits = {name: np.concatenate([model.forward(ids[i:i + 64], cache) for i in range(0, len(ids), 64)])
              for name, cache in caches.items()}
    comparison = Comparison()
    comparison.add(logits["fp32"][:-1], logits[dtype][:-1], np.array(ids[1:]))
    summary = comparison.summary()
    assert 0 < summary["kld_mean"] < bound and summary["same_top_percent"] == 100
    pool, fp32_bytes, Dh = caches[dtype].pool, caches["fp32"].pool.keys.nbytes * 2, model.config.head_dim
    held = sum(a.nbytes for a in (pool.keys, pool.values, pool.key_scales, pool.value_scales) if a is not None)
    assert held == pool.num_blocks * block_bytes(model.config, dtype)
    assert held * (4 * Dh) == fp32_bytes * (Dh + 4 if dtype == "int8" else 2 * Dh)


def test_int8_codes_are_within_half_a_scale_of_each_value_and_scales_are_absmax_over_127() -> None:
    """Per position and head: scale = max |x| / 127, |x - code * scale| <= scale / 2 (and a few FP32 ulps of
    x: 1/scale and the product are rounded); an all-zero head reads back as zeros."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((20, 4, 32)) * rng.uniform(1e-3, 1e3, (20, 4, 1))).astype(np.float32)   # [T, KVH, Dh]
    x[3, 1] = 0
    codes, scales = np.zeros(x.shape, kv_dtype("int8")), np.zeros(x.shape[:-1], np.float32)
    store(codes, scales, (slice(None),), x)
    read = widened(codes, scales)
    assert read.dtype == np.float32 and np.abs(codes).max() == 127
    np.testing.assert_allclose(scales, np.abs(x).max(axis=-1) / 127, rtol=1e-6)
    assert np.all(np.abs(x - read) <= scales[..., None] / 2 + 4 * np.spacing(np.abs(x)))
    assert not read[3, 1].any()


def test_int8_contiguous_and_paged_caches_hold_the_same_codes_and_give_the_same_logits_exactly(model) -> None:
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, 40)
    pool = BlockPool(model.config, 8, "int8")
    for odd in range(1, 8, 2):                       # every other block held elsewhere: the cache's are scattered
        pool.allocate(after=odd - 1)
    contiguous, paged = KVCache(model.config, 48, "int8"), PagedKVCache(pool, 48)
    logits = {}
    for name, cache in (("contiguous", contiguous), ("paged", paged)):
        steps = [model.forward(ids[:17], cache)] + [model.forward(ids[i:i + 1], cache) for i in range(17, 40)]
        cache.truncate(30)
        logits[name] = np.concatenate([*steps, model.forward(ids[30:], cache)])
    assert paged.table == [0, 2, 4] and np.array_equal(logits["contiguous"], logits["paged"])
    assert pool.key_scales is not None and contiguous.key_scales is not None
    in_order = np.asarray(paged.table)
    for stored, own in ((pool.keys, contiguous.keys), (pool.key_scales, contiguous.key_scales)):
        assert np.array_equal(stored[:, in_order].reshape(own.shape[0], -1, *own.shape[2:])[:, :40], own[:, :40])


def test_greedy_decoding_with_an_int8_cache_gives_the_fp32_cache_s_tokens() -> None:
    model, tok = load_model(BUNDLED), Tokenizer.from_folder(BUNDLED)
    ids = tok.encode("HAMLET:\nTo be, or not to be, that is the question:\n")
    texts = [[event.token_id for event in generate(model, tok, ids, GREEDY, 24, kv_dtype=dtype)] for dtype in ("fp32", "int8")]
    assert texts[0] == texts[1]


def test_an_int8_block_takes_fewer_bytes_than_a_bf16_one_and_a_bad_kv_dtype_names_the_parameter() -> None:
    config = load_model(QWEN3_RANDOM).config
    assert block_bytes(config, "int8") < block_bytes(config, "bf16")
    with pytest.raises(QwenNPError, match="^kv_dtype: expected one of fp32, bf16, fp16, int8, got 'q4'"):
        BlockPool(config, 4, "q4")


@pytest.mark.parametrize("text, size", [("512MiB", 512 * 2 ** 20), ("2GiB", 2 * 2 ** 30), ("1.5GB", 1_500_000_000),
                                        ("64 kib", 65536), ("4096", 4096)])
def test_sizes_read_binary_and_decimal_units(text, size) -> None:
    assert parse_size(text, "kv_memory") == size


@pytest.mark.parametrize("text", ["", "lots", "-1GiB", "2XB", "1e9"])
def test_a_bad_size_names_the_parameter(text) -> None:
    with pytest.raises(QwenNPError, match="^kv_memory: expected a size such as 512MiB"):
        parse_size(text, "kv_memory")
