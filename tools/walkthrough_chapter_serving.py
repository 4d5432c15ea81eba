"""The walkthrough's section on what a serving engine adds to the model: continuous batching
(qwen_np/generation/batching.py), the paged KV cache's blocks and block table, prefix reuse (qwen_np/engine/paged.py),
and speculative decoding (qwen_np/generation/speculative.py) with both drafters, each run on the bundled model with
greedy decoding. The page prints counts only (rows, blocks, tokens, drafted and kept tokens), which are
the same on every machine; timings are the machine's, and bench/ measures them.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import numpy as np

from qwen_np.generation.batching import BatchGenerator, Request, Row
from qwen_np import load_model
from qwen_np.generation.generate import GenerationStats, generate
from qwen_np.engine.paged import BLOCK_SIZE, BlockPool, PagedKVCache, block_runs
from qwen_np.core.model import Qwen3Model
from qwen_np.core.sampling import SamplingParams
from qwen_np.generation.speculative import DEFAULT_DRAFT_TOKENS, draft_speculation, lookup_speculation
from qwen_np.files.tokenizer import Tokenizer
import walkthrough_common
from walkthrough_common import CACHE_TOLERANCE, PASSAGES, Run, code_block
from walkthrough_training import TRAIN_TEXT, below

GREEDY = SamplingParams(temperature=0)
# (prompt, new tokens): three requests that start together, and one that arrives while they run.
REQUESTS = (("ROMEO:\n", 4), ("JULIET:\nO Romeo,", 8), ("HAMLET:\nTo be, or not to be", 12))
LATE_REQUEST, LATE_STEP = ("KING LEAR:\n", 6), 3
MAX_BATCH = 4
# The block-table example: two sequences growing side by side in one small pool.
POOL_BLOCKS, FIRST_CHUNK, GROWN = 8, 20, 38
OTHER_TEXT = PASSAGES[2] + "\n\n" + PASSAGES[4]          # the second sequence's text (38 tokens)
WATCHED_POSITION = 20
# Speculative decoding: greedy tokens after a prompt, with each drafter (the draft ships in weights/draft).
SPECULATION_PROMPT, SPECULATION_TOKENS, LOOKUP_NGRAM = "ROMEO:\n", 64, 3
BUNDLED_DRAFT = Path(__file__).resolve().parents[1] / "weights" / "draft"


def claim(holds: bool, what: str) -> None:
    walkthrough_common.claim(holds, what, "serving section")


def solo(model: Qwen3Model, tokenizer: Tokenizer, request: Request) -> list[int]:
    """What `generate` writes for the request alone (greedy)."""
    return [event.token_id for event in generate(model, tokenizer, request.prompt, request.params,
                                                 request.max_new_tokens)]


def batching_part(run: Run) -> str:
    model, tokenizer = run.model, run.tokenizer
    generator = BatchGenerator(model, tokenizer, max_batch=MAX_BATCH)
    requests = [Request(tokenizer.encode(prompt), GREEDY, n) for prompt, n in REQUESTS]
    rows = [generator.submit(request) for request in requests]
    steps: list[tuple[int, list[int]]] = []                 # (rows in the forward pass, rows that got a token)
    while not generator.idle:
        if len(steps) == LATE_STEP:
            requests.append(Request(tokenizer.encode(LATE_REQUEST[0]), GREEDY, LATE_REQUEST[1]))
            rows.append(generator.submit(requests[-1]))
        events = generator.step()
        steps.append((generator.batch_sizes[-1], [row.number + 1 for row, _ in events]))
    same = all(row.generated == solo(model, tokenizer, row.request) for row in rows)
    claim(same, "every batched row writes what generate writes alone")
    claim(steps[LATE_STEP][1] == [row.number + 1 for row in rows] and steps[0][1] == [1, 2, 3],
          "the first step serves the three prompts, and the late request joins the running ones at once")
    table = "\n".join(f"| {step} | {size} | {', '.join(map(str, got))} |" for step, (size, got) in enumerate(steps, 1))
    listed = "\n".join(f"{i}. `{prompt!r}`, {n} new tokens" for i, (prompt, n) in enumerate((*REQUESTS, LATE_REQUEST), 1))
    return f"""**Continuous batching.** A decode step reads every weight to produce one token (section 8). A
