"""Write docs/walkthrough.md by running qwen_np on the bundled model: every number in it is real.

The code shown is pulled from qwen_np's source with inspect.getsource, and every shape and number
comes from running that code on weights/ (a tiny Qwen3 with random weights and the real tokenizer),
so neither can drift from the library: tests/test_walkthrough.py regenerates the text and fails
when the committed file differs. The output is deterministic: BLAS runs on one thread and numbers
are printed to 4 significant digits.

Usage: python tools/make_walkthrough.py [--model weights] [--out docs/walkthrough.md]
"""

from __future__ import annotations

import argparse
import inspect
import io
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from threadpoolctl import threadpool_limits

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))   # run from a checkout without installing the package

from qwen_np import layers, load_model, preset  # noqa: E402
from qwen_np.config import Qwen3Config, parameter_count  # noqa: E402
from qwen_np.inspection import (STEPS, STEPS_BY_NAME, SYMBOL_MEANINGS, Step, Tracer, attention_view,  # noqa: E402
                                dimensions, format_shape, forward_flops, logit_lens,
                                resolve, token_text, weight_bytes_read_per_token)
from qwen_np.memory import kv_cache_bytes_per_token  # noqa: E402
from qwen_np.model import Qwen3Model  # noqa: E402
from qwen_np.numerics import BYTES_PER_VALUE, bf16_bits_to_f32, f32_to_bf16_bits  # noqa: E402
from qwen_np.tokenizer import Tokenizer  # noqa: E402

BUNDLED_MODEL = REPO_ROOT / "tests" / "fixtures" / "qwen3_tokenizer_random"   # the Qwen3 tokenizer, random weights
WALKTHROUGH = REPO_ROOT / "docs" / "walkthrough.md"
PROMPT = "The capital of France is"
REAL = "qwen3-8b"                 # the real model the concept sections put numbers on
EXAMPLE_BANDWIDTH = 50e9          # bytes/s: a round figure for a desktop's DRAM (the doc says so)
EXAMPLE_FLOPS = 1e12              # FLOP/s: a round figure for a desktop CPU's FP32 matmul peak
LAYER = 0                         # the layer shown in full detail
CACHE_TOLERANCE = 1e-4            # decode-with-cache vs full re-run logits: FP32 rounding stays far below


@dataclass
class Run:
    """One real forward pass over the prompt, with every intermediate array it traced."""

    model: Qwen3Model
    tokenizer: Tokenizer
    ids: list[int]
    arrays: dict[str, np.ndarray]     # trace name -> array, e.g. "model.layers.0.self_attn.q_proj"
    logits: np.ndarray                # [T, V]

    def at(self, step: Step) -> np.ndarray:
        return self.arrays[step.name.format(i=LAYER)]


def run_prompt(model_dir: Path) -> Run:
    model = load_model(model_dir, memory="fp32", fast=False)   # every call on the readable code shown here
    tokenizer = Tokenizer.from_folder(model_dir)
    ids = tokenizer.encode(PROMPT)
    arrays: dict[str, np.ndarray] = {}
    logits = model.forward(ids, trace=lambda name, value: arrays.__setitem__(name, value.copy()))
    return Run(model, tokenizer, ids, arrays, logits)


# --- Formatting ----------------------------------------------------------------------------------

def num(x: float, digits: int = 4) -> str:
    """4 significant digits: enough to follow along, few enough to be the same on every machine."""
    text = f"{float(x):.{digits}g}"
    return "0" if text in ("-0", "0") else text


def values(v: np.ndarray, count: int = 4) -> str:
    shown = ", ".join(num(x) for x in np.ravel(v)[:count])
    return f"[{shown}, …]" if np.size(v) > count else f"[{shown}]"


def rms(v: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(v, dtype=np.float64))))


def shape_of(run: Run, step: Step, shape: tuple[str, ...] | None = None) -> str:
    dims = dimensions(run.model.config, len(run.ids))
    shape = shape or step.output
    return format_shape(shape, resolve(shape, dims))


def code_block(source: str, language: str = "python") -> str:
    return f"```{language}\n{textwrap.dedent(source).strip()}\n```"


