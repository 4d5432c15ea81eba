"""Continuous batching (qwen_np/generation/batching.py) and stop strings, on the random-weight Qwen3 fixture (real
Qwen3 tokenizer): each request in a shared batch gets what it gets alone, rows join and leave between
steps, cancelled rows leave."""

from __future__ import annotations

import threading

import pytest

from qwen_np import load_model
from qwen_np.generation.batching import BatchGenerator, BatchRunner, Request
from qwen_np.errors import QwenNPError
from qwen_np.generation.generate import StopStrings, TokenEvent, generate
from qwen_np.core.sampling import SamplingParams
from tests.conftest import HANG_SECONDS, QWEN3_RANDOM

GREEDY = SamplingParams(temperature=0)
PROMPTS = ["The quick brown fox", "Hello", "Once upon a time, in a land far away,", "1 2 3 4", "猫日本",
           "Why is the sky blue?", "def main():", "Bonjour"]


@pytest.fixture(scope="module", params=["fast", "readable"])
def model(request: pytest.FixtureRequest):
    return load_model(QWEN3_RANDOM, fast=request.param == "fast")


def alone(model, tok, ids, params, n, stop=()) -> list[TokenEvent]:
    return list(generate(model, tok, ids, params, n, stop=stop))


def run_batch(generator: BatchGenerator) -> dict[int, list[TokenEvent]]:
    events: dict[int, list[TokenEvent]] = {}
    while not generator.idle:
        for row, event in generator.step():
            events.setdefault(row.number, []).append(event)
    return events


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=7)],
                         ids=["greedy", "seeded"])
@pytest.mark.slow
def test_every_row_of_a_batch_gets_what_it_gets_alone(model, tok, params) -> None:
    generator = BatchGenerator(model, tok, max_batch=8)
    sizes = [12, 3, 9, 16, 5, 12, 7, 1]           # rows leave at different steps
    rows = [generator.submit(Request(tok.encode(p), params, n)) for p, n in zip(PROMPTS, sizes)]
    events = run_batch(generator)
    assert max(generator.batch_sizes) == 8
    for row, prompt, n in zip(rows, PROMPTS, sizes):
        expected = alone(model, tok, tok.encode(prompt), params, n)
        assert events[row.number] == expected, prompt
        assert row.finish_reason == "length" and row.generated == [e.token_id for e in expected]


def test_a_new_request_joins_while_others_decode(model, tok) -> None:
    """Continuous batching: the late request's prefill runs at the next step, next to the running rows'
    decode steps, and it finishes long before them."""
    generator = BatchGenerator(model, tok, max_batch=4)
    long_rows = [generator.submit(Request(tok.encode(p), GREEDY, 40)) for p in PROMPTS[:2]]
    for _ in range(5):
        generator.step()
    late = generator.submit(Request(tok.encode(PROMPTS[2]), GREEDY, 3))
    events = run_batch(generator)
    assert generator.batch_sizes[5] == 3                   # the late prefill shares the 6th step
    assert late.finished is not None and all(late.finished < row.finished for row in long_rows)
    assert events[late.number] == alone(model, tok, tok.encode(PROMPTS[2]), GREEDY, 3)


def test_rows_wait_for_room_and_long_prompts_prefill_in_chunks(model, tok) -> None:
    generator = BatchGenerator(model, tok, max_batch=2, prefill_chunk=4)
    rows = [generator.submit(Request(tok.encode(p), GREEDY, 4)) for p in PROMPTS[2:5]]
    events = run_batch(generator)
    assert max(generator.batch_sizes) == 2
    for row, prompt in zip(rows, PROMPTS[2:5]):
        assert events[row.number] == alone(model, tok, tok.encode(prompt), GREEDY, 4)


def test_a_cancelled_row_leaves_and_frees_its_place(model, tok) -> None:
    generator = BatchGenerator(model, tok, max_batch=1)
    first = generator.submit(Request(tok.encode("Hello"), GREEDY, 100))
    second = generator.submit(Request(tok.encode("Bonjour"), GREEDY, 2))
    generator.step()
    generator.step()
    generator.cancel(first)
    events = run_batch(generator)
    assert first.number not in events and not first.done and len(first.generated) == 2
    assert [e.finish_reason for e in events[second.number]] == [None, "length"]
    assert generator.rows == [] and generator.idle


