"""A request's choices (qwen_np/serving/choices.py), through the official `openai` client on the random-weight
Qwen3 fixture: `n` choices of one prompt, each with its index, whole and streamed, seeded seed + i (so the
same seed gives the same n choices, choice 0 the n=1 reply) and sharing one prefill (the 2nd..nth rows take
the prompt's full blocks from the prefix cache: /metrics and the generator's counters say so); completions'
`echo` (the prompt before the text, and with `logprobs` its tokens' log-probabilities, the first null,
equal to a float64 log-softmax of transformers' logits; `max_tokens: 0` scores a text and generates
nothing); `best_of` returning the candidate of highest mean token log-probability; `suffix` refused by name."""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest

from qwen_np import load_model
from qwen_np.core.sampling import SamplingParams
from qwen_np.generation.batching import BatchGenerator, Request
from tests.conftest import HANG_SECONDS, QWEN3_RANDOM
from tests.serving.test_serve import MODEL, ROOT, assert_openai_error, metrics, post, serving

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

pytestmark = pytest.mark.slow      # a server in a subprocess

STORY = "Tell me a story about a dragon who learned to count, and the village that taught it"


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path_factory.mktemp("hf_home")),
           "PYTHONPATH": str(ROOT)}
    with serving(env, MODEL) as server:
        yield server


@pytest.fixture(scope="module")
def client(running):
    return openai.OpenAI(base_url=running.url, api_key="none", max_retries=0, timeout=HANG_SECONDS)


def complete(client, prompt: str = STORY, **kwargs):
    return client.completions.create(model=MODEL, prompt=prompt, **{"max_tokens": 8, **kwargs})


def test_n_seeded_choices_differ_repeat_and_begin_with_the_n1_reply(client) -> None:
    first = complete(client, n=3, temperature=1.0, seed=42)
    assert [choice.index for choice in first.choices] == [0, 1, 2]
    texts = [choice.text for choice in first.choices]
    assert len(set(texts)) == 3                                         # each choice its own seed
    assert [choice.text for choice in complete(client, n=3, temperature=1.0, seed=42).choices] == texts
    assert complete(client, temperature=1.0, seed=42).choices[0].text == texts[0]     # choice 0: seed + 0
    assert complete(client, temperature=1.0, seed=43).choices[0].text == texts[1]     # choice 1: seed + 1
    assert first.usage.prompt_tokens == complete(client, max_tokens=1).usage.prompt_tokens     # counted once
    assert first.usage.completion_tokens == 3 * 8 and first.usage.total_tokens == first.usage.prompt_tokens + 24
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2, max_tokens=4,
                                          temperature=1.0, seed=5)
    assert [choice.index for choice in chat.choices] == [0, 1] and chat.usage.completion_tokens == 8