def matrix(run: Run, rows: np.ndarray) -> str:
    """A [T, S] matrix as a markdown table, one row and one column per prompt token."""
    labels = [token_text(run.tokenizer, i) for i in run.ids]
    head = "| query \\ key | " + " | ".join(f"`{label}`" for label in labels) + " |"
    rule = "|---" * (len(labels) + 1) + "|"
    body = [f"| `{label}` | " + " | ".join("−∞" if np.isneginf(x) else num(x) for x in row) + " |"
            for label, row in zip(labels, rows)]
    return "\n".join([head, rule, *body])


# --- The code that does each step ----------------------------------------------------------------

NOTE = re.compile(r'note\(f?"(?:\{name\}\.)?([\w.]+)"')


def model_code_by_step() -> dict[str, str]:
    """Step name -> the lines that compute it: those since the previous note() call.

    Qwen3Model (and the layers.attention / layers.swiglu it calls) report each step to the trace with
    note(name, value) right after computing it, so the source between two note() calls is exactly
    the code of the step noted second.
    """
    code: dict[str, str] = {}
    for function, prefix in ((Qwen3Model.forward_batch, ""), (Qwen3Model._decoder_layer, "model.layers.{i}."),
                             (layers.attention, "model.layers.{i}.self_attn."),
                             (layers.swiglu, "model.layers.{i}.mlp.")):
        body = inspect.getsource(function).split('"""')[-1].splitlines()[1:]   # skip the docstring
        pending: list[str] = []
        for line in body:
            noted = NOTE.findall(line)
            if not noted:
                pending.append(line)
                continue
            lines = "\n".join(kept for kept in pending if kept.strip())
            for suffix in noted:
                code[suffix if not prefix or suffix.startswith("model.") else prefix + suffix] = lines
            pending = []
    return code


MODEL_CODE = model_code_by_step()


def step_code(step: Step, shown: set[str]) -> str:
    """The lines of a step, then the source of each layers.py function they call (once per page)."""
    lines = MODEL_CODE[step.name]
    parts = [code_block(lines)]
    for function in dict.fromkeys(re.findall(r"(?<![\w.])(?:layers\.)?(\w+)\(", lines)):
        if function not in shown and inspect.isfunction(getattr(layers, function, None)):
            shown.add(function)
            parts.append(f"`layers.{function}`, from `qwen_np/layers.py`:\n\n"
                         + code_block(inspect.getsource(getattr(layers, function))))
    return "\n\n".join(parts)


# --- Sections ------------------------------------------------------------------------------------

def intro(run: Run) -> str:
    c, real = run.model.config, preset(REAL)
    ours, theirs = dimensions(c, len(run.ids)), dimensions(real, len(run.ids))
    table = "\n".join(f"| `{sym}` | {SYMBOL_MEANINGS[sym]} | {ours[sym]:,} | {theirs[sym]:,} |" for sym in ours)
    return f"""# Walkthrough: from a prompt to the next token

This page follows one prompt, `{PROMPT!r}`, through every step of a Qwen3 forward pass, with the
code that does each step and the real shapes and numbers it produces. It is **generated**:
`python tools/make_walkthrough.py` runs qwen_np on the bundled model in `weights/` and writes this
file, and `tests/test_walkthrough.py` fails if the committed text differs from a fresh run, so the
code and numbers here are always the ones the library has now.

**The bundled model has random weights.** It is Qwen3's exact architecture with the real Qwen3
tokenizer and vocabulary, at a tiny size, with weights drawn from a random generator rather than
trained. Every step below is exactly what Qwen3-8B computes; the numbers are what a random network
computes, so the "prediction" at the end is meaningless. The dimensions (symbols used everywhere in
qwen_np's shape comments):

| symbol | meaning | bundled model | Qwen3-8B |
|---|---|---:|---:|
{table}

The bundled model has {parameter_count(c):,} parameters, {c.vocab_size * c.hidden_size:,} of them
in the embedding table (the real vocabulary is big even when the network is tiny); Qwen3-8B has
{parameter_count(real):,}. To see every shape below at Qwen3-8B's size, run
`python -m qwen_np inspect --preset qwen3-8b`."""