step for several sequences reads them once too: `Qwen3Model.forward_batch` packs the sequences' new
tokens into one matrix, so each weight read serves every row. `batching.BatchGenerator` (what `serve`
runs) keeps up to `--max-batch` requests in flight; each `step()` is one forward pass in which every
row feeds its next token, or the next chunk of its prompt, and rows join and leave between any two
steps instead of waiting for the batch to finish. On the bundled model, greedy, four requests:

{listed}

The first three are submitted together, the fourth after step {LATE_STEP}:

| step | rows in the forward pass | requests that got a token |
|---:|---:|---|
{table}

Step 1 reads the three prompts in one pass (prefill) and samples each one's first token. Request 4
joins at step {LATE_STEP + 1}: its whole prompt and the others' single tokens go through the same pass.
Each request leaves as soon as it has its tokens, and every request's text is **identical** to what
`generate` writes for it alone. Tokens per second against the number of streams are measured by
`python -m bench.streams` (README, section "Performance")."""


def block_table_part(run: Run, facts: dict[str, Any]) -> str:
    model, config = run.model, run.model.config
    ids = run.tokenizer.encode(TRAIN_TEXT)
    other = run.tokenizer.encode(OTHER_TEXT)
    pool = BlockPool(config, POOL_BLOCKS)
    first, second = PagedKVCache(pool, GROWN), PagedKVCache(pool, GROWN)
    model.forward(ids[:FIRST_CHUNK], cache=first)
    model.forward(other[:FIRST_CHUNK], cache=second)
    model.forward(ids[FIRST_CHUNK:GROWN], cache=first)
    # The same key computed without a cache: layer 0's rotated key of WATCHED_POSITION.
    keys: dict[str, np.ndarray] = {}
    model.forward(ids[:GROWN], trace=lambda name, value: keys.__setitem__(name, value.copy()))
    block, slot = first.table[WATCHED_POSITION // BLOCK_SIZE], WATCHED_POSITION % BLOCK_SIZE
    stored = pool.keys[0, block, slot]                                              # [KVH, Dh]
    difference = float(np.abs(stored - keys["model.layers.0.self_attn.rope_k"][WATCHED_POSITION]).max())
    facts["block tables"] = [first.table, second.table]
    runs = block_runs(first.table)
    claim(len(runs) == 2 and first.table[:2] == [0, 1], "the first sequence's third block is not after its second")
    return f"""**Paged KV blocks.** Section 6's cache is one array per sequence, sized for its whole context up
front. A server cannot afford that for many sequences of unknown length, so `qwen_np/engine/paged.py`
keeps every sequence's keys and values in blocks of {BLOCK_SIZE} positions taken from one `BlockPool` as
the sequence grows; the sequence's **block table** lists its blocks in order, and position p lives in
slot p % {BLOCK_SIZE} of block table[p // {BLOCK_SIZE}]. Run here: a pool of {POOL_BLOCKS} blocks, a first sequence
prefilled with {FIRST_CHUNK} tokens, a second with {FIRST_CHUNK}, then the first grown to {GROWN}:

* first sequence, {first.length} positions: block table **{first.table}**;
* second sequence, {second.length} positions: block table **{second.table}**;
* {pool.used_blocks} of the pool's {POOL_BLOCKS} blocks in use, {pool.free_blocks} free for any sequence.

The first sequence's third block could not follow its second (block {first.table[1] + 1} is the second sequence's), so
the pool gave it block {runs[1][0]}, in the middle of the longest stretch of free blocks, where both sequences still
have room to grow in order.

