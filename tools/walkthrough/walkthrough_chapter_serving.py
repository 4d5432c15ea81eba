"""The walkthrough's section on what a serving engine adds to the model: continuous batching
(qwen_np/generation/batching.py), the paged KV cache's blocks and block table, prefix reuse (qwen_np/engine/paged.py),
and speculative decoding (qwen_np/generation/speculative.py) with both drafters, each run on the bundled model with
greedy decoding. The page prints counts only (rows, blocks, tokens, drafted and kept tokens), which are
the same on every machine, and its figures are drawn from those runs (Recorder notes what each batched pass
read). The one timing, tokens/s against the number of streams, is the machine's: it comes from a record
that `python -m bench.streams --json` wrote (STREAMS_RECORD), shown as recorded and never re-measured here.
"""

from __future__ import annotations

import inspect
import json
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
BUNDLED_DRAFT = Path(__file__).resolve().parents[2] / "weights" / "draft"
# Tokens/s against the number of streams: a timing, so recorded once (bench/streams.py --json), never re-run here.
STREAMS_RECORD = Path(__file__).resolve().parents[2] / "docs" / "figures" / "serving_streams.json"


class Recorder:
    """The model as a BatchGenerator sees it, noting what each batched forward pass reads: for every row in the
    pass, its request's number, the tokens it fed and its block table then. The section's figures are drawn
    from these notes of a real run."""

    def __init__(self, model: Qwen3Model) -> None:
        self.model = model
        self.rows: list[Row] = []                           # every row submitted through submit(), to name caches
        self.passes: list[list[dict[str, Any]]] = []        # per forward pass: request, tokens fed, block table

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def submit(self, generator: BatchGenerator, request: Request) -> Row:
        self.rows.append(generator.submit(request))
        return self.rows[-1]

    def forward_batch(self, sequences: list[list[int]], caches: list[PagedKVCache], **options: Any) -> np.ndarray:
        owner = {id(row.cache): row.number + 1 for row in self.rows if row.cache is not None}
        self.passes.append([{"request": owner[id(cache)], "fed": len(ids), "table": list(cache.table)}
                            for ids, cache in zip(sequences, caches)])
        return self.model.forward_batch(sequences, caches, **options)


def claim(holds: bool, what: str) -> None:
    walkthrough_common.claim(holds, what, "serving section")


def solo(model: Qwen3Model, tokenizer: Tokenizer, request: Request) -> list[int]:
    """What `generate` writes for the request alone (greedy)."""
    return [event.token_id for event in generate(model, tokenizer, request.prompt, request.params,
                                                 request.max_new_tokens)]


def batching_part(run: Run) -> str:
    model, tokenizer = run.model, run.tokenizer
    recorder = Recorder(model)
    generator = BatchGenerator(recorder, tokenizer, max_batch=MAX_BATCH)
    rows = [recorder.submit(generator, Request(tokenizer.encode(prompt), GREEDY, n)) for prompt, n in REQUESTS]
    steps: list[tuple[int, list[int]]] = []                 # (rows in the forward pass, rows that got a token)
    while not generator.idle:
        if len(steps) == LATE_STEP:
            rows.append(recorder.submit(generator, Request(tokenizer.encode(LATE_REQUEST[0]), GREEDY, LATE_REQUEST[1])))
        events = generator.step()
        steps.append((generator.batch_sizes[-1], [row.number + 1 for row, _ in events]))
    run.figures["batching_timeline"] = {"passes": [[{k: row[k] for k in ("request", "fed")} for row in rows_in_pass]
                                                   for rows_in_pass in recorder.passes],
                                        "tokens": [got for _, got in steps], "late_step": LATE_STEP,
                                        "requests": [f"{prompt!r}, {n} new" for prompt, n in (*REQUESTS, LATE_REQUEST)]}
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
`generate` writes for it alone. The same run, drawn from what each forward pass read:

![Which requests each step of the continuous-batching run fed, and how many tokens each](figures/batching_timeline.png)

What batching buys is throughput: a step for N rows reads the weights once, so on a model whose step
is dominated by reading them, N streams come close to N times the tokens per second of one. Measured
by `python -m bench.streams` (one recorded run; timings are the machine's, so the page shows the record
and never re-measures it):

{streams_note()}