def tokens_section(run: Run) -> str:
    rows = "\n".join(f"| {p} | {i} | `{token_text(run.tokenizer, i, width=40)}` |" for p, i in enumerate(run.ids))
    return f"""## 1. Prompt → token ids

The tokenizer (byte-level BPE, `qwen_np/tokenizer.py`) cuts the text into pieces from a fixed
vocabulary of {run.model.config.vocab_size:,} entries and replaces each piece by its id. A leading
space belongs to the word after it. No start-of-text token is added: Qwen3 never adds one.

{code_block(f"ids = tokenizer.encode({PROMPT!r})   # -> {run.ids}")}

| position | id | piece |
|---:|---:|---|
{rows}

From here on the model sees only these T = {len(run.ids)} integers."""


def embedding_section(run: Run, shown: set[str]) -> str:
    step = STEPS_BY_NAME["model.embed_tokens"]
    x = run.at(step)
    norms = ", ".join(num(np.linalg.norm(row)) for row in x)
    return f"""## 2. Token ids → vectors: the embedding

Each id selects one row of the embedding table `model.embed_tokens.weight`
({shape_of(run, step, step.weight)}). The rows are the model's learned starting point for each
token; from here on every token is a vector of D = {run.model.config.hidden_size} numbers, and the
sequence is a matrix {shape_of(run, step)}. This matrix is the **residual stream**: every layer reads
it and adds its own contribution to it.

The lines of `Qwen3Model.forward_batch` (which `forward` calls with one sequence; a batch packs
several sequences' tokens one after another) up to this point check the ids and find their
positions, build the RoPE angle tables once for all layers (step 3.7 uses them), and look up the
embeddings. (This is the readable path, which every traced pass like this one runs; untraced calls
go to `qwen_np/fast.py`'s `FastQwen3Model.forward_batch`, the same math arranged for speed, unless
the model was loaded with `fast=False`.)

{step_code(step, shown)}

Real values: the vector of `{token_text(run.tokenizer, run.ids[0])}` starts {values(x[0])}; the
lengths (L2 norms) of the {len(run.ids)} vectors are {norms}."""


def layer_section(run: Run, shown: set[str]) -> str:
    trace = io.StringIO()
    run.model.forward(run.ids, trace=Tracer(stream=trace, layers={LAYER}))
    parts = [f"""## 3. Inside layer {LAYER}, step by step

A decoder layer is two blocks, each of which reads a normalised copy of the residual stream and adds
its result back to it:

```
x = x + attention(input_layernorm(x))            # tokens exchange information
x = x + mlp(post_attention_layernorm(x))         # each token is processed on its own
```

All L = {run.model.config.num_hidden_layers} layers do exactly this, each with its own weights.
This is what `python -m qwen_np generate --trace --trace-layers {LAYER}` prints for the prompt: every
step's shape (symbols = numbers), then the mean, standard deviation and largest absolute value of
its output:

{code_block(trace.getvalue(), "text")}

Now each step in turn: the lines of `Qwen3Model._decoder_layer` that compute it (with the
`layers.py` function they call, the first time it appears) and what its real output looks like."""]
    previous_code = None
    for number, step in enumerate((s for s in STEPS if s.in_layer), start=1):
        code = MODEL_CODE[step.name]
        shown_code = ("(computed by the code of the previous step)" if code == previous_code
                      else step_code(step, shown))
        previous_code = code
        parts.append(f"""### 3.{number} `{step.short_name}`: {step.what}

{shown_code}

Output {shape_of(run, step)}. {NOTES[step.short_name](run, step)}""")
    return "\n\n".join(parts)


def stream_into(run: Run, block: str) -> np.ndarray:
    """The residual stream [T, D] entering LAYER's "attention" or "mlp" block."""
    if block == "mlp":
        return run.arrays[f"model.layers.{LAYER}.residual_attn"]
    return run.arrays["model.embed_tokens"] if LAYER == 0 else run.arrays[f"model.layers.{LAYER - 1}.residual_mlp"]


