"""Write docs/walkthrough.md (and its figures and notebook) by running qwen_np on the bundled model.

The code shown is pulled from qwen_np's source with inspect.getsource, every shape and number comes
from running that code on weights/ (or --model), and every command's output on the page is what
that command prints (the generator runs it in-process), so none of them can drift from the library:
tests/test_walkthrough.py regenerates everything and fails when the committed files differ. The
output is deterministic: BLAS runs on one thread and numbers are printed to 4 significant digits.

The page is assembled here from its chapters: the shared run and formatting in walkthrough_common.py,
sections 5-6 in walkthrough_chapter_prediction.py, 7-8 in
walkthrough_chapter_numbers.py, 9-10 in walkthrough_training.py, 11 in
walkthrough_chapter_train.py; sections 0-4 and 12 are still in this file.

Usage: python tools/make_walkthrough.py [--model weights]     (writes the page, figures and notebook)
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
from threadpoolctl import threadpool_limits

# walkthrough_common first: it puts this checkout on sys.path. Some names are imported for the tests.
from walkthrough_common import (ATTENTION_LAYER, BUNDLED_MODEL, CACHE_TOLERANCE, DOCS,  # noqa: F401
                                FIGURE_TEMPERATURES, LAYER, QWEN3_TOKENIZER_FOLDERS, REAL, SMALL_REAL, WALKTHROUGH,
                                MODEL_CODE, Run, code_block, command_stderr, generate_command, matrix, model_digest, num,
                                rms, run_prompt, shape_of, shell_quote, step_code, values)

from qwen_np import layers, preset
from qwen_np.config import PRESETS, Qwen3Config, parameter_count
from qwen_np.errors import QwenNPError
from qwen_np.inspection import (STEPS, STEPS_BY_NAME, SYMBOL_MEANINGS, Step, attention_weights,
                                dimensions, lens_probabilities, token_text)
from qwen_np.tokenizer import Tokenizer
from walkthrough_chapter_numbers import bandwidth_section, formats_section
from walkthrough_chapter_prediction import kv_cache_section, prediction_section
from walkthrough_training import below

# --- Sections ------------------------------------------------------------------------------------

def intro(run: Run) -> str:
    c, real = run.model.config, preset(REAL)
    ours, theirs = dimensions(c, len(run.ids)), dimensions(real, len(run.ids))
    table = "\n".join(f"| `{sym}` | {SYMBOL_MEANINGS[sym]} | {ours[sym]:,} | {theirs[sym]:,} |" for sym in ours)
    return f"""# Walkthrough: from a prompt to the next token, and training one yourself

**The model** on this page is Qwen3's exact architecture at a small size: {parameter_count(c):,} parameters,
trained from scratch on Shakespeare's plays by qwen_np's own NumPy trainer (`python -m qwen_np train`),
with a {c.vocab_size:,}-token byte-level BPE vocabulary learned from the same text. Give it
`{run.prompt!r}` and it answers `{token_text(run.tokenizer, run.answer)}`, the word that follows in the play.

**What you will see**: that prompt going through every step of the forward pass (sections 1 to 6:
tokens, embeddings, attention, the MLP, the prediction, the KV cache), each with the code that does it,
the real shapes and numbers it produces and a short reason for the design; what number formats and
memory bandwidth do to it (7, 8); one training step on it (9) and what training holds in memory (10);
then a model like it trained by you from random weights in a few minutes (11): the data, the loss
falling, words appearing, validation, early stopping, batch size, checkpoints and the test split.