![Aggregate decode tokens/s against the number of streams batched together, from the record](figures/serving_streams.png)"""


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
    run.figures["block_pool"] = {"blocks": POOL_BLOCKS, "block_size": BLOCK_SIZE,
                                 "sequences": [{"table": list(c.table), "length": c.length} for c in (first, second)]}
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


def _finish(generator: BatchGenerator, recorder: Recorder, request: Request) -> Row:
    row = recorder.submit(generator, request)
    while not generator.idle:
        generator.step()
    return row


def prefix_part(run: Run) -> str:
    model, tokenizer = run.model, run.tokenizer
    recorder = Recorder(model)
    generator = BatchGenerator(recorder, tokenizer, max_batch=2)           # its pool caches full blocks by prefix
    lines = TRAIN_TEXT.splitlines(keepends=True)
    first_prompt = tokenizer.encode("".join(lines[:-1]))
    first = _finish(generator, recorder, Request(first_prompt, GREEDY, 8))
    second_prompt = tokenizer.encode("".join(lines))
    second = _finish(generator, recorder, Request(second_prompt, GREEDY, 8))
    shared = next(i for i, (a, b) in enumerate(zip(first_prompt + [-1], second_prompt)) if a != b)
    turn = first_prompt + first.generated + tokenizer.encode("\nHAMLET:\n")
    resent = _finish(generator, recorder, Request(turn, GREEDY, 8))
    claim(first.cached_tokens == 0 and 0 < second.cached_tokens <= shared, "the second request reuses its prefix")
    claim(resent.cached_tokens > len(first_prompt) - BLOCK_SIZE, "a resent conversation reuses the earlier turn")
    last_table = {row["request"]: row["table"] for rows_in_pass in recorder.passes for row in rows_in_pass}
    run.figures["block_pool"]["prefix"] = [{"table": last_table[row.number + 1], "reused_blocks": row.cached_tokens // BLOCK_SIZE,
                                            "prompt": len(row.request.prompt)} for row in (first, second, resent)]
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
and the hit rate in `GET /metrics`. Both runs' pools, as they were:

![The block pool: two sequences' blocks, and three requests whose tables share their prefix's blocks](figures/block_pool.png)"""


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


def load_streams_record() -> dict[str, Any]:
    return json.loads(STREAMS_RECORD.read_text(encoding="utf-8"))


def stream_rates(record: dict[str, Any]) -> dict[str, float]:
    """Each configuration's median tok/s over the record's repeats (what bench.streams prints)."""
    return {name: float(np.median(values)) for name, values in record["tok_s"].items()}


def streams_note() -> str:
    record = load_streams_record()
    rates = stream_rates(record)
    one = rates["1 stream (batched)"]
    rows = "\n".join(f"| {name} | {rate:,.0f} | {rate / one:.1f}× |" for name, rate in rates.items())
    return f"""| configuration | aggregate decode tok/s (median of {record['repeats']}) | × 1 stream batched |
|---|---:|---:|
{rows}

Recorded by `{record['command']}` on {record['threads']} threads (the machine's load
average was {record['load_average_at_start']:.1f} when it started: other work was running, so the last digits are
its mood), greedy, prompts of {record['prompt']} random tokens, {record['timed_decode_steps']} timed decode steps per stream:
the bundled model is so small that a step is mostly Python's own work, which batching shares as it
shares the weight reads."""


def batching_timeline_figure(data: dict[str, Any]) -> Any:
    """One row per request, one column per forward pass: what the request fed in that pass (a chunk of prompt, or
    its last token), and a dot where it got a token."""
    import matplotlib.pyplot as plt

    requests, passes = len(data["requests"]), data["passes"]
    fig, ax = plt.subplots(figsize=(10, 0.55 * requests + 2.2), dpi=100)
    for step, (rows, got) in enumerate(zip(passes, data["tokens"]), start=1):
        for row in rows:
            prefill = row["fed"] > 1
            ax.barh(row["request"], 0.9, left=step - 0.45, height=0.6, color="#f79646" if prefill else "#4f81bd",
                    edgecolor="white")
            if prefill:
                ax.text(step, row["request"], str(row["fed"]), ha="center", va="center", fontsize=7, color="white")
        ax.plot([step + 0.3] * len(got), got, "o", ms=3, color="black")
        ax.text(step, 0.35, str(len(rows)), ha="center", va="center", fontsize=7, color="#555555")
    late = len(data["requests"])
    ax.annotate("submitted here", (data["late_step"] + 0.5, late), (data["late_step"] - 1.5, late + 0.45), fontsize=7,
                arrowprops={"arrowstyle": "->", "color": "#555555"})
    ax.set_yticks(range(1, requests + 1), [f"request {i}: {what}" for i, what in enumerate(data["requests"], 1)], fontsize=8)
    ax.set_ylim(0.1, requests + 0.7)
    ax.invert_yaxis()
    ax.set_xticks(range(1, len(passes) + 1))
    ax.set_xlabel("step (one forward pass); the grey number above each: rows in that pass")
    ax.set_title("Continuous batching, as run: orange = a prompt chunk (the number: its tokens), "
                 "blue = one decode token,\nblack dot = a token sampled", fontsize=9)
    ax.grid(axis="x", alpha=0.2)
    fig.tight_layout()
    return fig