def _first(run: Run, step: Step) -> str:
    return f"At the last position it starts {values(run.at(step)[-1])}."


def _rms_note(run: Run, step: Step) -> str:
    out = run.at(step)
    source = stream_into(run, "mlp" if step.short_name == "post_attention_layernorm" else "attention")
    weight = getattr(run.model.layers[LAYER], step.short_name)
    return (f"The RMS of each position's vector before the norm: {values(np.sqrt(np.mean(source ** 2, -1)), 8)}; "
            f"after it, divided by the learned weight: {values(np.sqrt(np.mean((out / weight) ** 2, -1)), 8)}. "
            "Every token enters the block at the same scale, however large the residual stream has grown; "
            "the weight then scales each of the D features.")


def _heads_note(run: Run, step: Step) -> str:
    c = run.model.config
    out = run.at(step)
    if step.short_name == "self_attn.q_proj":
        return (f"The {c.num_attention_heads * c.head_dim} outputs are cut into H = {c.num_attention_heads} heads of "
                f"Dh = {c.head_dim} (output feature f belongs to head f // Dh). Head 0 at the last position starts "
                f"{values(out[-1, 0])}.")
    extra = (f" Only KVH = {c.num_key_value_heads} key heads for H = {c.num_attention_heads} query heads: "
             f"query head h will read key head h // {c.group_size} (grouped-query attention), which makes the "
             "KV cache smaller." if step.short_name == "self_attn.k_proj" else
             " Values get no norm and no rotation: they are what attention mixes, not what it compares.")
    return f"Head 0 at the last position starts {values(out[-1, 0])}.{extra}"


def _qk_norm_note(run: Run, step: Step) -> str:
    out = run.at(step)
    weight = getattr(run.model.layers[LAYER], step.short_name.split(".")[1])
    per_head = values(np.sqrt(np.mean((out[-1] / weight) ** 2, -1)), 8)
    if step.short_name == "self_attn.k_norm":
        return (f"The same for each of the KVH = {run.model.config.num_key_value_heads} key heads, with its own "
                f"weight (RMS divided by the weight at the last position: {per_head}).")
    return (f"Qwen3 normalises each head's vector over its Dh = {run.model.config.head_dim} numbers, before "
            f"RoPE (Qwen2 had no such norm). At the last position the heads' RMS divided by the weight is "
            f"{per_head}: every head now has the same scale, which keeps the attention scores from growing "
            "without bound.")


def _rope_note(run: Run, step: Step) -> str:
    before = run.arrays[step.name.format(i=LAYER).replace("rope_", "") + "_norm"]
    after = run.at(step)
    lengths = f"{num(np.linalg.norm(before[-1, 0]))} before and {num(np.linalg.norm(after[-1, 0]))} after"
    if step.short_name == "self_attn.rope_k":
        return (f"The keys are rotated by their positions the same way (the last position's head 0 has length "
                f"{lengths}). These rotated keys, and the values, are what the KV cache stores.")
    return (f"Position 0 has angle 0, so it is unchanged (largest change {num(np.abs(after[0] - before[0]).max())}). "
            f"Later positions are rotated, which changes the numbers but not the length: the last position's "
            f"head 0 has length {lengths}. Because q and k are each rotated by their own position, q · k "
            "depends on how far apart the two tokens are, not on where they are.")


def _scores_note(run: Run, step: Step) -> str:
    return ("Head 0's scores: one row per query position, one column per key position. Above the "
            "diagonal a token would look at a later token; the causal mask sets those to −∞.\n\n"
            + matrix(run, run.at(step)[0]))


def _softmax_note(run: Run, step: Step) -> str:
    probs = run.at(step)
    return (f"Head 0's weights: exp(−∞) = 0, so no weight lands on the future, and each row sums to 1 "
            f"(row sums: {values(probs[0].sum(-1), 8)}). The first token can only attend to itself.\n\n"
            + matrix(run, probs[0]))


