"""Speculative decoding (qwen_np/generation/speculative.py): greedy output is plain greedy's on every fixture, whatever
the drafter (another random model, the model itself, prompt lookup) and wherever the sequence ends (EOS,
a stop string, max_new_tokens in the middle of an accepted draft); sampled output keeps the target's
distribution (the rejection rule on hand-made p and q, and whole generations against the exact
marginals); the batcher's speculative rows equal plain ones; the CLI refuses a draft of another vocabulary."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from scipy import stats as scipy_stats

from qwen_np import cli
from qwen_np.generation.batching import BatchGenerator, Request
from qwen_np.files.checkpoint import bundled_model_path
from qwen_np.errors import QwenNPError
from qwen_np.engine.fast import FastQwen3Model
from qwen_np.generation.generate import ChatSession, GenerationStats, generate
from qwen_np.engine.paged import BLOCK_SIZE, BlockPool, PagedKVCache
from qwen_np.engine.loading import load_model
from qwen_np.files.model_files import read_config, read_tokenizer
from qwen_np.core.model import Qwen3Model
from qwen_np.core.sampling import SamplingParams, processed_logits, softmax
from qwen_np.generation.speculative import PromptLookup, accept, check_draft, draft_speculation, lookup_speculation

from tests.conftest import QWEN3_RANDOM, write_random_checkpoint
from tests.reference.logit_match import assert_logits_match

BUNDLED = bundled_model_path()
GREEDY = SamplingParams(temperature=0.0)
# The significance below which a fixed-seed chi-square test fails: its seeds are fixed, so it passes or
# fails the same way every run; 1e-3 leaves room for an unlucky but correct seed.
ALPHA = 1e-3


def events(model, tokenizer, prompt, params, n, **kwargs):
    return [(e.token_id, e.text, e.finish_reason) for e in generate(model, tokenizer, prompt, params, n, **kwargs)]


@pytest.fixture(scope="module")
def random_pair(tmp_path_factory):
    """A random tiny Qwen3 and a different random one of the same vocabulary (a poor draft)."""
    folder = tmp_path_factory.mktemp("spec")
    return (load_model(write_random_checkpoint(folder / "target", seed=0)),
            load_model(write_random_checkpoint(folder / "draft", seed=1, num_hidden_layers=1)))


@pytest.fixture(scope="module")
def fixtures(random_pair, tmp_path_factory):
    """(name, target, draft, tokenizer, prompt ids) for every fixture: the bundled model with a random draft
    of its vocabulary, the random checkpoints with the real tokenizer, the Qwen3 fixture with a random draft."""
    folder = tmp_path_factory.mktemp("spec_drafts")
    bundled, bundled_tok = load_model(BUNDLED), read_tokenizer(BUNDLED)
    qwen, qwen_tok = load_model(QWEN3_RANDOM), read_tokenizer(QWEN3_RANDOM)
    target, draft = random_pair
    return [("bundled", bundled, load_model(write_random_checkpoint(folder / "b", seed=2, vocab_size=2048)),
             bundled_tok, bundled_tok.encode("ROMEO:\nWhat light is this?\n")),
            ("random", target, draft, None, [3, 14, 15, 9, 26, 5, 3, 14]),
            ("qwen3_tokenizer_random", qwen,
             load_model(write_random_checkpoint(folder / "q", seed=3, vocab_size=qwen.config.vocab_size)),
             qwen_tok, qwen_tok.encode("The quick brown fox jumps over the lazy dog. The quick brown"))]


def _draft_passes(monkeypatch, draft) -> list[list[int]]:
    """Each forward pass of `draft` from now on, as the number of tokens it fed each row."""
    passes: list[list[int]] = []
    original = draft.forward_batch

    def counted(ids, caches, *args, **kwargs):
        passes.append([len(row) for row in ids])
        return original(ids, caches, *args, **kwargs)

    monkeypatch.setattr(draft, "forward_batch", counted)
    return passes


def _drafters(target, draft):
    return {"other model": draft_speculation(draft, 4), "same model": draft_speculation(target, 3),
            "lookup": lookup_speculation(3, 4), "lookup k=1": lookup_speculation(1, 1)}


@pytest.mark.slow
def test_speculative_greedy_equals_plain_greedy_on_every_fixture_and_drafter(fixtures, tok) -> None:
    for name, target, draft, tokenizer, prompt in fixtures:
        tokenizer = tokenizer or tok
        for n in (1, 2, 7, 40):             # 7: max_new_tokens reached inside an accepted draft of 4
            plain = events(target, tokenizer, prompt, GREEDY, n)
            for drafter, speculation in _drafters(target, draft).items():
                assert events(target, tokenizer, prompt, GREEDY, n, speculation=speculation) == plain, (name, drafter, n)


@pytest.mark.slow
def test_speculative_greedy_ends_at_the_same_eos_and_stop_string(fixtures, tok) -> None:
    for name, target, draft, tokenizer, prompt in fixtures:
        tokenizer = tokenizer or tok
        plain = events(target, tokenizer, prompt, GREEDY, 30)
        eos = [plain[9][0]]                                       # its 10th token ends the sequence
        text = "".join(t for _, t, _ in plain)
        stop = [text[len(text) // 2:len(text) // 2 + 3]] if len(text) > 8 else []
        for drafter, speculation in _drafters(target, draft).items():
            for kwargs in ({"eos_token_ids": eos}, {"stop": stop}):
                expected = events(target, tokenizer, prompt, GREEDY, 30, **kwargs)
                assert events(target, tokenizer, prompt, GREEDY, 30, speculation=speculation, **kwargs) == expected, \
                    (name, drafter, kwargs)


def test_the_model_drafting_for_itself_is_always_accepted_and_the_stats_say_so(random_pair, tok) -> None:
    target, _ = random_pair
    stats = GenerationStats()
    out = events(target, tok, [3, 14, 15], GREEDY, 21, speculation=draft_speculation(target, 4), stats=stats)
    assert len(out) == 21 and stats.counts.acceptance_rate == 1.0
    counts = stats.counts
    assert counts.target_steps == 5 and counts.tokens_per_step(stats.new_tokens) == 21 / 5      # prefill's token, then 4 of 4 + 1
    assert "speculative=draft accepted=16/16(100%) tokens_per_step=4.20" in stats.summary("m")


@pytest.mark.slow
def test_speculative_greedy_with_penalties_equals_plain_greedy_position_by_position(fixtures, tok) -> None:
    """Repetition and presence penalties depend on the tokens before each drafted position: a model drafting
    for itself (every guess the target's own, k = 4) and lookup must still write plain greedy's tokens."""
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5)
    for name, target, _, tokenizer, prompt in fixtures:
        tokenizer = tokenizer or tok
        plain = events(target, tokenizer, prompt, penalised, 25)
        stats = GenerationStats()
        assert events(target, tokenizer, prompt, penalised, 25, speculation=draft_speculation(target, 4),
                      stats=stats) == plain, name
        # Its guesses are the target's own choices only if both count the drafted tokens before each position.
        counts = stats.counts
        assert counts.accepted_tokens == counts.drafted_tokens and counts.target_steps == 6, (name, stats)   # 1 + 5 x 4 + 4
        assert events(target, tokenizer, prompt, penalised, 25, speculation=lookup_speculation(2, 4)) == plain, name


def test_prompt_lookup_drafts_what_followed_the_earliest_match_of_the_longest_ngram() -> None:
    lookup = PromptLookup(3)
    assert lookup.propose([1, 2, 3, 9, 8, 2, 3, 7, 5, 1, 2, 3], [], 4).tokens == [9, 8, 2, 3]   # 3-gram 1 2 3
    assert lookup.propose([5, 2, 3, 9, 4, 1, 2, 3], [], 2).tokens == [9, 4]                     # 2-gram 2 3
    assert lookup.propose([4, 1, 4], [], 3).tokens == [1, 4]                                    # 1-gram 4, to the end
    assert lookup.propose([1, 2, 3], [], 4).tokens == []                                        # nothing repeats
    assert lookup.propose([7], [], 4).tokens == []


def _chi_square_p(counts: np.ndarray, expected: np.ndarray) -> float:
    """The p-value of observed counts against expected probabilities (cells of no probability must stay empty)."""
    assert counts[expected == 0].sum() == 0
    keep = expected > 0
    return float(scipy_stats.chisquare(counts[keep], expected[keep] * counts.sum()).pvalue)


@pytest.mark.slow
@pytest.mark.parametrize("q", [np.array([0.6, 0.1, 0.1, 0.2, 0.0]), None], ids=["model draft", "one-hot draft"])
def test_the_rejection_rule_emits_tokens_distributed_as_p(q) -> None:
    """x ~ q, then accept(p, q, x): the token is distributed as p (and a token p rules out never comes)."""
    p = np.array([0.1, 0.4, 0.0, 0.2, 0.3])
    rng, draws = np.random.default_rng(0), 20000
    drafted = rng.choice(5, size=draws, p=q) if q is not None else np.full(draws, 3)   # lookup's one guess
    counts = np.bincount([accept(p, q, int(x), rng) for x in drafted], minlength=5)
    assert _chi_square_p(counts, p) > ALPHA


@pytest.mark.slow
def test_sampled_speculative_tokens_follow_the_targets_distribution(tmp_path, tok) -> None:
    """The 2nd and 3rd generated tokens (the first a step drafts and the one after it) over many seeds,
    drafted by a deliberately different model, against their exact marginals under the target's
    processed distributions (temperature, top-k, repetition penalty: computed here position by position)."""
    target = load_model(write_random_checkpoint(tmp_path / "t", seed=4, vocab_size=8))
    draft = load_model(write_random_checkpoint(tmp_path / "d", seed=5, vocab_size=8))
    params, prompt, V = SamplingParams(temperature=1.0, top_k=6, repetition_penalty=1.3), [1, 2], 8

    def p(context: list[int]) -> np.ndarray:
        logits = target.forward(context)[-1]
        return softmax(processed_logits(logits, params, context, context[len(prompt):]))

    first = p(prompt)
    second = {a: p([*prompt, a]) for a in range(V) if first[a] > 0}
    marginal2 = sum(first[a] * second[a] for a in second)
    marginal3 = sum(first[a] * second[a][b] * p([*prompt, a, b]) for a in second for b in range(V) if second[a][b] > 0)
    speculation = draft_speculation(draft, 3)
    tokens = np.array([[e.token_id for e in generate(target, tok, prompt, replace(params, seed=seed), 3,
                                                     speculation=speculation)] for seed in range(1500)])   # [N, 3]
    assert _chi_square_p(np.bincount(tokens[:, 1], minlength=V), marginal2) > ALPHA
    assert _chi_square_p(np.bincount(tokens[:, 2], minlength=V), marginal3) > ALPHA


@pytest.mark.slow
def test_batched_speculative_rows_equal_plain_rows_with_preemption(fixtures, tok) -> None:
    _, target, draft, _, _ = fixtures[1]
    prompts = [[3, 14, 15, 9, 26, 5, 3, 14], [1, 2, 3, 1, 2, 3, 1, 2], list(range(40, 60))]

    def run(speculation, blocks: int) -> list[list[int]]:
        generator = BatchGenerator(target, tok, max_batch=3, speculation=speculation,
                                   pool=BlockPool(target.config, blocks, prefix_caching=True))
        rows = [generator.submit(Request(prompt, GREEDY, 40)) for prompt in prompts]
        while not generator.idle:
            generator.step()
        return [row.generated for row in rows] + [[generator.preemptions]]

    plain = run(None, 12)
    # catch_up=6: a row's draft cache catches up 6 tokens a step (serve's rows: a prefill chunk), undrafted till then.
    for speculation in [*_drafters(target, draft).values(), draft_speculation(draft, 4, catch_up=6)]:
        assert run(speculation, 12)[:3] == plain[:3]
        preempted = run(speculation, 6)                           # too few blocks for all: rows are preempted
        assert preempted[:3] == plain[:3] and preempted[3][0] > 0


def test_a_batchs_rows_draft_together_in_one_draft_pass_per_drafted_token(random_pair, tok, monkeypatch) -> None:
    target, draft = random_pair
    generator = BatchGenerator(target, tok, max_batch=3, speculation=draft_speculation(draft, 3))
    rows = [generator.submit(Request(prompt, GREEDY, 20)) for prompt in ([3, 14, 15], [1, 2, 3, 4], [40, 41])]
    while not all(row.generated for row in rows):
        generator.step()                                            # prefill: every row has its first token
    passes = _draft_passes(monkeypatch, draft)
    generator.step()
    assert [len(rows) for rows in passes] == [3, 3, 3]              # k = 3 drafted tokens: 3 passes of all 3 rows, not 9 of one


def test_a_served_draft_reuses_the_prefix_an_earlier_row_filled(random_pair, tok, monkeypatch) -> None:
    from qwen_np.serving.launch import speculation_over

    target, draft = random_pair
    pool = BlockPool(target.config, 32, prefix_caching=True)
    generator = BatchGenerator(target, tok, max_batch=2, pool=pool, speculation=speculation_over(pool, draft, 2, 3))
    shared = list(range(3, 3 + 3 * BLOCK_SIZE))                      # three whole blocks
    first = generator.submit(Request(shared + [40], GREEDY, 6))
    while not generator.idle:
        generator.step()
    passes = _draft_passes(monkeypatch, draft)
    second = generator.submit(Request(shared + [41, 42], GREEDY, 6))
    while not generator.idle:
        generator.step()
    assert first.generated and second.generated and second.cached_tokens == 3 * BLOCK_SIZE
    assert 0 < sum(map(sum, passes)) < 2 * BLOCK_SIZE              # the draft read the new tokens and its drafts, not the prefix


def test_a_draft_that_catches_up_a_chunk_a_step_drafts_only_once_it_has(random_pair) -> None:
    from qwen_np.generation.speculative import DraftModel

    target, _ = random_pair
    drafter = DraftModel(target, GREEDY, target.new_cache(64), catch_up=4)
    sequence = list(range(3, 13))                                   # 10 tokens: 4 + 4 fed, then drafts
    assert [drafter.propose(sequence, [], 3).tokens for _ in range(2)] == [[], []]
    assert drafter.cache.length == 8 and len(drafter.propose(sequence, [], 3).tokens) == 3


def test_rolling_back_into_a_named_block_unnames_it_so_no_other_sequence_reuses_it(random_pair) -> None:
    target, _ = random_pair
    pool = BlockPool(target.config, 4, prefix_caching=True)
    cache = PagedKVCache(pool, 64)
    rejected = list(range(BLOCK_SIZE + 1))
    target.forward(rejected, cache)                      # fills block 0 and names it by these tokens
    assert pool.cached(cache.table[0])
    cache.truncate(5)                                    # speculation rolls back: positions 5.. get rewritten
    assert not pool.cached(cache.table[0]) and cache.digests == []
    target.forward([7] * BLOCK_SIZE, cache)
    assert PagedKVCache(pool, 64).reuse_prefix(rejected) == 0


@pytest.mark.slow
def test_a_draft_with_another_vocabulary_or_that_is_no_checkpoint_is_one_line_naming_draft(capsys, tmp_path) -> None:
    assert cli.main(["generate", "--no-chat", "ROMEO:", "--draft", str(QWEN3_RANDOM)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --draft: its vocabulary has 151936 ids, the model's 2048: a draft needs the model's tokenizer"]
    assert cli.main(["generate", "--no-chat", "ROMEO:", "--draft", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: --draft: ") and "does not exist" in err[0]


def test_a_draft_with_nan_weights_is_refused_naming_draft_not_the_sampling(capsys, tmp_path) -> None:
    from safetensors.numpy import load_file, save_file

    folder = write_random_checkpoint(tmp_path / "nan", seed=2, vocab_size=2048)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.norm.weight"][:] = np.nan
    save_file(tensors, folder / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((BUNDLED / name).read_bytes())
    assert cli.main(["generate", "--no-chat", "ROMEO:", "--draft", str(folder), "-n", "3"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("note: ")]
    assert len(err) == 1 and err[0].startswith("error: --draft: ") and "finite" in err[0], err


def test_draft_and_lookup_together_are_refused_by_the_parser(capsys) -> None:
    with pytest.raises(SystemExit) as refused:
        cli.main(["generate", "ROMEO:", "--draft", str(QWEN3_RANDOM), "--lookup", "2"])
    assert refused.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


@pytest.mark.slow
def test_the_json_output_has_the_speculation_usage(capsys) -> None:
    assert cli.main(["generate", "--no-chat", "ROMEO:", "-n", "20", "--temperature", "0", "--lookup", "2",
                     "--json", "-q"]) == 0
    reply = json.loads(capsys.readouterr().out)
    usage, details = reply["usage"]["speculative_decoding"], reply["usage"]["completion_tokens_details"]
    model, tokenizer = load_model(BUNDLED), read_tokenizer(BUNDLED)
    stats = GenerationStats()
    events(model, tokenizer, tokenizer.encode("ROMEO:"), GREEDY, 20, speculation=lookup_speculation(2), stats=stats)
    assert (usage["drafted_tokens"], usage["accepted_tokens"], usage["target_steps"]) == (
        stats.counts.drafted_tokens, stats.counts.accepted_tokens, stats.counts.target_steps) and stats.counts.drafted_tokens > 0
    assert details["accepted_prediction_tokens"] == stats.counts.accepted_tokens
    assert details["rejected_prediction_tokens"] == stats.counts.drafted_tokens - stats.counts.accepted_tokens



@pytest.mark.parametrize("path", [FastQwen3Model.forward_batch, Qwen3Model.forward_batch], ids=["fast", "readable"])
def test_forward_batch_tails_are_those_rows_of_the_full_logits(random_pair, path) -> None:
    target, _ = random_pair
    batch = [[3, 14, 15, 9], [26, 5], [7, 7, 7, 7, 7]]

    def run(**kwargs) -> np.ndarray:
        return path(target, batch, [target.new_cache(16) for _ in batch], **kwargs)

    full = run()                                                                   # [11, V]
    # Fewer rows may take another BLAS path (a GEMV for each row, say): equal up to its rounding.
    assert_logits_match(run(tails=[2, 1, 3]), full[[2, 3, 5, 8, 9, 10]], "tails")
    with pytest.raises(QwenNPError, match="tails"):
        run(tails=[3, 3, 1])


@pytest.mark.slow
def test_a_speculative_chat_replies_as_the_plain_one_turn_after_turn(tok) -> None:
    model = load_model(QWEN3_RANDOM)
    sessions = [ChatSession(model, tok, GREEDY, max_tokens=256, speculation=speculation)
                for speculation in (None, lookup_speculation(2, 3), draft_speculation(model, 2))]
    for message in ("Hello there", "And again, hello there"):
        replies = [[e.token_id for e in session.send(message, 12)] for session in sessions]
        assert replies[1] == replies[0] and replies[2] == replies[0]


@pytest.mark.slow
def test_a_chats_draft_reads_only_each_turns_new_tokens(tok, monkeypatch) -> None:
    target, draft = load_model(QWEN3_RANDOM), load_model(QWEN3_RANDOM)     # the draft: a second copy, counted
    session = ChatSession(target, tok, GREEDY, max_tokens=256, speculation=draft_speculation(draft, 3))
    list(session.send("Hello there, how are you today?", 30))
    passes = _draft_passes(monkeypatch, draft)
    stats = GenerationStats()
    list(session.send("And again, hello there", 8, stats=stats))
    # Its first pass reads what the target's prefill read (and the few last tokens of the reply it had not
    # fed, at most k + 1), not the whole conversation again.
    assert stats.cached_tokens > 30 and passes[0][0] <= stats.prompt_tokens + 4, (passes, stats)


def test_speculative_greedy_stops_where_plain_greedy_does_when_the_context_fills(random_pair, tok) -> None:
    target, draft = random_pair
    prompt = [3, 14, 15, 9, 26, 5, 3, 14]
    plain = events(target, tok, prompt, GREEDY, 100, cache=target.new_cache(21))
    assert plain[-1][2] == "context" and len(plain) == 13
    for drafter, speculation in _drafters(target, draft).items():
        assert events(target, tok, prompt, GREEDY, 100, cache=target.new_cache(21), speculation=speculation) == plain, \
            drafter


def test_a_draft_whose_tokenizer_maps_ids_otherwise_is_refused_even_at_the_same_vocabulary_size(tok) -> None:
    bundled = read_config(BUNDLED)
    with pytest.raises(QwenNPError, match="^draft: its tokenizer maps tokens to other ids"):
        check_draft(bundled, read_tokenizer(BUNDLED), bundled, tok)
    check_draft(bundled, read_tokenizer(BUNDLED), read_config(BUNDLED / "draft"), read_tokenizer(BUNDLED / "draft"))
