"""Log-probabilities of generated tokens (qwen_np/generation/logprobs.py): each event's are a float64
log-softmax of the model's raw logits at its position (within 1e-4; and of transformers' logits within
1e-4), whatever the sampler does to them (temperature, penalties, bias, grammar), the same under
speculative decoding and in the batcher, with the top alternatives most likely first."""

from __future__ import annotations

import numpy as np
import pytest

from qwen_np.core.layers import log_softmax
from qwen_np.core.sampling import SamplingParams
from qwen_np.engine.loading import load_model
from qwen_np.errors import QwenNPError
from qwen_np.files.tokenizer import Tokenizer
from qwen_np.generation.batching import BatchGenerator, Request
from qwen_np.generation.generate import generate, prompt_ids
from qwen_np.generation.logprobs import token_logprobs
from qwen_np.generation.speculative import lookup_speculation

from tests.conftest import QWEN3_RANDOM


@pytest.fixture(scope="module")
def model():
    return load_model(QWEN3_RANDOM, fast=False)


def reference(model, prompt: list[int], generated: list[int]) -> np.ndarray:
    """float64 log-softmax of the model's logits at each generated token's position [N, V], in one pass."""
    logits = model.forward(prompt + generated[:-1])[len(prompt) - 1:]
    return log_softmax(logits)


SETTINGS = [SamplingParams(temperature=0.0),
            SamplingParams(temperature=0.5, top_k=5, presence_penalty=1.5, frequency_penalty=0.7, seed=1,
                           repetition_penalty=1.3, logit_bias={220: 5.0, 11: -100})]


@pytest.mark.parametrize("params", SETTINGS, ids=["greedy", "processed"])
def test_logprobs_are_the_models_raw_log_softmax_whatever_the_sampler_does(model, tok: Tokenizer, params) -> None:
    prompt = prompt_ids(tok, "Count to five.", enable_thinking=False)
    events = list(generate(model, tok, prompt, params, 12, logprobs=5))
    generated = [event.token_id for event in events]
    expected = reference(model, prompt, generated)
    for event, row in zip(events, expected):
        assert event.logprobs is not None
        assert abs(event.logprobs.chosen.logprob - row[event.token_id]) < 1e-4
        best = np.argsort(-row, kind="stable")[:5]
        assert [entry.token_id for entry in event.logprobs.top] == best.tolist()
        np.testing.assert_allclose([entry.logprob for entry in event.logprobs.top], row[best], atol=1e-4)
        if params.greedy:
            assert event.logprobs.top[0].token_id == event.token_id


def test_each_entry_carries_its_tokens_text_and_bytes(tok: Tokenizer) -> None:
    logits = np.zeros(151936, dtype=np.float32)
    nihon = tok.encode("日本")
    partial = next(t for t in range(1000, 151643) if tok.decode([t]).endswith("\ufffd"))    # half a character
    logits[[partial, nihon[0], tok.eos_token_id]] = [3.0, 2.0, 1.0]
    result = token_logprobs(logits, tok.eos_token_id, 3, tok)
    assert (result.chosen.text, result.chosen.bytes) == ("<|im_end|>", b"<|im_end|>")
    assert [entry.token_id for entry in result.top] == [partial, nihon[0], tok.eos_token_id]
    assert result.top[0].bytes == tok.token_bytes(partial) and "\ufffd" in result.top[0].text
    assert b"".join(tok.token_bytes(t) for t in nihon).decode() == "日本"
    assert token_logprobs(logits, 5, 0, tok).top == ()
    exact = np.log(np.exp(3.0) / (np.exp([3.0, 2.0, 1.0]).sum() + 151933))
    assert abs(result.top[0].logprob - exact) < 1e-9


def test_logprobs_match_transformers_logits(model, tok: Tokenizer) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(QWEN3_RANDOM), dtype=torch.float32)
    prompt = prompt_ids(tok, "Hello there", enable_thinking=False)
    events = list(generate(model, tok, prompt, SamplingParams(temperature=0.0), 8, logprobs=0))
    generated = [event.token_id for event in events]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + generated[:-1]])).logits[0, len(prompt) - 1:].double()
    expected = torch.log_softmax(logits, dim=-1).numpy()
    for event, row in zip(events, expected):
        assert abs(event.logprobs.chosen.logprob - row[event.token_id]) < 1e-4


def test_speculative_and_batched_generation_report_the_same_logprobs(tok: Tokenizer) -> None:
    fast = load_model(QWEN3_RANDOM)
    prompt = prompt_ids(tok, "one two three one two three one two", enable_thinking=False)
    greedy = SamplingParams(temperature=0.0)
    plain = list(generate(fast, tok, prompt, greedy, 10, logprobs=2))
    speculated = list(generate(fast, tok, prompt, greedy, 10, logprobs=2, speculation=lookup_speculation(2)))
    generator = BatchGenerator(fast, tok, max_batch=2)
    row = generator.submit(Request(prompt, greedy, 10, logprobs=2))
    generator.submit(Request(prompt[:5], greedy, 4))
    batched = []
    while not generator.idle:
        batched += [event for owner, event in generator.step() if owner is row]
    for other in (speculated, batched):
        assert [e.token_id for e in other] == [e.token_id for e in plain]
        for a, b in zip(other, plain):
            assert a.logprobs.top[1].token_id == b.logprobs.top[1].token_id
            assert abs(a.logprobs.chosen.logprob - b.logprobs.chosen.logprob) < 1e-4


def test_logprobs_are_computed_only_when_asked_for_and_the_count_is_checked(model, tok: Tokenizer) -> None:
    prompt = prompt_ids(tok, "Hi", enable_thinking=False)
    assert all(event.logprobs is None for event in generate(model, tok, prompt, SamplingParams(temperature=0), 3))
    for bad in (21, -1, True, 2.5):
        with pytest.raises(QwenNPError, match=r"^top_logprobs: must be an integer in \[0, 20\]"):
            list(generate(model, tok, prompt, SamplingParams(temperature=0), 3, logprobs=bad))
    with pytest.raises(QwenNPError, match="^top_logprobs: "):
        BatchGenerator(model, tok).submit(Request(prompt, SamplingParams(), 3, logprobs=50))