def _weighted_sum_note(run: Run, step: Step) -> str:
    c = run.model.config
    v = run.arrays[f"model.layers.{LAYER}.self_attn.v_proj"]
    out = run.at(step)
    same = np.abs(out[0, :c.head_dim] - v[0, 0]).max()
    return (f"Each query head's output is its weights times the values of its KV head, and the H heads are "
            f"laid side by side into H·Dh = {c.num_attention_heads * c.head_dim} numbers. Position 0 attends only "
            f"to itself with weight 1, so its head 0 output is exactly v of KV head 0 at position 0 (largest "
            f"difference {num(same)}).")


def _residual_note(run: Run, step: Step) -> str:
    after = run.at(step)
    before = stream_into(run, "mlp" if step.short_name == "residual_mlp" else "attention")
    return (f"The block's output is added to the stream rather than replacing it, so information from "
            f"earlier steps is never lost. RMS of the last position: {num(rms(before[-1]))} before the add, "
            f"{num(rms(after[-1]))} after.")


def _act_note(run: Run, step: Step) -> str:
    gate = run.arrays[f"model.layers.{LAYER}.mlp.gate_proj"]
    probe = np.array([-4, -1, 0, 1, 4], dtype=np.float32)
    return (f"SiLU(g) = g · sigmoid(g) is close to 0 for negative g and close to g for positive g: "
            f"SiLU({values(probe, 5)}) = {values(layers.silu(probe), 5)}. "
            f"{np.mean(gate < 0):.0%} of the gate values here are negative, so those features are mostly "
            "switched off; the rest pass the matching `up` feature through, scaled.")


NOTES: dict[str, Callable[[Run, Step], str]] = {
    "input_layernorm": _rms_note, "post_attention_layernorm": _rms_note,
    "self_attn.q_proj": _heads_note, "self_attn.k_proj": _heads_note, "self_attn.v_proj": _heads_note,
    "self_attn.q_norm": _qk_norm_note, "self_attn.k_norm": _qk_norm_note,
    "self_attn.rope_q": _rope_note, "self_attn.rope_k": _rope_note,
    "self_attn.scores": _scores_note, "self_attn.softmax": _softmax_note,
    "self_attn.weighted_sum": _weighted_sum_note, "self_attn.o_proj": _first,
    "residual_attn": _residual_note, "residual_mlp": _residual_note,
    "mlp.gate_proj": _first, "mlp.up_proj": _first, "mlp.act_fn": _act_note, "mlp.down_proj": _first,
}


TIED_LENS_NOTE = (" The embedding row predicts the current token itself: with tied embeddings the LM head is "
                  "the embedding table, and a vector scores highest against itself.")


def remaining_layers_section(run: Run) -> str:
    c = run.model.config
    rows = "\n".join(
        f"| {i} | {num(rms(run.arrays[f'model.layers.{i}.residual_attn'][-1]))} | "
        f"{num(rms(run.arrays[f'model.layers.{i}.residual_mlp'][-1]))} |" for i in range(c.num_hidden_layers))
    attention = attention_view(run.model, run.ids, run.tokenizer, layer=LAYER, head=0)
    return f"""## 4. The other layers, and what each one "thinks"

Every layer repeats section 3 with its own weights. The RMS of the residual stream at the last
position after each block:

| layer | after attention | after MLP |
|---:|---:|---:|
{rows}

**Attention view.** `python -m qwen_np generate --attention {LAYER}:0 ...` draws one head's weights as a
heatmap: the last token's weights over the prompt, then the whole causal grid (add `--attention-png
FILE` for an image):

{code_block(attention, "text")}

**Logit lens.** Section 5 turns the final residual stream into a prediction. Nothing stops us from
applying the same final norm and LM head to the stream after *any* layer, which shows what the model
would predict if it stopped there. In a trained model the prediction sharpens layer by layer; here
the weights are random, so the rows are noise, but the last row is by construction exactly the
model's own prediction.{TIED_LENS_NOTE if run.model.config.tie_word_embeddings else ""}
`python -m qwen_np generate --lens ...` prints:

{code_block(logit_lens(run.model, run.ids, run.tokenizer, top_k=3), "text")}"""


