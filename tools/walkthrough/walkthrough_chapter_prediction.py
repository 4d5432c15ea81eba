"""The walkthrough's chapters on output: 5, the final norm, the logits and sampling the next token, and 6, the
KV cache that makes generating more tokens cheap."""

from __future__ import annotations


import numpy as np

from qwen_np.core import layers, sampling
from qwen_np import preset
from qwen_np.core.config import Qwen3Config, parameter_count
from qwen_np.inspection import STEPS_BY_NAME, forward_flops, token_text
from qwen_np.files.model_files import read_generation_defaults
from qwen_np.engine.memory import kv_cache_bytes_per_token
from walkthrough_common import (CACHE_TOLERANCE, FIGURE_TEMPERATURES, MODEL_CODE, REAL, SMALL_REAL, Run,
                                code_block, num, shape_of, step_code)


def prediction_section(run: Run, shown: set[str]) -> str:
    probs = layers.softmax(run.logits[-1])
    top = np.argsort(-probs, kind="stable")[:5]
    rows = "\n".join(f"| {rank} | {i} | `{token_text(run.tokenizer, int(i), width=40)}` | {num(run.logits[-1, i])} | "
                     f"{num(probs[i])} |" for rank, i in enumerate(top, start=1))
    final_norm, head = STEPS_BY_NAME["model.norm"], STEPS_BY_NAME["lm_head"]
    c = run.model.config
    return f"""## 5. Final norm → logits → the next token

After the last layer, one more RMSNorm, then the LM head: a matrix product of the normed stream
with a [V, D] matrix, giving one score (**logit**) per vocabulary entry at every position.

{step_code(final_norm, shown)}

{step_code(head, shown)}

The logits are {shape_of(run, head)}: every position predicts the token after it, but to continue
the prompt only the last row matters. Softmax turns that row into probabilities; the five largest:

| rank | id | token | logit | probability |
|---:|---:|---|---:|---:|
{rows}

The top token, `{token_text(run.tokenizer, int(top[0]), width=40)}`, is the one that follows the prompt in the
play; greedy decoding (`--temperature 0`) would append it. A uniform guess would give each of the
{c.vocab_size:,} tokens {num(1 / c.vocab_size)}.

{tied_why(run)}

{sampling_section(run)}"""


def tied_why(run: Run) -> str:
    rows = []
    for name, config in (("this model", run.model.config), (SMALL_REAL, preset(SMALL_REAL)), (REAL, preset(REAL))):
        table = config.vocab_size * config.hidden_size
        total = parameter_count(config)
        rows.append(f"| {name} | {'tied' if config.tie_word_embeddings else 'separate'} | {table:,} | "
                    f"{table / total:.0%} |")
    return f"""*Why tied embeddings, and only in the small sizes.* This model, like Qwen3-0.6B, 1.7B and 4B, ties
the LM head to the embedding table: the same [V, D] matrix turns ids into vectors and vectors into
scores, and is stored once. Qwen3-8B, 14B and 32B have a separate `lm_head.weight`. The table's share
of the parameters decides: in a small model it is a large part of the whole, and sharing it saves
that much; in a big one it is a few percent, and a separate head, free to differ from the input
embedding, is worth its cost.

| model | LM head | parameters in one [V, D] table | share of all parameters |
|---|---|---:|---:|
{chr(10).join(rows)}"""


SAMPLING_SETTINGS = (   # (label, SamplingParams fields) for the table of section 5
    ("temperature 1, no filter", {}),
    ("temperature 0.5", {"temperature": 0.5}),
    ("temperature 1.5", {"temperature": 1.5}),
    ("top-k 10", {"top_k": 10}),
    ("top-p 0.5", {"top_p": 0.5}),
    ("min-p 0.2", {"min_p": 0.2}),
)


