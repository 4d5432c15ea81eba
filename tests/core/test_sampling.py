"""The sampler's properties, with fixed seeds; and, when torch is installed, transformers' own warpers."""

import warnings

import numpy as np
import pytest

from qwen_np.commands import FLAGS
from qwen_np.errors import QwenNPError
from qwen_np.core.sampling import (SamplingParams, apply_frequency_penalty, apply_logit_bias, apply_mask,
                                   apply_presence_penalty, apply_repetition_penalty, draw, min_p_filter, next_token, pick,
                                   processed_logits, softmax, top_k_filter, top_p_filter, warp)

V = 1000


def random_logits(seed: int, size: int = V, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(size) * scale).astype(np.float32)


def kept(logits: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.isfinite(logits)).tolist())


@pytest.mark.parametrize("field, value, flag", [
    ("temperature", -0.1, "--temperature"), ("top_k", -1, "--top-k"), ("top_p", 0.0, "--top-p"),
    ("top_p", 1.5, "--top-p"), ("min_p", -0.1, "--min-p"), ("min_p", 1.01, "--min-p"),
    ("repetition_penalty", 0.0, "--repetition-penalty"), ("presence_penalty", float("nan"), "--presence-penalty"),
    ("temperature", float("nan"), "--temperature"), ("seed", -3, "--seed"),
    ("temperature", 1e-300, "--temperature"), ("repetition_penalty", 1e-308, "--repetition-penalty"),
])
def test_invalid_settings_name_the_parameter_which_the_command_line_words_as_its_flag(field: str, value: float,
                                                                                    flag: str) -> None:
    with pytest.raises(QwenNPError, match=f"^{field}: .*got") as error:
        SamplingParams(**{field: value})
    assert error.value.param == field and error.value.worded(FLAGS).startswith(f"{flag}: ")


@pytest.mark.parametrize("params, poison", [
    (SamplingParams(temperature=1.0, presence_penalty=-1e308), None),           # overflows float32 to +inf
    (SamplingParams(temperature=0, presence_penalty=-1e308), None),             # greedy too
    (SamplingParams(temperature=0.7, top_p=0.9), np.nan),                       # a model that returns NaN
    (SamplingParams(temperature=0.7), -np.inf),                                 # every token removed
], ids=["overflow", "overflow-greedy", "nan", "all-removed"])
def test_logits_that_make_no_distribution_raise_one_clear_error_without_warnings(params, poison) -> None:
    logits = random_logits(0)
    if poison is not None:
        logits[:] = poison
    with warnings.catch_warnings():
        warnings.simplefilter("error")                  # NumPy's overflow warnings would only repeat the error
        with pytest.raises(QwenNPError, match="^sampling: the next token's logits are not finite"):
            next_token(logits, params, np.random.default_rng(0), [1, 2, 3], [3])


def test_top_p_error_message_reads_as_documented() -> None:
    with pytest.raises(QwenNPError) as error:
        SamplingParams(top_p=1.5)
    assert str(error.value) == "top_p: must be a number in (0, 1] (1 = off), got 1.5"


@pytest.mark.parametrize("seed", range(5))
def test_greedy_is_argmax_whatever_the_warpers(seed: int) -> None:
    logits = random_logits(seed)
    params = SamplingParams(temperature=0, top_k=3, top_p=0.1, min_p=0.9, seed=seed)
    assert next_token(logits, params, np.random.default_rng(seed), [], []) == int(np.argmax(logits))


def test_greedy_still_applies_the_repetition_penalty_like_transformers() -> None:
    logits = np.array([1.0, 3.0, 2.5, -1.0], dtype=np.float32)
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert next_token(logits, params, np.random.default_rng(0), context_ids=[1], generated_ids=[]) == 2


@pytest.mark.parametrize("k", [1, 5, 20])
def test_top_k_never_leaves_the_top_k(k: int) -> None:
    logits = random_logits(k)
    top = set(np.argsort(logits)[-k:].tolist())
    assert kept(top_k_filter(logits, k)) == top
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=1.5, top_k=k)
    draws = {next_token(logits, params, rng, [], []) for _ in range(300)}
    assert draws <= top


def test_top_k_keeps_ties_at_the_threshold_as_transformers_does() -> None:
    logits = np.array([5.0, 4.0, 4.0, 1.0], dtype=np.float32)
    assert kept(top_k_filter(logits, 2)) == {0, 1, 2}


@pytest.mark.parametrize("seed", range(8))
def test_top_p_keeps_the_smallest_set_reaching_p(seed: int) -> None:
    logits = random_logits(seed, size=50, scale=2.0)
    p = float(np.random.default_rng(100 + seed).uniform(0.05, 0.99))
    survivors = kept(top_p_filter(logits, p))
    probs = softmax(logits)
    order = np.argsort(-probs)
    m = len(survivors)
    assert survivors == set(order[:m].tolist()), "the survivors are the most likely tokens"
    assert probs[order[:m]].sum() >= p
    assert m == 1 or probs[order[:m - 1]].sum() < p, "one token fewer would not reach p"