def prediction_section(run: Run, shown: set[str]) -> str:
    probs = layers.softmax(run.logits[-1])
    top = np.argsort(-probs, kind="stable")[:5]
    rows = "\n".join(f"| {rank} | {i} | `{token_text(run.tokenizer, int(i), width=40)}` | {num(run.logits[-1, i])} | "
                     f"{num(probs[i])} |" for rank, i in enumerate(top, start=1))
    final_norm, head = STEPS_BY_NAME["model.norm"], STEPS_BY_NAME["lm_head"]
    tied = ("The bundled model, like Qwen3-0.6B/1.7B/4B, ties the LM head to the embedding table (the same "
            "matrix turns ids into vectors and vectors into scores); Qwen3-8B/14B/32B have a separate "
            "`lm_head.weight`." if run.model.config.tie_word_embeddings else "")
    return f"""## 5. Final norm → logits → the next token

After the last layer, one more RMSNorm, then the LM head: a matrix product of the normed stream
with a [V, D] matrix, giving one score (**logit**) per vocabulary entry at every position. {tied}

{step_code(final_norm, shown)}

{step_code(head, shown)}

The logits are {shape_of(run, head)}: every position predicts the token after it, but to continue
the prompt only the last row matters. Softmax turns that row into probabilities; the five largest:

| rank | id | token | logit | probability |
|---:|---:|---|---:|---:|
{rows}

Greedy decoding would append `{token_text(run.tokenizer, int(top[0]), width=40)}`; sampling (what
`generate` does by default, with Qwen3's temperature 0.6, top-k 20, top-p 0.95) draws from these
probabilities. With random weights they are nearly uniform over {run.model.config.vocab_size:,}
tokens (uniform would be {num(1 / run.model.config.vocab_size)} each), and the winner is arbitrary."""


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
    prefill_pass = forward_flops(real, 1000, 1000)
    return f"""## 6. Generating more: why the KV cache exists, and what it costs

To write a second token, the model runs again on the prompt plus the new token. Almost all of that
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
{num(prefill_pass / 1e12, 3)} TFLOP per token; with the cache a decode step costs
{num(forward_flops(real, 1, 1001) / 1e9, 3)} GFLOP, a thousand times less.

**What it costs.** Per token it holds 2 (k and v) × L × KVH × Dh values: for Qwen3-8B
2 × {real.num_hidden_layers} × {real.num_key_value_heads} × {real.head_dim} =
{per_token // 2:,} values, **{per_token // 1024} KiB per token in BF16**, and at the
{context:,}-token context limit {num(per_token * context / 2 ** 30)} GiB, on top of the weights.
Grouped-query attention is what keeps this down: with one KV head per query head (H = KVH =
{real.num_attention_heads}) it would be {mha // 1024} KiB per token. (qwen_np keeps its cache in FP32, twice
the BF16 figures.) The bundled model needs {kv_cache_bytes_per_token(c, 4):,} bytes per token in FP32."""


