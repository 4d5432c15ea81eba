"""The generation API on the random-weight Qwen3 fixture (the real Qwen3 tokenizer and chat template):
decoding through the cache, stop conditions, stats, chat turns."""

import copy
import dataclasses
import json

import numpy as np
import pytest

import qwen_np.generation.generate as generation
from qwen_np.engine import budget
from qwen_np import load_model
from qwen_np.errors import QwenNPError
from qwen_np.generation.generate import (ChatSession, Chosen, GenerationStats, context_budget, generate, prompt_ids,
                                        resolve_sampling)
from qwen_np.files.model_files import read_generation_defaults
from qwen_np.generation.speculative import lookup_speculation
from qwen_np.core.sampling import SamplingParams
from qwen_np.files.tokenizer import Tokenizer, chat_delta
from tests.conftest import QWEN3_RANDOM
from tests.reference.logit_match import assert_logits_match

GREEDY = SamplingParams(temperature=0)
SAMPLED = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=11)


@pytest.fixture(scope="module")
def model():
    return load_model(QWEN3_RANDOM)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_folder(QWEN3_RANDOM)


def run(model, tok, ids, params=GREEDY, n=8, **kwargs):
    return list(generate(model, tok, ids, params, n, **kwargs))


def test_greedy_decoding_through_the_cache_equals_argmax_of_full_forward_passes(model, tok) -> None:
    ids = tok.encode("The quick brown fox")
    events = run(model, tok, ids, n=6)
    sequence = list(ids)
    for event in events:
        assert event.token_id == int(np.argmax(model.forward(sequence)[-1]))
        sequence.append(event.token_id)


def test_chunked_prefill_gives_the_same_tokens(model, tok, monkeypatch) -> None:
    ids = tok.encode("A prompt long enough to be split into several prefill chunks of four tokens each.")
    whole = [e.token_id for e in run(model, tok, ids)]
    monkeypatch.setattr(budget, "PREFILL_CHUNK", 4)
    assert len(budget.prefill_chunks(len(ids))) > 2
    assert [e.token_id for e in run(model, tok, ids)] == whole


def test_stops_at_max_new_tokens_and_text_is_the_decoded_ids(model, tok) -> None:
    events = run(model, tok, tok.encode("你好，世界"), SAMPLED, n=12)
    assert len(events) == 12
    assert [e.finish_reason for e in events] == [None] * 11 + ["length"]
    assert "".join(e.text for e in events) == tok.decode([e.token_id for e in events])


def test_stops_at_an_eos_id_without_printing_it(model, tok) -> None:
    ids = tok.encode("Hello")
    free = [e.token_id for e in run(model, tok, ids, n=5)]
    events = run(model, tok, ids, n=5, eos_token_ids=[free[2]])
    assert [e.token_id for e in events] == free[:3]
    assert events[-1].finish_reason == "eos"
    assert "".join(e.text for e in events) == tok.decode(free[:2])


def test_stops_when_the_cache_is_full(model, tok) -> None:
    ids = tok.encode("Hello there")
    cache = model.new_cache(len(ids) + 3)
    events = run(model, tok, ids, n=50, cache=cache)
    assert len(events) == 3 and events[-1].finish_reason == "context"


def test_stops_at_the_models_context_limit(model, tok) -> None:
    small = copy.copy(model)
    small.config = dataclasses.replace(model.config, max_position_embeddings=8)
    ids = tok.encode("one two three")                       # 3 tokens
    events = run(small, tok, ids, n=50)
    assert len(ids) + len(events) == 8 and events[-1].finish_reason == "context"


def test_prompt_that_fills_the_context_is_refused(model) -> None:
    with pytest.raises(QwenNPError, match="^prompt: 40960 tokens leave no room"):
        context_budget(model.config, 40960, 1)
    assert context_budget(model.config, 40959, 100) == 40960
    assert context_budget(model.config, 10, 100) == 110
    with pytest.raises(QwenNPError, match="^max_new_tokens: must be >= 0"):
        context_budget(model.config, 10, -1)


def test_zero_new_tokens_only_prefills(model, tok) -> None:
    ids = tok.encode("Hello")
    cache = model.new_cache(10)
    stats = GenerationStats()
    assert run(model, tok, ids, n=0, cache=cache, stats=stats) == []
    assert cache.length == len(ids) and stats.prompt_tokens == len(ids)


def test_same_seed_same_tokens(model, tok) -> None:
    ids = tok.encode("Once upon a time")
    first = [e.token_id for e in run(model, tok, ids, SAMPLED, n=10)]
    assert [e.token_id for e in run(model, tok, ids, SAMPLED, n=10)] == first
    other = dataclasses.replace(SAMPLED, seed=12)
    assert [e.token_id for e in run(model, tok, ids, other, n=10)] != first