def test_top_p_worked_example() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    assert kept(top_p_filter(logits, 0.75)) == {0, 1}
    assert kept(top_p_filter(logits, 0.4)) == {0}
    assert kept(top_p_filter(logits, 1.0)) == {0, 1, 2, 3}


@pytest.mark.parametrize("min_p", [0.01, 0.2, 0.5, 1.0])
def test_min_p_threshold(min_p: float) -> None:
    logits = random_logits(3, scale=1.5)
    probs = softmax(logits)
    assert kept(min_p_filter(logits, min_p)) == set(np.flatnonzero(probs >= min_p * probs.max()).tolist())


def test_min_p_applies_after_temperature() -> None:
    """Order of transformers' warpers: temperature first, so a hotter distribution keeps more tokens."""
    logits = random_logits(4)
    cold = kept(warp(logits, SamplingParams(temperature=0.5, min_p=0.1)))
    hot = kept(warp(logits, SamplingParams(temperature=2.0, min_p=0.1)))
    assert cold < hot


def test_repetition_penalty_changes_exactly_the_context_tokens() -> None:
    logits = np.array([2.0, -2.0, 1.0, -1.0, 0.5], dtype=np.float32)
    out = apply_repetition_penalty(logits, [0, 1, 1, 1], 2.0)      # repeats are penalised once
    np.testing.assert_array_equal(out, [1.0, -4.0, 1.0, -1.0, 0.5])
    np.testing.assert_array_equal(logits, [2.0, -2.0, 1.0, -1.0, 0.5]), "the input is not modified"


def test_presence_penalty_subtracts_once_per_generated_token() -> None:
    logits = np.array([2.0, -2.0, 1.0, -1.0], dtype=np.float32)
    out = apply_presence_penalty(logits, [2, 2, 2, 3], 0.5)
    np.testing.assert_array_equal(out, [2.0, -2.0, 0.5, -1.5])


def test_presence_penalty_ignores_the_prompt_and_repetition_penalty_does_not() -> None:
    logits = np.array([3.0, 2.9, 0.0], dtype=np.float32)
    greedy = {"temperature": 0}
    assert next_token(logits, SamplingParams(presence_penalty=1.0, **greedy), None, [0], []) == 0
    assert next_token(logits, SamplingParams(presence_penalty=1.0, **greedy), None, [0], [0]) == 1
    assert next_token(logits, SamplingParams(repetition_penalty=1.1, **greedy), None, [0], []) == 1


def test_same_seed_same_output() -> None:
    logits = random_logits(7, scale=1.0)
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9)

    def run(seed: int) -> list[int]:
        rng = np.random.default_rng(seed)
        return [next_token(logits, params, rng, [], []) for _ in range(40)]

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_draw_follows_the_softmax() -> None:
    probs = np.array([0.6, 0.3, 0.1])
    rng = np.random.default_rng(0)
    counts = np.bincount([draw(np.log(probs), rng) for _ in range(20000)], minlength=3)
    np.testing.assert_allclose(counts / counts.sum(), probs, atol=0.015)


def test_draw_never_picks_a_removed_token() -> None:
    logits = np.full(V, -np.inf, dtype=np.float32)
    logits[[3, 500]] = [0.0, 0.1]
    rng = np.random.default_rng(0)
    assert {draw(logits, rng) for _ in range(200)} == {3, 500}


@pytest.mark.slow
@pytest.mark.parametrize("settings", [
    {"temperature": 0.7, "top_k": 20, "top_p": 0.8},
    {"temperature": 1.3, "top_p": 0.5},
    {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.05},
    {"temperature": 2.0, "min_p": 0.2},
    {"temperature": 1.0, "top_k": 7},
])
def test_warpers_match_transformers(settings: dict) -> None:
    """The surviving tokens and their logits equal transformers' warper chain (temperature, top-k, top-p, min-p)."""
    torch = pytest.importorskip("torch")
    logits_process = pytest.importorskip("transformers.generation.logits_process")
    chain = [logits_process.TemperatureLogitsWarper(settings["temperature"])]
    if "top_k" in settings:
        chain.append(logits_process.TopKLogitsWarper(settings["top_k"]))
    if "top_p" in settings:
        chain.append(logits_process.TopPLogitsWarper(settings["top_p"]))
    if "min_p" in settings:
        chain.append(logits_process.MinPLogitsWarper(settings["min_p"]))
    for seed in range(5):
        logits = random_logits(seed, size=V, scale=2.0)
        expected = torch.from_numpy(logits)[None]
        for warper in chain:
            expected = warper(None, expected)
        ours = warp(logits, SamplingParams(**settings))
        np.testing.assert_allclose(ours, expected[0].numpy(), rtol=1e-6)