def formats_section(run: Run) -> str:
    real = preset(REAL)
    params = parameter_count(real)
    stored = run.model.layers[0].q_proj[0, :3]                       # FP32, upcast from the stored BF16
    bits = f32_to_bf16_bits(stored)
    pi_bf16, big_bf16 = round_to_bf16(np.pi), round_to_bf16(70000)
    with np.errstate(over="ignore"):
        big_fp16 = np.float16(70000)
    accumulated = np.float32(0)
    for _ in range(1000):    # add 0.01 a thousand times, rounding the running total to BF16 each time
        accumulated = round_to_bf16(accumulated + np.float32(0.01))
    rows = "\n".join(f"| {fmt} | {BYTES_PER_VALUE[fmt]:g} | {layout} | "
                     f"{num(params * BYTES_PER_VALUE[fmt] / 2 ** 30)} GiB |" for fmt, layout in FORMAT_LAYOUTS.items())
    return f"""## 7. Number formats: FP32, BF16, FP16, FP8, and what upcasting does

A weight is a real number stored in a fixed number of bits: a sign, an exponent (the range) and a
mantissa (the precision).

| format | bytes | sign / exponent / mantissa bits, largest value, relative step | Qwen3-8B weights |
|---|---:|---|---:|
{rows}

* **BF16** keeps FP32's 8 exponent bits (same range, about 1e-38 to 3e38) and cuts the mantissa to 7
  bits: about 3 significant digits. π becomes {float(pi_bf16)}. Qwen3 is released in BF16.
* **FP16** has more precision (10 mantissa bits) but a tiny range: 70,000 becomes {big_fp16} in FP16,
  {float(big_bf16):,.0f} in BF16. Activations of large models do exceed 65,504, which is why training moved to BF16.
* **FP8** (E4M3, E5M2) and **INT8/INT4** are for inference on hardware that supports them, with
  per-block scale factors to recover the range (a few % extra bytes, not counted above).

**Upcasting BF16 → FP32 is exact**: a BF16 number is the top 16 bits of an FP32 number, so qwen_np
shifts the stored bits left by 16 and reinterprets them. No information is added or lost:

{code_block(inspect.getsource(bf16_bits_to_f32))}

The first stored weights of layer 0's `q_proj` are the BF16 bit patterns
{", ".join(f"0x{b:04x}" for b in bits)}, which upcast to {values(stored, 3)}.

What computing in FP32 buys is precision in the *arithmetic*: sums over thousands of products lose
far less to rounding. Adding 0.01 a thousand times should give 10; rounding the running total to BF16
after every addition (as a BF16-only computation would) gives {num(accumulated)}, because once the
total is large, 0.01 is smaller than half a BF16 step and the addition does nothing. qwen_np computes
everything in FP32 (what transformers' FP32 reference does), from weights that were BF16 on disk."""


def round_to_bf16(x: float) -> np.float32:
    """x rounded to the nearest BF16 number (as torch's .to(bfloat16) does), back in FP32."""
    return bf16_bits_to_f32(f32_to_bf16_bits(np.array([x], dtype=np.float32)))[0]


FORMAT_LAYOUTS = {
    "FP32": "1 / 8 / 23, 3.4e38, 1.2e-7",
    "BF16": "1 / 8 / 7, 3.4e38, 7.8e-3",
    "FP16": "1 / 5 / 10, 65504, 9.8e-4",
    "FP8": "E4M3: 1 / 4 / 3, 448, 0.125; E5M2: 1 / 5 / 2, 57344, 0.25",
    "INT8": "integers −128…127, times a scale per block",
    "INT4": "integers −8…7, times a scale per block",
}


def bandwidth_section(run: Run) -> str:
    real = preset(REAL)
    read = weight_bytes_read_per_token(real, 2)
    decode = forward_flops(real, 1, 1001)
    memory_time, compute_time = read / EXAMPLE_BANDWIDTH, decode / EXAMPLE_FLOPS
    block_bytes = layers.UPCAST_BLOCK_ROWS * real.hidden_size * 4
    ours = weight_bytes_read_per_token(run.model.config, 4)
    return f"""## 8. Why decode speed is set by memory bandwidth, and what the CPU caches do

A decode step multiplies one token's vector by every weight matrix: each weight is read once and
used for one multiply-add (2 FLOPs). For Qwen3-8B in BF16 that is {num(read / 1e9)} GB read for
{num(decode / 1e9)} GFLOP: about one FLOP per byte.

Take a desktop with, say, {EXAMPLE_BANDWIDTH / 1e9:g} GB/s of memory bandwidth and {EXAMPLE_FLOPS / 1e12:g}
TFLOP/s of FP32 matmul (round example figures; `python -m qwen_np inspect` measures this machine's
bandwidth). Reading the weights takes {num(memory_time, 2)} s, the arithmetic {num(compute_time, 2)} s. The
processor spends most of each token waiting for memory, so **decode speed ≈ bandwidth ÷ bytes of
weights**: at most {num(1 / memory_time, 2)} tokens/s here, whatever the core count. Fewer bytes per
weight (BF16 instead of FP32, or INT4) is faster for exactly this reason.

Prefill is different: the T prompt tokens share each weight read, so it does T FLOPs per byte and is
limited by arithmetic instead. That is why a long prompt is processed far faster per token than
tokens are generated.

**CPU caches.** Caches (tens of MB of L3) hold recently used memory close to the cores. The 8B
weights ({num(parameter_count(real) * 2 / 2 ** 30)} GiB in BF16) are a thousand times larger, so every
token streams them from DRAM again; caching cannot help with the weights themselves. It does help
with what we do to them: when the weights stay in BF16, `layers.linear` upcasts
{layers.UPCAST_BLOCK_ROWS} rows at a time ({num(block_bytes / 2 ** 20)} MiB in FP32 for Qwen3-8B), a block
small enough to still be in cache when the matrix product reads it back, so the FP32 copy costs no
extra DRAM traffic and never exists in full:

{code_block(inspect.getsource(layers.linear))}

The bundled model reads {ours / 2 ** 20:.1f} MiB of FP32 weights per token, almost all of it the
[V, D] LM head matrix: even a tiny network pays for a real vocabulary."""


