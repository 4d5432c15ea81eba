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
    # forward_flops counts every query/key pair; a causal kernel skips the masked ones: T(T+1)/2 of T².
    masked_pairs = 1000 * 1000 - 1000 * 1001 // 2
    prefill_pass = (forward_flops(real, 1000, 1000)
                    - real.num_hidden_layers * 2 * 2 * real.num_attention_heads * real.head_dim * masked_pairs)
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
the BF16 figures.) The bundled model needs {kv_cache_bytes_per_token(c, 4):,} bytes per token in FP32."""