def sampling_section(run: Run) -> str:
    logits = run.logits[-1]
    defaults = read_generation_defaults(run.model_dir, run.model.config).sampling
    default_fields = {"temperature": defaults.temperature, "top_k": defaults.top_k, "top_p": defaults.top_p,
                      "min_p": defaults.min_p}
    settings = [*SAMPLING_SETTINGS, ("the model's defaults: " + ", ".join(
        f"{k.replace('_', '-')} {v:g}" for k, v in default_fields.items()), default_fields)]
    rows, kept = [], {}
    for label, fields in settings:
        probs = sampling.softmax(sampling.warp(logits, sampling.SamplingParams(**fields)))
        alive = np.flatnonzero(probs > 0)
        kept[label] = alive.tolist()
        top = np.argsort(-probs, kind="stable")[:3]
        shown = ", ".join(f"`{token_text(run.tokenizer, int(i))}` {num(probs[i], 3)}" for i in top)
        rows.append(f"| {label} | {len(alive):,} | {shown} |")
    base = sampling.softmax(logits)
    order = np.argsort(-base, kind="stable")[:20]
    run.figures["sampling"] = {"tokens": [token_text(run.tokenizer, int(i)) for i in order],
                               "probabilities": base[order].tolist(),
                               "temperatures": {f"{t:g}": sampling.softmax(sampling.apply_temperature(logits, t))[order].tolist()
                                                for t in FIGURE_TEMPERATURES},
                               "kept": {label: [bool(i in kept[label]) for i in order] for label, _ in settings[3:]}}
    return f"""**Sampling: temperature, top-k, top-p, min-p.** `generate` samples by default, from the
probabilities above reshaped by `qwen_np/core/sampling.py` in transformers' order: the **temperature**
divides the logits (below 1 sharpens the distribution, above 1 flattens it, 0 means greedy), **top-k**
keeps the k most likely tokens, **top-p** the fewest most likely whose probabilities reach p, and
**min-p** drops every token less likely than min-p × the top token's probability. Each is there to
cut the long tail of unlikely tokens, where one unlucky draw derails a text, while keeping variety.
On this prompt's real distribution (`sampling.warp`, then `sampling.softmax`):

| setting | tokens that can be drawn | top 3 after the setting |
|---|---:|---|
{chr(10).join(rows)}

Top-k keeps a fixed number however the probability is spread; top-p and min-p adapt: few tokens when
the model is sure, many when it is not. (The model's defaults come from its `generation_config.json`.)

![The 20 most likely next tokens, and which of them each filter keeps](figures/sampling.png)

The explorer of `python -m qwen_np serve` (http://127.0.0.1:8000/, its "Next token" view) moves these
filters live on the distribution of any prompt, and samples and appends one token at a time."""


# The contexts the KV cache figure is drawn at (tokens so far, for Qwen3-8B).
FIGURE_CONTEXTS = (1, 16, 64, 256, 1024, 2048, 4096, 8192, 16384, 24576, 32768)


def causal_prefill_flops(config: Qwen3Config, tokens: int) -> int:
    """Matmul FLOPs of a forward pass over `tokens` tokens from scratch, counting only the query/key pairs a causal
    kernel computes: forward_flops counts all T² of them, a causal kernel skips the T(T-1)/2 in the future
    (2 FLOPs per multiply-add, in QK^T and in the weighted sum)."""
    future = tokens * (tokens - 1) // 2
    return forward_flops(config, tokens, tokens) - config.num_hidden_layers * 2 * 2 * config.num_attention_heads \
        * config.head_dim * future


def kv_cache_figure_data(real: Qwen3Config) -> dict[str, object]:
    """What the cache holds and what it saves, at each of FIGURE_CONTEXTS: exact counts, no timings."""
    mha = Qwen3Config(num_key_value_heads=real.num_attention_heads)
    return {"model": REAL, "contexts": list(FIGURE_CONTEXTS),
            "cache_bytes_bf16": [kv_cache_bytes_per_token(real, 2) * t for t in FIGURE_CONTEXTS],
            "cache_bytes_bf16_mha": [kv_cache_bytes_per_token(mha, 2) * t for t in FIGURE_CONTEXTS],
            "weight_bytes_bf16": 2 * parameter_count(real),
            # the cost of the next token after t tokens: all t + 1 again, or the one new token over t + 1 positions
            "recompute_flops": [causal_prefill_flops(real, t + 1) for t in FIGURE_CONTEXTS],
            "cached_flops": [forward_flops(real, 1, t + 1) for t in FIGURE_CONTEXTS]}


def kv_cache_figure(data: dict) -> object:
    """Two panels: the cache's bytes growing with the tokens (GQA against one KV head per query head, the weights for
    scale), and the FLOPs of the next token with and without it."""
    import matplotlib.pyplot as plt

    contexts = np.array(data["contexts"])
    fig, (size, cost) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=100)
    gib = 2 ** 30
    size.plot(contexts, np.array(data["cache_bytes_bf16"]) / gib, "o-", ms=3, label="KV cache, GQA (as Qwen3-8B is)")
    size.plot(contexts, np.array(data["cache_bytes_bf16_mha"]) / gib, "s--", ms=3,
              label="KV cache if every query head had its own KV head")
    size.axhline(data["weight_bytes_bf16"] / gib, color="#555555", lw=1, ls=":", label="the weights themselves")
    size.set(xlabel="tokens in the sequence (prompt + generated)", ylabel="GiB (BF16)",
             title=f"{data['model']}: one sequence's KV cache grows by the same bytes every token")
    size.legend(fontsize=8)
    size.grid(alpha=0.3)
    cost.loglog(contexts, np.array(data["recompute_flops"]) / 1e9, "o-", ms=3,
                label="no cache: rerun all the tokens (causal pairs only)")
    cost.loglog(contexts, np.array(data["cached_flops"]) / 1e9, "s-", ms=3, label="with the cache: the one new token")
    cost.set(xlabel="tokens before the new one", ylabel="GFLOP to generate the next token",
             title="The cost of one more token: recompute against cache")
    cost.legend(fontsize=8)
    cost.grid(alpha=0.3, which="both")
    for panel in (size, cost):
        panel.title.set_fontsize(9)
    fig.tight_layout()
    return fig