@pytest.mark.parametrize("speculation", [None, lookup_speculation(2, 3)], ids=["plain", "lookup"])
def test_an_observer_sees_each_chosen_token_with_its_raw_logits_and_changes_nothing(model, tok, speculation) -> None:
    ids = tok.encode("Once upon a time, once upon a time")
    seen: list[Chosen] = []
    events = run(model, tok, ids, SAMPLED, n=10, speculation=speculation, observe=seen.append)
    assert events == run(model, tok, ids, SAMPLED, n=10, speculation=speculation)
    assert [c.token for c in seen] == [e.token_id for e in events] and all(c.allowed is None for c in seen)
    for i, chosen in enumerate(seen):                    # the model's own logits at that position, unfiltered
        assert_logits_match(chosen.logits, model.forward(ids + [e.token_id for e in events[:i]])[-1], f"step {i}")


def test_trace_sees_the_prefill_and_the_first_decode_step_only(model, tok) -> None:
    ids = tok.encode("Trace me")
    seen = []
    run(model, tok, ids, n=4, trace=lambda name, value: seen.append(value.shape) if name == "lm_head" else None)
    assert seen == [(len(ids), model.config.vocab_size), (1, model.config.vocab_size)]


def test_stats_are_filled_in(model, tok) -> None:
    stats = GenerationStats(load_seconds=1.5)
    ids = tok.encode("Count")
    run(model, tok, ids, n=5, stats=stats)
    counts = (stats.prompt_tokens, stats.cached_tokens, stats.new_tokens, stats.finish_reason)
    assert counts == (len(ids), 0, 5, "length")
    assert stats.prefill_seconds > 0 and stats.decode_seconds > 0
    line = stats.summary("m")
    assert line.startswith("stats: model=m prompt_tokens=") and "load=1.50s" in line and "peak_rss=" in line
    assert "\n" not in line


def test_generation_defaults_come_from_generation_config(model, tmp_path) -> None:
    defaults = read_generation_defaults(QWEN3_RANDOM, model.config)
    assert defaults.sampling == SamplingParams(temperature=0.6, top_k=20, top_p=0.95)
    assert defaults.eos_token_ids == (151645, 151643)
    assert resolve_sampling(defaults, enable_thinking=False) == SamplingParams(temperature=0.7, top_k=20, top_p=0.8)
    assert resolve_sampling(defaults, enable_thinking=False, temperature=0.1, top_k=None).temperature == 0.1
    # Without the file: transformers' defaults, i.e. greedy, and config.json's EOS.
    assert read_generation_defaults(tmp_path, model.config) == generation.GenerationDefaults(
        SamplingParams(temperature=0.0, top_k=50), (151645,))
    (tmp_path / "generation_config.json").write_text("{oops")
    with pytest.raises(QwenNPError, match="generation_config.json: not valid JSON"):
        read_generation_defaults(tmp_path, model.config)
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": True, "top_p": 2}))
    with pytest.raises(QwenNPError, match="generation_config.json: bad sampling setting"):
        read_generation_defaults(tmp_path, model.config)


def test_prompt_ids(tok) -> None:
    assert prompt_ids(tok, "Hello!") == [151644, 872, 198, 9707, 0, 151645, 198, 151644, 77091, 198]
    assert prompt_ids(tok, "Hello!", enable_thinking=False)[-4:] == [151667, 271, 151668, 271]
    assert prompt_ids(tok, "Hello world", chat=False) == [9707, 1879]
    assert prompt_ids(tok, "Hi", system="You are a helpful assistant.")[:4] == [151644, 8948, 198, 2610]
    with pytest.raises(QwenNPError, match="^prompt: empty"):
        prompt_ids(tok, "  ")
    with pytest.raises(QwenNPError, match="^system: a system prompt needs the chat template"):
        prompt_ids(tok, "Hi", chat=False, system="x")


# --- Chat sessions ------------------------------------------------------------------------------

def reply_of(session: ChatSession, text: str, n: int = 6) -> tuple[list[int], GenerationStats]:
    stats = GenerationStats()
    ids = [e.token_id for e in session.send(text, n, stats)]
    return ids, stats


def fresh_reply(model, tok, session: ChatSession, n: int = 6) -> list[int]:
    """What the model answers when the session's whole rendered conversation is run from scratch."""
    ids = chat_delta(tok, [], session.messages, enable_thinking=session.enable_thinking).ids
    return [e.token_id for e in generate(model, tok, ids, session.params, n, eos_token_ids=session.eos_token_ids)]