The first sequence's position {WATCHED_POSITION} is slot {slot} of block {block}: `pool.keys[0, {block}, {slot}]` is layer 0's
key of that token, the one a forward pass without any cache computes (they differ by less than
{below(difference, CACHE_TOLERANCE)}). A sequence holds at most one partly filled block, and a finished one gives its
blocks back at once; `serve --kv-memory SIZE` sizes the pool, admits requests while it has blocks, and
preempts a row (recomputed later, with the same text) when they run out. The pool hands a growing
sequence the block after its last one when it can, because consecutive blocks are read in place where
scattered ones are copied:

{code_block(inspect.getsource(PagedKVCache.reserve))}"""


def _finish(generator: BatchGenerator, request: Request) -> Row:
    row = generator.submit(request)
    while not generator.idle:
        generator.step()
    return row


def prefix_part(run: Run) -> str:
    model, tokenizer = run.model, run.tokenizer
    generator = BatchGenerator(model, tokenizer, max_batch=2)              # its pool caches full blocks by prefix
    lines = TRAIN_TEXT.splitlines(keepends=True)
    first_prompt = tokenizer.encode("".join(lines[:-1]))
    first = _finish(generator, Request(first_prompt, GREEDY, 8))
    second_prompt = tokenizer.encode("".join(lines))
    second = _finish(generator, Request(second_prompt, GREEDY, 8))
    shared = next(i for i, (a, b) in enumerate(zip(first_prompt + [-1], second_prompt)) if a != b)
    turn = first_prompt + first.generated + tokenizer.encode("\nHAMLET:\n")
    resent = _finish(generator, Request(turn, GREEDY, 8))
    claim(first.cached_tokens == 0 and 0 < second.cached_tokens <= shared, "the second request reuses its prefix")
    claim(resent.cached_tokens > len(first_prompt) - BLOCK_SIZE, "a resent conversation reuses the earlier turn")
    table = "\n".join(f"| {what} | {len(prompt)} | {row.cached_tokens} | {len(prompt) - row.cached_tokens} |"
                      for what, prompt, row in (
        (f"section 9's text without its last line ({len(lines) - 1} lines)", first_prompt, first),
        (f"the same and one more line ({shared} tokens shared)", second_prompt, second),
        ("the first request, its reply and a new turn (a chat client resends it all)", turn, resent)))
    return f"""**Prefix reuse.** A key or value depends only on the tokens up to its position, so two requests
that start alike need the same first blocks. With prefix caching, every full block is named by a hash
of its tokens and all tokens before it (`paged.block_digest`); a new request takes the blocks of its
longest named prefix (`BlockPool.lookup`) and prefills only the rest, and blocks no request holds stay
cached until the pool needs them, least recently used first. Run on the bundled model:

| request | prompt tokens | reused from the cache (`cached_tokens`) | prefilled |
|---|---:|---:|---:|
{table}

Only whole blocks are shared ({BLOCK_SIZE} positions each), so the reused count is the shared prefix rounded down
to a multiple of {BLOCK_SIZE}; the reply's tokens are in the cache too, which is why a resent conversation
prefills only its new turn. `serve` reports this count as `usage.prompt_tokens_details.cached_tokens`
and the hit rate in `GET /metrics`."""


def speculation_part(run: Run) -> str:
    model, tokenizer = run.model, run.tokenizer
    draft = load_model(BUNDLED_DRAFT)
    ids = tokenizer.encode(SPECULATION_PROMPT)
    plain = [event.token_id for event in generate(model, tokenizer, ids, GREEDY, SPECULATION_TOKENS)]
    rows = []
    for what, speculation in ((f"`--lookup {LOOKUP_NGRAM}`: the last 1-{LOOKUP_NGRAM} tokens looked up earlier in the text",
                               lookup_speculation(LOOKUP_NGRAM)),
                              ("`--draft weights/draft`: a 1-layer Qwen3 trained by `train`", draft_speculation(draft))):
        stats = GenerationStats()
        tokens = [event.token_id for event in generate(model, tokenizer, ids, GREEDY, SPECULATION_TOKENS, stats=stats,
                                                       speculation=speculation)]
        claim(tokens == plain, "speculative greedy decoding writes plain greedy decoding's tokens")
        decode_steps = stats.counts.target_steps - 1                      # the first step is the prompt's prefill
        rows.append(f"| {what} | {stats.counts.drafted_tokens} | {stats.counts.accepted_tokens} | {decode_steps} | "
                    f"{(SPECULATION_TOKENS - 1) / decode_steps:.2f} | yes |")
    table = "\n".join(rows)
    return f"""**Speculative decoding.** A decode step reads every weight to make one token; a forward pass over