def kv_cache_section(run: Run) -> str:
    c, real = run.model.config, preset(REAL)
    T = len(run.ids)
    cache = run.model.new_cache(T + 1)
    run.model.forward(run.ids, cache=cache)
    step_logits = run.model.forward([int(np.argmax(run.logits[-1]))], cache=cache)
    full_logits = run.model.forward(run.ids + [int(np.argmax(run.logits[-1]))])
    difference = np.abs(step_logits[-1] - full_logits[-1]).max()
    # The exact difference is rounding noise that changes with the BLAS build, so state the bound.
    agreement = (f"they differ by less than {CACHE_TOLERANCE:g}, i.e. only by FP32 rounding"
                 if difference < CACHE_TOLERANCE else f"they differ by {num(difference)}: the cache is broken")
    per_token = kv_cache_bytes_per_token(real, bytes_per_value=2)
    mha = kv_cache_bytes_per_token(Qwen3Config(num_key_value_heads=real.num_attention_heads), bytes_per_value=2)
    context = real.max_position_embeddings
    longest = per_token * FIGURE_CONTEXTS[-1]                      # bytes of the figure's longest sequence
    prefill_pass = causal_prefill_flops(real, 1000)
    run.figures["kv_cache"] = kv_cache_figure_data(real)
    return f"""## 6. Generating more: why the KV cache exists, and what it costs

Generation is **autoregressive**: the model predicts one token from all the tokens before it, that
token is appended to the input, and the model runs again to predict the next, until an end token or a
length limit. To write a second token, the model runs again on the prompt plus the new token. Almost all of that
work would repeat the first pass: a token's keys and values at layer l depend only on the tokens up
to it, which have not changed. The **KV cache** keeps every layer's keys (after RoPE) and values for
every position, so the next pass computes q, k, v for the **one new token** only (T = 1) and attends
over the S cached positions:

{code_block(MODEL_CODE["model.layers.{i}.self_attn.scores"])}

On the bundled model: a {T}-token prefill fills the cache, then one decode step with T = 1 gives the
same logits as re-running all {T + 1} tokens: {agreement}. The cache is `keys` and `values` of
shape [L, S_max, KVH, Dh] =
{list(cache.keys.shape)} each.

**What it saves.** For Qwen3-8B, re-running a 1,000-token context for every new token would cost
{num(prefill_pass / 1e12, 3)} TFLOP per token (the attention counted over the unmasked pairs only, as a causal
kernel skips the future); with the cache a decode step costs
{num(forward_flops(real, 1, 1001) / 1e9, 3)} GFLOP, about a thousand times less.

**What it costs.** Per token it holds 2 (k and v) × L × KVH × Dh values: for Qwen3-8B
2 × {real.num_hidden_layers} × {real.num_key_value_heads} × {real.head_dim} =
{per_token // 2:,} values, **{per_token // 1024} KiB per token in BF16**, and at the
{context:,}-token context limit {num(per_token * context / 2 ** 30)} GiB, on top of the weights.
Grouped-query attention is what keeps this down: with one KV head per query head (H = KVH =
{real.num_attention_heads}) it would be {mha // 1024} KiB per token. (qwen_np keeps its cache in FP32, twice
the BF16 figures.) The bundled model needs {kv_cache_bytes_per_token(c, 4):,} bytes per token in FP32.

![Qwen3-8B's KV cache against the tokens so far, and the FLOPs of the next token with and without it](figures/kv_cache.png)

Left: the cache grows by the same {per_token // 1024} KiB with every token: at {FIGURE_CONTEXTS[-1]:,} tokens one
sequence holds {num(longest / 2 ** 30, 3)} GiB, {num(longest / (2 * parameter_count(real)), 2)}× the weights' bytes, and a
server holds one such cache per sequence. Right: without the cache the next token costs a whole
pass over everything so far, which grows with the context (and faster once attention dominates);
with it the cost stays near the weights' 2 FLOPs per parameter, plus one row of attention."""