def test_requests_that_cannot_run_are_refused_before_they_join(model, tok) -> None:
    generator = BatchGenerator(model, tok, context=8)
    with pytest.raises(QwenNPError, match="max_new_tokens: must be >= 1"):
        generator.submit(Request([1, 2], GREEDY, 0))
    with pytest.raises(QwenNPError, match="no room"):
        generator.submit(Request(list(range(8)), GREEDY, 1))
    for ids in ([True, False], [1, True], [], [1, model.config.vocab_size], [-1]):   # bools would index as a mask
        with pytest.raises(QwenNPError, match="^prompt: (expected a non-empty 1-D sequence of integers|id .* outside)"):
            generator.submit(Request(ids, GREEDY, 1))
    row = generator.submit(Request(list(range(5)), GREEDY, 50))      # capped by the context
    run_batch(generator)
    assert row.finish_reason == "context" and len(row.generated) == 3


def test_a_row_whose_sampling_fails_ends_alone_and_the_others_get_what_they_get_alone(model, tok) -> None:
    generator = BatchGenerator(model, tok, max_batch=3)
    # Allowed, but it overflows the logits of every generated token: the second draw cannot be made.
    overflowing = SamplingParams(temperature=1.0, presence_penalty=-1e308)
    rows = [generator.submit(Request(tok.encode(p), params, 8))
            for p, params in zip(PROMPTS, [GREEDY, overflowing, GREEDY])]
    events = run_batch(generator)
    failed = events.pop(rows[1].number)
    assert isinstance(failed[0], TokenEvent) and failed[1] is rows[1].error and len(failed) == 2
    assert rows[1].finish_reason == "error" and "not finite" in str(rows[1].error)
    for row in (rows[0], rows[2]):
        assert events[row.number] == alone(model, tok, row.request.prompt, GREEDY, 8)


def test_a_failed_forward_pass_hands_every_row_in_it_that_error(model, tok, monkeypatch) -> None:
    broken = RuntimeError("forward failed")

    def forward_batch(*args, **kwargs):
        raise broken

    monkeypatch.setattr(model, "forward_batch", forward_batch)
    runner = BatchRunner(BatchGenerator(model, tok, max_batch=2))
    received: list = []
    done = threading.Semaphore(0)

    def hear(event) -> None:
        received.append(event)
        done.release()

    runner.start()
    try:
        rows = [runner.submit(Request(tok.encode(p), GREEDY, 4), hear) for p in PROMPTS[:2]]
        assert all(done.acquire(timeout=HANG_SECONDS) for _ in rows)
    finally:
        runner.stop()
    assert received == [broken, broken] and all(row.error is broken and row.done for row in rows)


def test_stop_strings_split_across_tokens_end_the_text_before_them(model, tok) -> None:
    ids = tok.encode("Once upon a time, in a land far away,")
    full = alone(model, tok, ids, GREEDY, 24)
    pieces = [e.text for e in full]
    cut = next(i for i in range(1, len(pieces)) if len(pieces[i - 1]) >= 2 and len(pieces[i]) >= 2)
    stop = pieces[cut - 1][-2:] + pieces[cut][:2]             # straddles tokens cut-1 and cut
    text = "".join(pieces)
    expected = text[:text.index(stop)]
    for events in (alone(model, tok, ids, GREEDY, 24, stop=["never there", stop]),
                   run_batch(_one(model, tok, Request(ids, GREEDY, 24, stop=[stop]))).popitem()[1]):
        assert "".join(e.text for e in events) == expected
        assert events[-1].finish_reason == "stop"
        assert len(events) == cut + 1                       # stops at the token that completes it


def _one(model, tok, request: Request) -> BatchGenerator:
    generator = BatchGenerator(model, tok)
    generator.submit(request)
    return generator


def test_stop_strings_hold_back_only_what_could_still_become_a_stop() -> None:
    stops = StopStrings(["\n\n", "END"])
    assert [stops.push(t) for t in ["Hello", " E", "N", "x\n", "\nfoo"]] == [
        ("Hello", False), (" ", False), ("", False), ("ENx", False), ("", True)]
    stops = StopStrings(["abc"])
    assert [stops.push("xab"), stops.push("d")] == [("x", False), ("abd", False)]
    assert stops.push("ab") == ("", False) and stops.flush() == "ab"


def test_the_background_runner_hands_each_row_its_events(model, tok) -> None:
    runner = BatchRunner(BatchGenerator(model, tok, max_batch=4))
    runner.start()
    try:
        received: dict[int, list] = {i: [] for i in range(4)}
        done = [threading.Event() for _ in range(4)]

        def listener(i: int):
            def hear(event) -> None:
                received[i].append(event)
                if not isinstance(event, TokenEvent) or event.finish_reason:
                    done[i].set()
            return hear

        for i, prompt in enumerate(PROMPTS[:4]):
            runner.submit(Request(tok.encode(prompt), GREEDY, 6), listener(i))
        assert all(event.wait(60) for event in done)
    finally:
        runner.stop()
    for i, prompt in enumerate(PROMPTS[:4]):
        assert received[i] == alone(model, tok, tok.encode(prompt), GREEDY, 6)