@pytest.mark.slow
def test_repetition_penalty_matches_transformers() -> None:
    torch = pytest.importorskip("torch")
    logits_process = pytest.importorskip("transformers.generation.logits_process")
    logits = random_logits(9)
    context = [5, 7, 7, 999, 0, 123]
    penalty = logits_process.RepetitionPenaltyLogitsProcessor(1.3)
    expected = penalty(torch.tensor([context]), torch.from_numpy(logits)[None])
    np.testing.assert_array_equal(apply_repetition_penalty(logits, context, 1.3), expected[0].numpy())


def test_draw_at_the_top_of_the_unit_interval_stays_on_a_kept_token() -> None:
    class HighestUniform:
        def random(self) -> float:
            return 1.0 - 2.0 ** -53

    logits = np.array([0.0, 1.0, -np.inf, -np.inf], dtype=np.float32)
    assert draw(logits, HighestUniform()) == 1


# --- OpenAI's sampling fields: frequency penalty, logit bias; the grammar mask's place in the order ---

def test_frequency_and_presence_penalties_are_openais_definition() -> None:
    """logit[j] -= count[j] * frequency + (count[j] > 0) * presence, counting generated tokens only."""
    logits = np.array([2.0, -2.0, 1.0, -1.0, 0.0], dtype=np.float32)
    generated = [2, 2, 2, 3, 0]
    params = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25)
    counts = np.bincount(generated, minlength=5)
    expected = logits - counts * 0.25 - (counts > 0) * 0.5
    np.testing.assert_allclose(processed_logits(logits, params, [4, 4, *generated], generated), expected, rtol=1e-6)
    np.testing.assert_array_equal(apply_frequency_penalty(logits, [], 0.25), logits)
    np.testing.assert_array_equal(logits, [2.0, -2.0, 1.0, -1.0, 0.0]), "the input is not modified"


def test_logit_bias_adds_to_the_listed_tokens_and_minus_100_bans_one() -> None:
    logits = np.array([5.0, 1.0, 0.0], dtype=np.float32)
    np.testing.assert_array_equal(apply_logit_bias(logits, ((0, -3.0), (2, 1.5))), [2.0, 1.0, 1.5])
    banned = SamplingParams(temperature=1.0, logit_bias={0: -100})
    rng = np.random.default_rng(0)
    assert 0 not in {next_token(logits, banned, rng, [], []) for _ in range(200)}
    assert next_token(logits, SamplingParams(temperature=0, logit_bias={2: 100}), rng, [], []) == 2


def test_logit_bias_is_held_sorted_and_hashable_and_bad_entries_name_the_parameter() -> None:
    params = SamplingParams(logit_bias={7: 1, 3: -2.5})
    assert params.logit_bias == ((3, -2.5), (7, 1.0)) and hash(params) == hash(SamplingParams(logit_bias=((7, 1), (3, -2.5))))
    for bad in ({-1: 1.0}, {"5": 1.0}, {5: 101}, {5: float("nan")}, {True: 1.0}):
        with pytest.raises(QwenNPError, match="^logit_bias: "):
            SamplingParams(logit_bias=bad)
    with pytest.raises(QwenNPError, match=r"^logit_bias: token id 1000 is outside the vocabulary \[0, 1000\)"):
        next_token(random_logits(0), SamplingParams(logit_bias={1000: 1.0}), np.random.default_rng(0), [], [])
    with pytest.raises(QwenNPError, match="^frequency_penalty: must be a finite number"):
        SamplingParams(frequency_penalty=float("inf"))


def test_the_grammar_mask_comes_before_the_filters_so_they_keep_only_allowed_tokens() -> None:
    logits = random_logits(3)
    allowed = np.zeros(V, dtype=bool)
    allowed[[10, 20, 30]] = True
    best = max((10, 20, 30), key=lambda i: logits[i])
    # top-k 1 and a tiny top-p would keep only the overall favourite, were they applied before the mask.
    for params in (SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=0.7, top_p=0.01),
                   SamplingParams(temperature=0)):
        processed = processed_logits(logits, params, [], [], allowed)
        assert set(np.flatnonzero(np.isfinite(processed))) <= {10, 20, 30}
        assert pick(processed, params, np.random.default_rng(0)) == best
    rng = np.random.default_rng(1)
    sampled = {pick(processed_logits(logits, SamplingParams(), [], [], allowed), SamplingParams(), rng) for _ in range(300)}
    assert sampled == {10, 20, 30}
    np.testing.assert_array_equal(apply_mask(logits, None), logits)
