"""A thinking budget (generation/thinking.py) on the random-weight Qwen3 fixture, whose thinking never ends by
itself: every reply's thinking ends within the budget plus Qwen's closing text, however the tokens are
chosen (greedy, sampled, drafted, batched)."""

from __future__ import annotations

import pytest

from qwen_np import load_model
from qwen_np.core.sampling import SamplingParams
from qwen_np.errors import QwenNPError
from qwen_np.files.tokenizer import THINK_CLOSE, THINK_OPEN, Tokenizer
from qwen_np.generation.batching import BatchGenerator, Request
from qwen_np.generation.generate import generate, prompt_ids
from qwen_np.generation.speculative import lookup_speculation
from qwen_np.generation.thinking import CLOSING, ThinkingBudget
from tests.conftest import BUNDLED, QWEN3_RANDOM

GREEDY = SamplingParams(temperature=0)
SAMPLED = SamplingParams(temperature=1.0, seed=3)


@pytest.fixture(scope="module")
def model():
    return load_model(QWEN3_RANDOM)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_folder(QWEN3_RANDOM)


def thinking_prompt(tok: Tokenizer) -> list[int]:
    """A chat prompt whose reply has begun thinking (the assistant turn opened with <think>)."""
    return prompt_ids(tok, "Why is the sky blue?", enable_thinking=True) + tok.encode(f"{THINK_OPEN}\n",
                                                                                         parse_special=True)


def thinking_of(tok: Tokenizer, reply: list[int]) -> int:
    """How many tokens the reply thinks before Qwen's closing text, which must follow them whole."""
    closing = tok.encode(CLOSING, parse_special=True)
    at = next(i for i in range(len(reply)) if reply[i:i + len(closing)] == closing)
    assert tok.token_to_id(THINK_CLOSE) not in reply[:at]        # it did not close by itself first
    return at


@pytest.mark.parametrize("budget", [0, 1, 7])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_the_thinking_ends_at_the_budget_with_qwens_closing_text_and_the_answer_follows(model, tok, budget,
                                                                                         params) -> None:
    reply = [e.token_id for e in generate(model, tok, thinking_prompt(tok), params, budget + 40,
                                          thinking_budget=budget)]
    assert thinking_of(tok, reply) == budget                      # the random model never stops thinking itself
    assert len(reply) > budget + len(tok.encode(CLOSING, parse_special=True))      # and answers after it
    unbudgeted = [e.token_id for e in generate(model, tok, thinking_prompt(tok), params, budget)]
    assert reply[:budget] == unbudgeted                           # until the budget, the model's own tokens


def test_speculative_and_batched_decoding_keep_the_budget_and_give_plain_decodings_tokens(model, tok) -> None:
    ids = thinking_prompt(tok)
    plain = [e.token_id for e in generate(model, tok, ids, GREEDY, 40, thinking_budget=5)]
    drafted = [e.token_id for e in generate(model, tok, ids, GREEDY, 40, thinking_budget=5,
                                            speculation=lookup_speculation(2, 4))]
    generator = BatchGenerator(model, tok, max_batch=2)
    rows = [generator.submit(Request(ids, GREEDY, 40, thinking_budget=5)),
            generator.submit(Request(ids, SAMPLED, 40, thinking_budget=2))]
    while not generator.idle:
        generator.step()
    assert drafted == plain and rows[0].generated == plain and thinking_of(tok, rows[1].generated) == 2


def test_the_budget_counts_from_the_replys_own_think_and_stops_counting_once_it_closes(tok) -> None:
    opening, closing = tok.token_to_id(THINK_OPEN), tok.token_to_id(THINK_CLOSE)
    word = tok.encode(" word")[0]
    budget = ThinkingBudget(tok, 2, tok.encode("Hello"))          # the prompt does not think: nothing to count
    for token in (word, word, word, opening, word):
        assert budget.forced() is None
        budget.saw(token)
    budget.saw(word)
    assert budget.forced() == tok.encode(CLOSING, parse_special=True)[0]     # two thinking tokens: the budget
    early = ThinkingBudget(tok, 5, [opening])
    for token in (word, closing, word, word, word, word, word):
        early.saw(token)
        assert early.forced() is None                             # closed by itself within the budget


def test_a_budget_for_a_model_that_does_not_think_or_below_zero_is_an_error_naming_it(tok) -> None:
    bundled = Tokenizer.from_folder(BUNDLED)
    with pytest.raises(QwenNPError, match="^thinking_budget: this tokenizer has no <think>"):
        ThinkingBudget(bundled, 4, [])
    with pytest.raises(QwenNPError, match="^thinking_budget: must be >= 0"):
        ThinkingBudget(tok, -1, [])


def test_a_batch_refuses_a_budget_it_cannot_keep_before_the_request_joins(model, tok) -> None:
    generator = BatchGenerator(model, tok, max_batch=1)
    with pytest.raises(QwenNPError, match="^thinking_budget: must be >= 0"):
        generator.check(Request(tok.encode("Hello"), GREEDY, 4, thinking_budget=-1))
    generator.check(Request(tok.encode("Hello"), GREEDY, 4, thinking_budget=0))      # a prompt that does not think