def training_section() -> str:
    real = preset(REAL)
    params = parameter_count(real)
    rows = [("BF16 weights (what inference loads)", 2), ("FP32 master weights", 4), ("gradients (BF16)", 2),
            ("Adam first moment m (FP32)", 4), ("Adam second moment v (FP32)", 4)]
    table = "\n".join(f"| {what} | {width} | {num(params * width / 1e9)} GB |" for what, width in rows)
    total = sum(width for _, width in rows)
    return f"""## 9. What a training checkpoint holds beyond the inference weights

A released model (`model.safetensors`) holds only what the forward pass needs: one number per
parameter, {num(params * 2 / 1e9)} GB for Qwen3-8B in BF16. Training with AdamW in mixed precision keeps
much more per parameter, and a checkpoint to *resume* training has to save it:

| state per parameter | bytes | Qwen3-8B |
|---|---:|---:|
{table}
| **total** | **{total}** | **{num(params * total / 1e9)} GB** |

* **Master weights**: the optimizer updates an FP32 copy, because many updates are smaller than a
  BF16 step (section 7) and would round away; the BF16 weights are re-derived from it.
* **Adam moments**: running averages of each parameter's gradient (m) and squared gradient (v); they
  set each parameter's step size. Gradients themselves are usually not saved: they are recomputed.
* Also saved, and small: the step count, the learning-rate schedule's position, the random number
  generator states and the data order (so a resumed run sees the data it would have seen).

None of that is needed to run the model, so releases drop it: {total // 2}× smaller."""


def next_steps_section() -> str:
    return """## 10. Try it yourself

```text
python -m qwen_np inspect --preset qwen3-8b             # every shape and count above at full size
python -m qwen_np generate --trace --trace-layers 0 "The capital of France is"
python -m qwen_np generate --lens "The capital of France is"
python -m qwen_np generate --model Qwen/Qwen3-0.6B "The capital of France is"   # a trained model
```

In Python, any forward pass can be traced:

```python
from qwen_np import load_model
from qwen_np.inspection import Tracer
model = load_model("weights")
model.forward([785, 6722, 315, 9625, 374], trace=Tracer())
```"""


def render(model_dir: Path = BUNDLED_MODEL) -> str:
    """The whole walkthrough as markdown, from a real run on the model in `model_dir`."""
    with threadpool_limits(limits=1):        # one BLAS thread: the same sums in the same order every run
        run = run_prompt(model_dir)
        shown: set[str] = set()              # layers.* functions whose source is already on the page
        sections = [intro(run), tokens_section(run), embedding_section(run, shown), layer_section(run, shown),
                    remaining_layers_section(run), prediction_section(run, shown), kv_cache_section(run),
                    formats_section(run), bandwidth_section(run), training_section(), next_steps_section()]
    return "\n\n".join(sections) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=BUNDLED_MODEL, help="checkpoint folder (default: weights)")
    parser.add_argument("--out", type=Path, default=WALKTHROUGH, help="output file (default: docs/walkthrough.md)")
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(args.model), encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
