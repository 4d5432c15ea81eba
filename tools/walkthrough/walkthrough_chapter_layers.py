"""The walkthrough's chapters on the layers: 3, one decoder layer step by step (with the figures of the layer
and of RoPE), and 4, the other layers, the attention view and the logit lens."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from qwen_np.core import layers
from qwen_np import preset
from qwen_np.core.config import PRESETS, Qwen3Config
from qwen_np.inspection import STEPS, Step, attention_weights, lens_probabilities, token_text
from walkthrough_common import (ATTENTION_LAYER, LAYER, MODEL_CODE, REAL, Run, code_block, command_stderr,
                                generate_command, matrix, num, rms, shape_of, step_code, values)
from walkthrough_training import below


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
            f"{num(rms(after[-1]))} after." + (
                " No norm follows the MLP (a common misreading of pre-norm): the sum goes on as it is, and the "
                "next layer's `input_layernorm` (or, after the last layer, the final `norm`) is what rescales it."
                if step.short_name == "residual_mlp" else ""))


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
    group = run.model.config.group_size
    run.figures["attention"] = {"layer": ATTENTION_LAYER, "labels": labels, "weights": weights.tolist(),
                                "kv_heads": [h // group for h in range(weights.shape[0])]}
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