The dimensions (symbols used everywhere in qwen_np's shape comments):

| symbol | meaning | bundled model | Qwen3-8B |
|---|---|---:|---:|
{table}

{c.vocab_size * c.hidden_size:,} of the bundled model's parameters are the embedding table; Qwen3-8B has
{parameter_count(real):,}. Every step below is exactly what Qwen3-8B computes, only wider and deeper. To
see every shape at Qwen3-8B's size, run `python -m qwen_np inspect --preset qwen3-8b`.

This page is **generated**: `python tools/make_walkthrough.py` runs qwen_np on the bundled model in
`weights/` (weights digest `{model_digest(run.model_dir)}`) and writes this file, its figures in `docs/figures/`,
the notebook `docs/walkthrough.ipynb` (the same steps as code cells) and the glossary, and
`tests/test_walkthrough.py` fails if a committed file differs from a fresh run, so the code, numbers
and command outputs here are always the ones the library has now."""


def tokens_section(run: Run) -> str:
    rows = "\n".join(f"| {p} | {i} | `{token_text(run.tokenizer, i, width=40)}` |" for p, i in enumerate(run.ids))
    return f"""## 1. Prompt → token ids

The tokenizer (byte-level BPE, `qwen_np/tokenizer.py`) cuts the text into pieces from a fixed
vocabulary of {run.model.config.vocab_size:,} entries and replaces each piece by its id. A leading
space belongs to the word after it. No start-of-text token is added: Qwen3 never adds one.

{code_block(f"ids = tokenizer.encode({run.prompt!r})   # -> {run.ids}")}

| position | id | piece |
|---:|---:|---|
{rows}

From here on the model sees only these T = {len(run.ids)} integers.

{chat_template_note()}"""


CHAT_QUESTION = "Who wrote Hamlet?"


def qwen3_tokenizer() -> Tokenizer:
    """The real Qwen3 tokenizer of QWEN3_TOKENIZER_FOLDERS (one with a <think> chat template)."""
    for folder in QWEN3_TOKENIZER_FOLDERS:
        config = folder / "tokenizer_config.json"
        if config.is_file() and "<think>" in config.read_text(encoding="utf-8"):
            return Tokenizer.from_folder(folder)
    raise QwenNPError(f"make_walkthrough: no Qwen3 tokenizer with a chat template in {QWEN3_TOKENIZER_FOLDERS}")


def chat_template_note() -> str:
    tokenizer = qwen3_tokenizer()
    messages = [{"role": "user", "content": CHAT_QUESTION}]
    thinking = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    direct = tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False)
    plain = len(tokenizer.encode(CHAT_QUESTION))
    return f"""**What a chat model adds to the prompt.** The bundled model continues raw text, so every command
on this page passes `--no-chat`. A chat model such as Qwen3-8B was fine-tuned on conversations
written in a fixed layout, its **chat template** (a Jinja program in `tokenizer_config.json`), and
answers well only when the prompt is written the same way. `generate` applies it unless `--no-chat`
is given. With the real Qwen3 tokenizer, the question `{CHAT_QUESTION!r}` ({plain} tokens as plain text)
becomes:

{code_block(thinking, "text")}

{len(tokenizer.encode(thinking))} tokens: `<|im_start|>` and `<|im_end|>` are single special tokens that
frame each turn, and the prompt ends where the assistant's turn begins. Qwen3 then *thinks* first:
it writes its reasoning between `<think>` and `</think>`, then the answer. With `--no-think`
(`enable_thinking=False`) the template writes an empty thinking block itself, so the model answers
at once ({len(tokenizer.encode(direct))} tokens):

{code_block(direct, "text")}"""


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
    trace = command_stderr(run, "--trace-layers", str(LAYER))
    parts = [f"""## 3. Inside layer {LAYER}, step by step

A decoder layer is two blocks, each of which reads a normalised copy of the residual stream and adds
its result back to it:

```
x = x + attention(input_layernorm(x))            # tokens exchange information
x = x + mlp(post_attention_layernorm(x))         # each token is processed on its own
```

All L = {run.model.config.num_hidden_layers} layers do exactly this, each with its own weights.
This is what

{code_block(generate_command(run, "--trace-layers", str(LAYER)), "bash")}

prints on stderr (`--no-chat`: the prompt is fed as plain text; `-n 1`: one new token): every
step's shape (symbols = numbers), then the mean, standard deviation and largest absolute value of
its output:

{code_block(trace, "text")}

![One decoder layer: every step and its output shape at this prompt](figures/decoder_layer.png)

Now each step in turn: the lines of `Qwen3Model.decoder_layer` that compute it (with the
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
            "the weight then scales each of the D features." + (rms_why(run) if step.short_name == "input_layernorm" else ""))


def rms_why(run: Run) -> str:
    grown = [rms(run.arrays[f"model.layers.{i}.residual_mlp"][-1]) for i in range(run.model.config.num_hidden_layers)]
    return ("\n\n*Why RMSNorm, and why before the block (pre-norm).* LayerNorm subtracts the mean and divides by the "
            "standard deviation, then adds a bias; RMSNorm only divides by the root mean square: one reduction "
            "instead of two and no bias, and it trains as well. The norm sits *before* each block, on a copy: the "
            "residual stream itself is never normalised, so the sum x + block(x) passes gradients from the loss "
            "straight down to the embedding (post-norm, the original Transformer's, normalised the sum itself "
            "and needed careful warmup to train deep). The stream is free to grow: the RMS of the last position "
            f"after each layer is {values(np.array(grown), len(grown))}, yet every block reads it at RMS 1.")


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
    w = run.model.layers[LAYER]
    Dh = run.model.config.head_dim
    bound = float(np.abs(w.q_norm).max() * np.abs(w.k_norm).max()) * Dh ** 0.5
    scores = run.arrays[f"model.layers.{LAYER}.self_attn.scores"]
    largest = float(np.abs(scores[np.isfinite(scores)]).max())
    return (f"Qwen3 normalises each head's vector over its Dh = {Dh} numbers, before RoPE. At the last position "
            f"the heads' RMS divided by the weight is {per_head}: every head now has the same scale.\n\n"
            "*Why per-head QK-norm.* Qwen2 added a learned bias to q, k and v; Qwen3 dropped the biases and "
            "normalises q and k instead. The attention score q · k / sqrt(Dh) can then no longer grow without "
            "bound as training scales the weights up (large scores saturate the softmax, and training stalls "
            "or diverges): after the norm, |q| <= max|q_norm weight| · sqrt(Dh) and likewise for k, so in this "
            f"layer no score can exceed {num(bound)} whatever the input (Cauchy-Schwarz). The largest here is "
            f"{num(largest)}.")


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
            "depends on how far apart the two tokens are, not on where they are." + rope_why(run))