def test_streamed_choices_carry_their_index_and_equal_the_whole_ones(client) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": STORY}], n=3,
                                           max_tokens=10, temperature=1.0, seed=7)
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": STORY}], n=3,
                                                 max_tokens=10, temperature=1.0, seed=7, stream=True,
                                                 stream_options={"include_usage": True}))
    assert len({chunk.id for chunk in chunks}) == 1
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == choice.finish_reason
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_n_choices_share_one_prefill_through_the_prefix_cache(client, running) -> None:
    prompt = "One summer, long ago, when the rivers ran backwards, a dragon learned to count to forty"   # uncached
    before = metrics(running.url)
    answer = complete(client, prompt, n=4, temperature=1.0, seed=1)
    after = metrics(running.url)
    tokens = answer.usage.prompt_tokens
    shared = 16 * ((tokens - 1) // 16)                       # the full blocks before the last token
    assert shared >= 16 and answer.usage.prompt_tokens_details.cached_tokens == 0       # the first row's
    assert after["prefill_tokens_total"] - before["prefill_tokens_total"] == tokens + 3 * (tokens - shared)
    assert after["prefix_cache_hit_tokens_total"] - before["prefix_cache_hit_tokens_total"] == 3 * shared


def test_rows_of_one_prompt_submitted_together_prefill_it_once(tok) -> None:
    model = load_model(QWEN3_RANDOM)
    generator = BatchGenerator(model, tok, max_batch=4)
    prompt = tok.encode(STORY)
    rows = [generator.submit(Request(prompt, SamplingParams(temperature=1.0, seed=i), 6)) for i in range(4)]
    other = generator.submit(Request(tok.encode("Hello there"), SamplingParams(temperature=0), 6))   # not held back
    generator.step()
    assert [row.cache is not None for row in rows] == [True, False, False, False] and other.cache is not None
    while not generator.idle:
        generator.step()
    shared = 16 * ((len(prompt) - 1) // 16)
    assert generator.prefilled_tokens == len(prompt) + 3 * (len(prompt) - shared) + 2
    assert [row.cached_tokens for row in rows] == [0, shared, shared, shared]
    alone = BatchGenerator(model, tok, max_batch=1)
    for i, row in enumerate(rows):                          # each gets what it gets alone
        single = alone.submit(Request(prompt, SamplingParams(temperature=1.0, seed=i), 6))
        while not alone.idle:
            alone.step()
        assert single.generated == row.generated


@pytest.mark.parametrize("fields, param", [({"n": 0}, "n"), ({"n": 9}, "n"), ({"n": "2"}, "n"),
                                           ({"best_of": 2, "n": 3}, "best_of"), ({"best_of": 9}, "best_of"),
                                           ({"best_of": 3, "stream": True}, "best_of"), ({"echo": "yes"}, "echo"),
                                           ({"suffix": "the end"}, "suffix"), ({"max_tokens": 0}, "max_tokens")])
def test_bad_choice_fields_are_a_400_naming_the_field(running, fields, param) -> None:
    code, answer = post(running.url + "/completions", {"prompt": "Hi", "max_tokens": 2, **fields})
    assert_openai_error(code, answer, 400, param)
    if param == "suffix":
        assert "fill-in-the-middle" in answer["error"]["message"]


def test_echo_puts_the_prompt_before_the_text_whole_and_streamed(client) -> None:
    plain = complete(client, "Once upon a time", temperature=0).choices[0].text
    assert complete(client, "Once upon a time", temperature=0, echo=True).choices[0].text == "Once upon a time" + plain
    chunks = list(complete(client, "Once upon a time", temperature=0, echo=True, stream=True))
    assert chunks[0].choices[0].text == "Once upon a time"
    assert "".join(chunk.choices[0].text for chunk in chunks) == "Once upon a time" + plain


@functools.cache
def reference_model():
    """transformers' Qwen3 of the fixture (FP32), loaded once for every test that scores against it."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(str(QWEN3_RANDOM), torch_dtype=torch.float32).eval()


def reference_logprobs(ids: list[int]) -> np.ndarray:
    """Each token's log-probability given those before it: a float64 log-softmax of transformers' logits."""
    torch = pytest.importorskip("torch")
    with torch.no_grad():
        logits = reference_model()(torch.tensor([ids])).logits[0].double()
    logprobs = torch.log_softmax(logits, dim=-1).numpy()
    return np.array([logprobs[t - 1, ids[t]] for t in range(1, len(ids))])


def test_echo_with_logprobs_and_no_tokens_scores_the_prompt_as_transformers_does(client, tok) -> None:
    text = STORY * 3
    ids = tok.encode(text)
    answer = complete(client, text, max_tokens=0, echo=True, logprobs=2)
    choice = answer.choices[0]
    assert choice.text == text and choice.finish_reason == "length" and answer.usage.completion_tokens == 0
    scored = choice.logprobs
    assert len(scored.tokens) == len(ids) and scored.token_logprobs[0] is None and scored.top_logprobs[0] is None
    assert "".join(scored.tokens) == text and scored.text_offset[:3] == [0, len(scored.tokens[0]),
                                                                         len(scored.tokens[0]) + len(scored.tokens[1])]
    np.testing.assert_allclose(scored.token_logprobs[1:], reference_logprobs(ids), atol=1e-4)
    assert all(len(top) <= 2 for top in scored.top_logprobs[1:])
    generated = complete(client, text, max_tokens=3, echo=True, logprobs=0, temperature=0).choices[0].logprobs
    assert generated.tokens[:len(ids)] == scored.tokens and len(generated.tokens) == len(ids) + 3
    assert generated.token_logprobs[:len(ids)] == scored.token_logprobs
    assert generated.text_offset[len(ids)] == len(text)          # the reply's tokens after the echoed prompt


def test_a_long_prompt_is_scored_in_chunks_as_transformers_does(client, tok) -> None:
    text = " ".join(f"word{i}" for i in range(200))
    ids = tok.encode(text)
    assert len(ids) > 128                                   # several scoring passes (SCORE_CHUNK)
    scored = complete(client, text, max_tokens=0, echo=True, logprobs=0).choices[0].logprobs
    np.testing.assert_allclose(scored.token_logprobs[1:], reference_logprobs(ids), atol=1e-4)


def test_best_of_returns_the_candidate_with_the_highest_mean_token_logprob(client) -> None:
    best = complete(client, best_of=3, temperature=1.0, seed=11)
    candidates = complete(client, n=3, temperature=1.0, seed=11, logprobs=0).choices      # the same rows
    means = [np.mean(choice.logprobs.token_logprobs) for choice in candidates]
    assert best.choices[0].text == candidates[int(np.argmax(means))].text
    assert best.choices[0].logprobs is None and len(best.choices) == 1      # logprobs not asked for
    assert best.usage.completion_tokens == sum(len(choice.logprobs.tokens) for choice in candidates)
    two = complete(client, best_of=3, n=2, temperature=1.0, seed=11)
    assert [choice.text for choice in two.choices] == [candidates[i].text for i in np.argsort(means)[::-1][:2]]
