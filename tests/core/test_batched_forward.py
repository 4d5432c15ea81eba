"""forward_batch: several sequences in one pass, each with its own cache, length and positions,
gets the logits each gets alone (transformers' stored logits, and the single-sequence path).

Rows are packed one after another and attend only over their own keys, so a row next to a longer,
shorter, uncached or still-prefilling row must see exactly what it sees alone, up to BLAS rounding.
"""

from __future__ import annotations

import numpy as np
import pytest

import qwen_np
from qwen_np.errors import QwenNPError

from tests.core.test_reference_fixtures import FIXTURE_NAMES, RUN_MODES, load_fixture
from tests.reference.logit_match import assert_logits_match


@pytest.mark.parametrize("mode", sorted(RUN_MODES))
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_rows_joining_and_leaving_a_batch_match_transformers_at_every_step(name: str, mode: str) -> None:
    """Continuous batching on a fixture: rows with different fills prefill together, decode together,
    one joins mid-way with its prompt while the others decode, one leaves early; every row's logits
    equal transformers' at its own positions."""
    model, reference = load_fixture(name, mode)
    ids, expected = reference["input_ids"], reference["logits"]
    n = min(len(ids), 48)
    starts = {"a": n // 2, "b": 3, "c": n // 4}     # prompt lengths; "c" joins after 4 decode steps
    caches = {row: model.new_cache(n) for row in starts}
    fed = dict(starts)
    leaves = {"b": starts["b"] + 6}                  # "b" leaves after 6 tokens

    logits = model.forward_batch([ids[:starts["a"]], ids[:starts["b"]]], [caches["a"], caches["b"]])
    assert_logits_match(logits[:starts["a"]], expected[:starts["a"]], f"{name} {mode} row a prefill")
    assert_logits_match(logits[starts["a"]:], expected[:starts["b"]], f"{name} {mode} row b prefill")
    active, step = ["a", "b"], 0
    while active:
        if step == 4:
            active.append("c")
        feed = [ids[:fed[row]] if row == "c" and fed[row] == starts["c"] and caches[row].length == 0
                else ids[fed[row]:fed[row] + 1] for row in active]
        logits = model.forward_batch(feed, [caches[row] for row in active], last_only=True)       # [B, V]
        for row, row_logits in zip(active, logits):
            fed[row] = caches[row].length
            assert_logits_match(row_logits[None], expected[fed[row] - 1:fed[row]], f"{name} {mode} row {row} "
                                f"position {fed[row] - 1} in a batch of {len(active)}")
        active = [row for row in active if fed[row] < min(n, leaves.get(row, n))]
        step += 1
    assert all(fed[row] == min(n, leaves.get(row, n)) for row in starts)


@pytest.fixture(scope="module", params=["fast", "readable"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> qwen_np.Qwen3Model:
    from tests.conftest import write_random_checkpoint
    folder = write_random_checkpoint(tmp_path_factory.mktemp("batch"), seed=3, num_attention_heads=8,
                                     num_key_value_heads=2, head_dim=12)
    return qwen_np.load_model(folder, memory="fp32", fast=request.param == "fast")


def test_a_batched_decode_step_gives_each_row_its_single_sequence_logits(model: qwen_np.Qwen3Model) -> None:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 96, size) for size in (1, 7, 30, 12, 64, 2, 19, 5)]
    alone, batch = [model.new_cache(80) for _ in prompts], [model.new_cache(80) for _ in prompts]
    expected = [model.forward(p, cache, last_only=True)[0] for p, cache in zip(prompts, alone)]
    got = model.forward_batch(prompts, batch, last_only=True)
    for step in range(6):
        for row, (want, have) in enumerate(zip(expected, got)):
            assert_logits_match(have, want, f"row {row}, step {step}")
        tokens = [[int(row_logits.argmax())] for row_logits in expected]
        expected = [model.forward(t, cache)[0] for t, cache in zip(tokens, alone)]
        got = model.forward_batch(tokens, batch)
    assert [c.length for c in batch] == [c.length for c in alone] == [len(p) + 6 for p in prompts]


def test_full_logits_of_a_batch_are_each_sequence_uncached_one_after_another(model: qwen_np.Qwen3Model) -> None:
    prompts = [[5, 17, 3], [88, 42, 9, 61, 0, 95], [33]]
    got = model.forward_batch(prompts, [None, None, None])                      # [3 + 6 + 1, V]
    want = np.concatenate([model.forward(p) for p in prompts])
    assert_logits_match(got, want, "three rows uncached")


def test_a_row_never_sees_another_rows_tokens(model: qwen_np.Qwen3Model) -> None:
    """Changing every token of the other rows leaves a row's logits as they were (no cross-talk)."""
    first = model.forward_batch([[1, 2, 3, 4], [5, 6]], [None, None], last_only=True)
    second = model.forward_batch([[9, 9, 9, 9, 9, 9, 9], [5, 6]], [None, None], last_only=True)
    assert_logits_match(second[1], first[1], "row 1 beside other tokens")


def test_bad_batches_are_refused(model: qwen_np.Qwen3Model) -> None:
    cache = model.new_cache(8)
    with pytest.raises(QwenNPError, match="same KV cache"):
        model.forward_batch([[1], [2]], [cache, cache])
    with pytest.raises(QwenNPError, match="2 sequences of token ids for 1 caches"):
        model.forward_batch([[1], [2]], [cache])
    with pytest.raises(QwenNPError, match="exceed"):
        model.forward_batch([[1] * 9, [2]], [cache, None])
    assert cache.length == 0