def interleaved_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """RoPE in the interleaved layout (GPT-J, Meta's Llama code): dimension 2i rotates with 2i+1."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]                                  # [T, 1, Dh/2]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = even * c - odd * s, odd * c + even * s
    return out


def rope_why(run: Run) -> str:
    c = run.model.config
    inv_freq = layers.rope_inverse_frequencies(c.head_dim, c.rope_theta)            # [Dh/2]
    periods = 2 * np.pi / inv_freq
    slow = int(np.sum(periods > c.max_position_embeddings))
    llama = 2 * np.pi / layers.rope_inverse_frequencies(c.head_dim, 10_000.0)
    real = preset(REAL)
    real_slow = [int(np.sum(2 * np.pi / layers.rope_inverse_frequencies(real.head_dim, theta)
                            > real.max_position_embeddings)) for theta in (real.rope_theta, 10_000.0)]
    # Half-split vs interleaved: reorder each head's q and k features (i, i + Dh/2) -> (2i, 2i+1), which is
    # what reordering the rows of q_proj/k_proj (and the q/k norm weights) does, and rotate interleaved.
    q, k = (run.arrays[f"model.layers.{LAYER}.self_attn.{n}_norm"] for n in ("q", "k"))
    order = np.stack([np.arange(c.head_dim // 2), np.arange(c.head_dim // 2) + c.head_dim // 2], -1).reshape(-1)
    cos, sin = layers.rope_angles(inv_freq, np.arange(len(run.ids)))
    half_split = layers.attention_scores(layers.rope(q, cos, sin), layers.rope(k, cos, sin))
    interleaved = layers.attention_scores(interleaved_rope(q[..., order], cos, sin),
                                          interleaved_rope(k[..., order], cos, sin))
    return ("\n\n*Why rope_theta, and the frequency ladder.* Pair i turns by position × inv_freq[i], "
            "inv_freq[i] = theta^(-2i/Dh) (`layers.rope_inverse_frequencies`): a ladder from fast to slow. "
            f"With theta = {c.rope_theta:,.0f} and Dh = {c.head_dim}, the periods (2π / inv_freq, in tokens) run "
            f"{values(periods, 3)} up to {num(periods[-1])}: the fast pairs tell neighbours apart, the slow ones "
            f"change little over the whole text and carry meaning that position should not disturb. "
            f"{slow} of the {len(periods)} pairs never complete a turn within the {c.max_position_embeddings}-token "
            f"context. The original RoPE used theta = 10,000 (slowest period {num(llama[-1])} tokens). A larger theta "
            "slows the whole ladder down, so that the slow pairs have not wrapped around (which would make far "
            f"positions look near) even at long range: for Qwen3-8B (Dh = {real.head_dim}), {real_slow[0]} of "
            f"{real.head_dim // 2} pairs never complete a turn in its {real.max_position_embeddings:,}-token context "
            f"with theta = 1,000,000, against {real_slow[1]} with 10,000 (`docs/figures/rope.png`).\n\n"
            "*Half-split vs interleaved.* qwen_np (like transformers' Qwen3) rotates dimension i with i + Dh/2; "
            "Meta's original Llama code rotates 2i with 2i+1. The rotation is the same; only which features form a "
            "pair differs, so reordering the rows of q_proj and k_proj turns one layout into the other. On this "
            "prompt's normed q and k, reordered and rotated the interleaved way, the scores differ from the "
            f"half-split ones by less than {below(np.abs(half_split - interleaved).max(), 1e-5)} (FP32 rounding). A "
            "checkpoint converted between the two without that reordering runs but produces garbage.\n\n"
            f"![RoPE: the frequency ladder and one pair's rotation](figures/rope.png)")


def _scores_note(run: Run, step: Step) -> str:
    Dh = run.model.config.head_dim
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 10_000, Dh))
    raw_std = float(np.std(np.sum(a * b, -1)))
    scores = run.at(step)                                                            # [H, T, S]
    sharp = layers.softmax(scores * np.float32(Dh ** 0.5))                           # without the scale
    return ("Head 0's scores: one row per query position, one column per key position. Above the "
            "diagonal a token would look at a later token; the causal mask sets those to −∞.\n\n"
            + matrix(run, scores[0]) + "\n\n"
            f"*Why divide by sqrt(Dh).* A dot product of two vectors of Dh = {Dh} independent unit-variance "
            f"numbers has standard deviation sqrt(Dh) = {num(Dh ** 0.5)} (10,000 random pairs: {num(raw_std)}). "
            "Scores that large make the softmax put almost all the weight on one key, and its gradient "
            "vanishes; dividing by sqrt(Dh) brings them back to about 1. Here the largest weight in each row, "
            f"averaged over heads and positions, is {num(np.max(layers.softmax(scores), -1).mean())}; without the "
            f"scale it would be {num(np.max(sharp, -1).mean())}.")


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
            "switched off; the rest pass the matching `up` feature through, scaled.\n\n"
            + swiglu_why(run))


def swiglu_why(run: Run) -> str:
    c = run.model.config
    D, F = c.hidden_size, c.intermediate_size
    ratios = ", ".join(f"{name.removeprefix('qwen3-').upper()} {num(p.intermediate_size / p.hidden_size, 2)}"
                       for name, p in PRESETS.items())
    return ("*Why SwiGLU.* A classic MLP is down(GELU(up(x))): one nonlinearity of one projection. SwiGLU "
            "multiplies two projections, one passed through SiLU: each feature is a product whose gate "
            "depends on the token, so the MLP can switch features on and off per token. At the same number "
            "of parameters it reached a lower loss in Shazeer's comparison (*GLU Variants Improve Transformer*, "
            "2020), and LLaMA, Qwen and most open models since use it. The third matrix costs parameters: a "
            f"4 × D GELU MLP has 2 · D · 4D = 8 · D² = {8 * D * D:,} weights, and SwiGLU matches it at F = 8/3 × D "
            f"= {8 * D // 3} (LLaMA's choice). Qwen3's ratio F / D differs by size: {ratios}; here {F} = "
            f"{num(F / D)} × D: 3 · D · F = {3 * D * F:,} weights per layer.")


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


def lens_note(run: Run, probs: np.ndarray) -> str:
    """What the embedding row of the lens predicts, said as it is (a tied model often, not always, predicts
    the current token there: its logit is the token's embedding row dotted with the normed row itself)."""
    top = int(np.argmax(probs[0]))
    if not run.model.config.tie_word_embeddings:
        return ""
    which = ("the current token itself" if top == run.ids[-1] else
             f"{token_text(run.tokenizer, top)}, not the current token")
    return (f" The embedding row predicts {which}: with tied embeddings the LM head is the embedding table, so "
            "that row scores each token by its embedding's dot product with the current token's (normed) one. "
            "A vector's dot product with itself is often the largest, but not always: another row that is longer, "
            "or points the same way, can score higher.")


def remaining_layers_section(run: Run) -> str:
    c = run.model.config
    group = c.num_attention_heads // c.num_key_value_heads      # query heads per KV head
    sharing = ", ".join(f"{g * group} to {g * group + group - 1}" for g in range(c.num_key_value_heads))
    rows = "\n".join(
        f"| {i} | {num(rms(run.arrays[f'model.layers.{i}.residual_attn'][-1]))} | "
        f"{num(rms(run.arrays[f'model.layers.{i}.residual_mlp'][-1]))} |" for i in range(c.num_hidden_layers))
    head = f"{ATTENTION_LAYER}:0"
    weights = attention_weights(run.model, run.ids, ATTENTION_LAYER)                   # [H, T, T]
    labels = [token_text(run.tokenizer, i) for i in run.ids]
    run.figures["attention"] = {"layer": ATTENTION_LAYER, "labels": labels, "weights": weights.tolist()}
    lens_labels, lens, _ = lens_probabilities(run.model, run.ids)
    run.figures["logit_lens"] = logit_lens_grid(run)
    run.figures["residual_stream"] = residual_stream_data(run, labels)
    return f"""## 4. The other layers, and what each one "thinks"

Every layer repeats section 3 with its own weights, and each block adds its output to the residual
stream, which grows layer by layer (its size at every position: `docs/figures/residual_stream.png`):

![The residual stream's RMS after each block, at every position](figures/residual_stream.png)

The RMS of the residual stream at the last position after each block:

| layer | after attention | after MLP |
|---:|---:|---:|
{rows}

**Attention view.**

{code_block(generate_command(run, "--attention", head, "--attention-png", "attention.png"), "bash")}

draws one head's weights: the last token's weights over the prompt, then the whole causal grid, and
(with `--attention-png`) a labelled heatmap. It prints:

{code_block(command_stderr(run, "--attention", head), "text")}

All {c.num_attention_heads} heads of layer {ATTENTION_LAYER} side by side (`docs/figures/attention.png`): each head
learns its own pattern; the {c.num_attention_heads} query heads read {c.num_key_value_heads} key/value heads, so query head h
reads KV head h // {group} (heads {sharing} share one each).

![Attention weights of every head of layer {ATTENTION_LAYER}](figures/attention.png)

For any prompt you type, any layer and any head: `python -m qwen_np serve`, then open
http://127.0.0.1:8000/ (README, "In a browser"). Its explorer draws these heatmaps with the tokens on
both axes, and every head of a layer grouped by the KV head it reads.

**Logit lens.** Section 5 turns the final residual stream into a prediction. Nothing stops us from
applying the same final norm and LM head to the stream after *any* layer, which shows what the model
would predict if it stopped there; the last row is by construction exactly the model's own
prediction.{lens_note(run, lens)}

{code_block(generate_command(run, "--lens"), "bash")}

prints:

{code_block(command_stderr(run, "--lens"), "text")}

The same lens at every position, top token and its probability (`docs/figures/logit_lens.png`): row
"layer l" is what the stream after layer l predicts as the token following each prompt token.

![Logit lens: the top next token after each layer, at every position](figures/logit_lens.png)"""


def residual_stream_data(run: Run, labels: list[str]) -> dict[str, Any]:
    """The residual stream's RMS [blocks + 1, T]: after the embedding, then after every attention and MLP block."""
    names = ["model.embed_tokens"] + [f"model.layers.{i}.{block}" for i in range(run.model.config.num_hidden_layers)
                                      for block in ("residual_attn", "residual_mlp")]
    return {"blocks": ["embedding"] + [f"{i} {block}" for i in range(run.model.config.num_hidden_layers)
                                       for block in ("attn", "mlp")],
            "labels": labels, "rms": [[rms(row) for row in run.arrays[name]] for name in names]}


def logit_lens_grid(run: Run) -> dict[str, Any]:
    """The lens at every position: top-1 token text and probability for [L+1 rows, T positions]."""
    residuals = [run.arrays["model.embed_tokens"]] + [run.arrays[f"model.layers.{i}.residual_mlp"]
                                                       for i in range(run.model.config.num_hidden_layers)]
    normed = layers.rms_norm(np.stack(residuals), run.model.norm, run.model.config.rms_norm_eps)   # [L+1, T, D]
    probs = layers.softmax(layers.linear(normed, run.model.lm_head))                  # [L+1, T, V]
    top = np.argmax(probs, -1)                                                         # [L+1, T]
    return {"rows": ["embedding"] + [f"layer {i}" for i in range(len(residuals) - 1)],
            "positions": [token_text(run.tokenizer, i) for i in run.ids],
            "tokens": [[token_text(run.tokenizer, int(t)) for t in row] for row in top],
            "probabilities": np.take_along_axis(probs, top[..., None], -1)[..., 0].tolist()}


def next_steps_section(run: Run) -> str:
    prompt = shell_quote(run.prompt)
    return f"""## 12. Try it yourself

```bash
python -m qwen_np inspect --preset qwen3-8b          # every shape and count above at full size, and its memory
{generate_command(run, "--trace-layers", str(LAYER))}
{generate_command(run, "--lens")}
python -m qwen_np generate --no-chat -n 40 {prompt}   # let it go on
python -m qwen_np train --preset tiny --out /tmp/tiny  # a whole training run, in seconds
```

The same steps as runnable code: [`docs/walkthrough.ipynb`](walkthrough.ipynb). In Python, any
forward pass can be traced:

```python
from qwen_np import load_model
from qwen_np.inspection import Tracer
from qwen_np.tokenizer import Tokenizer
model, tokenizer = load_model("weights"), Tokenizer.from_folder("weights")
model.forward(tokenizer.encode({run.prompt!r}), trace=Tracer())
```

The words this page uses, with the function, flag and section for each: [`docs/glossary.md`](glossary.md)."""


@dataclass
class Page:
    """The generated files' contents: the walkthrough, its figures' data, and the notebook's sections."""

    markdown: str
    sections: list[str]                  # the markdown split into the page's sections, in order
    figures: dict[str, Any]              # figure name -> the numbers it is drawn from
    model_dir: Path
    run: Run
    facts: dict[str, Any]                # numbers on the page that the notebook's code must reproduce


def render_page(model_dir: Path | None = None) -> Page:
    """The whole walkthrough, from a real run on the model in `model_dir` (default: BUNDLED_MODEL)."""
    model_dir = model_dir or BUNDLED_MODEL
    from walkthrough_chapter_train import chapter_section, load_record
    from walkthrough_training import memory_section, training_step_section

    with threadpool_limits(limits=1):        # one BLAS thread: the same sums in the same order every run
        run = run_prompt(model_dir)
        run.figures["rope"] = rope_figure_data(run.model.config)
        run.figures["decoder_layer"] = decoder_layer_data(run)
        run.figures["training_run"] = load_record()
        shown: set[str] = set()              # layers.* functions whose source is already on the page
        facts: dict[str, Any] = {}
        sections = [intro(run), tokens_section(run), embedding_section(run, shown), layer_section(run, shown),
                    remaining_layers_section(run), prediction_section(run, shown), kv_cache_section(run),
                    formats_section(run), bandwidth_section(run), training_step_section(model_dir, num, code_block, facts),
                    memory_section(model_dir, num, run.figures), chapter_section(11), next_steps_section(run)]
    return Page("\n\n".join(sections) + "\n", sections, run.figures, model_dir, run, facts)


def render(model_dir: Path | None = None) -> str:
    """The walkthrough's markdown."""
    return render_page(model_dir).markdown


def rope_figure_data(config: Qwen3Config) -> dict[str, Any]:
    """The frequency ladder (period of each pair) at this theta and at 10,000, and pair 0's and a slow pair's
    angle over the first positions."""
    inv_freq = layers.rope_inverse_frequencies(config.head_dim, config.rope_theta)
    positions = np.arange(16)
    pairs = [0, config.head_dim // 8, config.head_dim // 4]
    return {"head_dim": config.head_dim, "rope_theta": config.rope_theta,
            "periods": (2 * np.pi / inv_freq).tolist(),
            "periods_theta_1e4": (2 * np.pi / layers.rope_inverse_frequencies(config.head_dim, 10_000.0)).tolist(),
            "context": config.max_position_embeddings, "pairs": pairs, "positions": positions.tolist(),
            "angles": [(positions * float(inv_freq[i])).tolist() for i in pairs]}


def decoder_layer_data(run: Run) -> dict[str, Any]:
    """The boxes of the decoder-layer diagram: each step inside a layer, with its shape at this prompt."""
    return {"steps": [{"name": step.short_name, "shape": shape_of(run, step)} for step in STEPS if step.in_layer],
            "layers": run.model.config.num_hidden_layers}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=BUNDLED_MODEL, help="checkpoint folder (default: weights)")
    parser.add_argument("--docs", type=Path, default=DOCS,
                        help="folder for walkthrough.md, walkthrough.ipynb and figures/ (default: docs)")
    args = parser.parse_args(argv)
    from walkthrough_files import write_all

    for path in write_all(render_page(args.model), args.docs):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