def block_pool_figure(data: dict[str, Any]) -> Any:
    """Top: the pool of the block-table example, each block coloured by its sequence with the positions it holds.
    Bottom: the prefix-reuse run's three block tables, the blocks taken from the prefix cache hatched."""
    import matplotlib.pyplot as plt

    size, colours = data["block_size"], ("#4f81bd", "#9bbb59", "#f79646")
    prefix = data["prefix"]
    fig, (pool, tables) = plt.subplots(2, 1, figsize=(10, 4.8), dpi=100, gridspec_kw={"height_ratios": [1, 1.6]})
    owner = {block: (s, i) for s, seq in enumerate(data["sequences"]) for i, block in enumerate(seq["table"])}
    for block in range(data["blocks"]):
        if block in owner:
            s, i = owner[block]
            held = min(size, data["sequences"][s]["length"] - i * size)
            pool.add_patch(plt.Rectangle((block, 0), 0.92, 0.9, color=colours[s]))
            pool.text(block + 0.46, 0.45, f"seq {s + 1}\npos {i * size}-{i * size + held - 1}", ha="center",
                      va="center", fontsize=7, color="white")
        else:
            pool.add_patch(plt.Rectangle((block, 0), 0.92, 0.9, facecolor="white", edgecolor="#999999"))
            pool.text(block + 0.46, 0.45, "free", ha="center", va="center", fontsize=7, color="#777777")
    pool.set(xlim=(-0.1, data["blocks"]), ylim=(-0.1, 1))
    pool.set_xticks([b + 0.46 for b in range(data["blocks"])], [f"block {b}" for b in range(data["blocks"])], fontsize=7)
    pool.set_yticks([])
    pool.set_title(f"One pool of {data['blocks']} blocks ({size} positions each), two sequences: each block table "
                   "lists its blocks in order", fontsize=9)
    width = max(len(request["table"]) for request in prefix)
    for r, request in enumerate(prefix):
        for i, block in enumerate(request["table"]):
            reused = i < request["reused_blocks"]
            tables.add_patch(plt.Rectangle((i, -r), 0.92, 0.8, facecolor="#c6dbef" if reused else "#fdd0a2",
                                           edgecolor="#555555", hatch="//" if reused else None))
            tables.text(i + 0.46, -r + 0.4, str(block), ha="center", va="center", fontsize=8)
    tables.set(xlim=(-0.1, width), ylim=(-len(prefix) + 0.9, 0.9))
    tables.set_yticks([-r + 0.4 for r in range(len(prefix))],
                      [f"request {r + 1} ({request['prompt']} prompt tokens)" for r, request in enumerate(prefix)], fontsize=8)
    tables.set_xticks([i + 0.46 for i in range(width)], [f"{i * size}-" for i in range(width)], fontsize=7)
    tables.set_xlabel("the table's entries (the first position each covers); the number is the pool block")
    tables.set_title("Prefix reuse: hatched blue = a block found in the prefix cache (the same block as before), "
                     "orange = prefilled anew", fontsize=9)
    for panel in (pool, tables):
        for side in ("top", "right", "left"):
            panel.spines[side].set_visible(False)
    fig.tight_layout()
    return fig


def streams_figure(record: dict[str, Any]) -> Any:
    """Median aggregate decode tok/s against the streams batched together, each repeat as a dot, from the record."""
    import matplotlib.pyplot as plt

    rates = stream_rates(record)
    streams = record["streams"]
    batched = [name for name in record["tok_s"] if "(batched)" in name]
    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=100)
    ax.plot(streams, [rates[name] for name in batched], "o-", label="median, batched in one BatchGenerator")
    for n, name in zip(streams, batched):
        ax.plot([n] * len(record["tok_s"][name]), record["tok_s"][name], ".", color="#999999")
    one = rates[batched[0]]
    ax.plot(streams, [one * n for n in streams], ":", color="#555555", label="N × one stream (perfect sharing)")
    ax.axhline(rates["single (generate loop)"], color="#c0504d", lw=1, label="one stream, generate()'s loop")
    ax.set_xscale("log", base=2)
    ax.set_xticks(streams, [str(n) for n in streams])
    ax.set(xlabel="streams decoding together (batch size)", ylabel="aggregate decode tokens/s")
    ax.set_title(f"From the record, not re-measured: {record['model']}, {record['threads']} threads, "
                 f"grey dots: each of {record['repeats']} repeats", fontsize=9)
    fig.text(0.01, 0.01, record["command"], fontsize=7, family="monospace", color="#555555")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return fig


def serving_section(run: Run, number: int, facts: dict[str, Any]) -> str:
    run.figures["serving_streams"] = load_streams_record()
    parts = [batching_part(run), block_table_part(run, facts), prefix_part(run), speculation_part(run)]
    return f"""## {number}. What a serving engine adds

Everything so far runs one sequence. A server such as vLLM or `python -m qwen_np serve` runs many at
once, and its job beyond the model is to share the hardware between them: one forward pass for all
of them, one pool of KV cache memory, and no work done twice. Each part below runs qwen_np's own code
on the bundled model and prints counts only; the one timing (tokens/s against batch size) is a recorded
`bench/` run, shown as the record has it.

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