k + 1 tokens reads them once too. So a cheap drafter guesses the next k tokens, the model scores the
last token and the k guesses in one pass (`generate.Continuation.verify`), and keeps the guesses up to
the first it would not have chosen, then its own choice there: 1 to k + 1 tokens per step. Greedy, the
text is exactly plain decoding's; sampled, each guess is kept with probability min(1, p/q) and a
rejection draws from what is left of p (`speculative.accept`), so the text keeps the model's
distribution whatever the drafter. {SPECULATION_TOKENS} greedy tokens after `{SPECULATION_PROMPT!r}` on the bundled model,
k = {DEFAULT_DRAFT_TOKENS}:

| drafter | drafted | kept | decode steps | tokens per step | same text as plain |
|---|---:|---:|---:|---:|---|
| none (plain decoding) | 0 | 0 | {SPECULATION_TOKENS - 1} | 1.00 | |
{table}

It pays where a step is dominated by reading the weights and a pass over k + 1 tokens costs about
one token's; on a model as small as this one a step is mostly Python's own work, so the draft's k
steps cost about what its extra tokens save, while lookup's free guesses pay (bench/README.md
measures both: `python -m bench.speculative`).
`generate`, `chat` and `serve` take `--draft MODEL` or `--lookup N`; the stats line and `usage` give
the acceptance rate and tokens per step."""


def serving_section(run: Run, number: int, facts: dict[str, Any]) -> str:
    parts = [batching_part(run), block_table_part(run, facts), prefix_part(run), speculation_part(run)]
    return f"""## {number}. What a serving engine adds

Everything so far runs one sequence. A server such as vLLM or `python -m qwen_np serve` runs many at
once, and its job beyond the model is to share the hardware between them: one forward pass for all
of them, one pool of KV cache memory, and no work done twice. Each part below runs qwen_np's own code
on the bundled model and prints counts only (no timings: those are the machine's, measured in `bench/`).

""" + "\n\n".join(parts)


def notebook_code() -> str:
    """The section's notebook cell: a block table, as a reader builds it."""
    return f'''from qwen_np.engine.paged import BlockPool, PagedKVCache
pool = BlockPool(model.config, num_blocks={POOL_BLOCKS})
first, second = PagedKVCache(pool, {GROWN}), PagedKVCache(pool, {GROWN})
OTHER = {OTHER_TEXT!r}
text_ids, other_ids = tokenizer.encode(TEXT), tokenizer.encode(OTHER)
model.forward(text_ids[:{FIRST_CHUNK}], cache=first)                     # prefill the first sequence
model.forward(other_ids[:{FIRST_CHUNK}], cache=second)                  # then a second one
model.forward(text_ids[{FIRST_CHUNK}:{GROWN}], cache=first)                    # the first grows: a new block
print(first.table, second.table, pool.free_blocks, "blocks free")'''


def notebook_checks(page: Any) -> dict[str, Any]:
    """Expressions over the notebook's variables after that cell, and what the page shows for them."""
    return {"[first.table, second.table]": page.facts["block tables"]}