@pytest.mark.parametrize("enable_thinking", [None, False])
def test_second_turn_prefills_only_the_new_tokens_and_answers_as_from_scratch(model, tok, enable_thinking) -> None:
    session = ChatSession(model, tok, GREEDY, eos_token_ids=[151645], system="Be brief.",
                          enable_thinking=enable_thinking, max_tokens=512)
    first, stats1 = reply_of(session, "Hello!")
    assert stats1.cached_tokens == 0 and stats1.prompt_tokens > 0
    fed_after_first = list(session.fed_ids)
    assert session.cache.length == len(fed_after_first)

    history = list(session.messages)
    second, stats2 = reply_of(session, "And now a second question?")
    full = chat_delta(tok, [], history + [{"role": "user", "content": "And now a second question?"}],
                      enable_thinking=enable_thinking).ids
    assert stats2.cached_tokens + stats2.prompt_tokens == len(full)
    if enable_thinking is None:
        assert stats2.cached_tokens >= stats1.prompt_tokens, "the whole first prompt is reused"
    else:
        # Qwen3's template drops the earlier reply's empty think block (`<think>\n\n</think>\n\n`, 4 tokens
        # at the end of the first prompt), so the cache is cut back to just before it.
        assert stats2.cached_tokens == stats1.prompt_tokens - 4
    session.messages.pop()      # compare with the conversation up to the second user message
    assert second == fresh_reply(model, tok, session)


def test_an_interrupted_reply_is_kept_and_the_chat_goes_on(model, tok) -> None:
    session = ChatSession(model, tok, GREEDY, max_tokens=512)
    stream = session.send("Tell me a long story.", 50)
    partial = [next(stream).token_id for _ in range(3)]
    stream.close()                                      # what Ctrl-C does to the generator
    assert session.messages[-1] == {"role": "assistant", "content": tok.decode(partial)}
    assert session.fed_ids == session.fed_ids[:session.cache.length] and session.cache.length == len(session.fed_ids)
    second, _ = reply_of(session, "Go on.")
    session.messages.pop()
    assert second == fresh_reply(model, tok, session)


def test_chat_refuses_an_empty_message(model, tok) -> None:
    session = ChatSession(model, tok, GREEDY, max_tokens=64)
    with pytest.raises(QwenNPError, match="^chat: empty message"):
        list(session.send(" ", 3))


def test_chat_reports_a_full_context(model, tok) -> None:
    session = ChatSession(model, tok, GREEDY, max_tokens=12)
    with pytest.raises(QwenNPError, match="no room for new tokens in a 12-token context"):
        list(session.send("This message is far too long to fit in twelve positions of cache.", 3))


class ScriptedModel:
    """Stands in for a Qwen3Model: its logits always make the next scripted token the argmax."""

    def __init__(self, config, prompt_length: int, script: list[int]) -> None:
        self.config, self.prompt_length, self.script = config, prompt_length, script

    def new_cache(self, max_tokens: int, dtype: str = "fp32"):
        from qwen_np.core.model import KVCache
        return KVCache(self.config, max_tokens, dtype)

    def forward(self, ids, cache, trace=None, last_only=False):
        cache.advance(ids)                       # as a forward pass counts its tokens into the cache
        logits = np.zeros((1 if last_only else len(ids), self.config.vocab_size), dtype=np.float32)
        logits[-1, self.script[cache.length - self.prompt_length]] = 1.0
        return logits


def test_streamed_text_never_splits_a_character(model, tok) -> None:
    """'𠀋' and '龘' are several byte-level tokens each; no event may hold half of either."""
    script = tok.encode("A𠀋龘 z")
    prompt = tok.encode("Hi")
    events = run(ScriptedModel(model.config, len(prompt), script), tok, prompt, n=len(script))
    assert [e.token_id for e in events] == script
    assert [e.text for e in events] == ["A", "", "", "𠀋", "", "龘", " z"]


def test_the_start_check_passes_finite_weights_and_names_the_layer_of_a_nan(make_checkpoint) -> None:
    """finite.check_weights_finite, what serve runs before it listens: one token through every layer."""
    from qwen_np.engine.finite import check_weights_finite

    model = load_model(make_checkpoint(), memory="fp32")
    check_weights_finite(model)
    model.layers[0].q_proj[3, 5] = np.nan
    with pytest.raises(QwenNPError, match=r"model\.layers\.0 is the first layer whose output is not \(first at "
                                          r"model\.layers\.0\.self_attn\.q_proj\)"):
        check_weights_finite(model)
