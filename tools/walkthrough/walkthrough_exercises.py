"""The walkthrough's exercises: each a question at the end of its section and a collapsed solution whose
numbers are computed here with qwen_np's own functions. tests/product/test_exercises.py works each one out again,
independently, and checks the page's solution says what it finds, so a solution cannot rot."""

from __future__ import annotations

from typing import Callable

import numpy as np

from qwen_np import preset
from qwen_np.core import layers
from qwen_np.core.flash import flash_attention
from qwen_np.engine import memory, step_memory
from qwen_np.inspection.counts import weight_bytes_read_per_token
from qwen_np.numbers import formats
from qwen_np.core.config import Qwen3Config
from qwen_np.training import gradients, parameters
from qwen_np.training.settings import PRESET_CONFIGS, PRESET_SETTINGS
from qwen_np.training import step as training
from walkthrough_common import EXAMPLE_BANDWIDTH, REAL, Run, num, qwen3_tokenizer

GiB = 2 ** 30
CHAT_MESSAGE = "Hello!"                      # exercise 1's chat turn
KV_MODEL, KV_NAME = "qwen3-14b", "Qwen3-14B"   # exercise 4's model
BF16_PROBES = (1000.0, 1001.0, 1002.0, 1003.0, 1004.0)
TRAIN_MODEL, TRAIN_ROWS, TRAIN_CONTEXT, TRAIN_BUDGET = "qwen3-0.6b", 8, 1024, 24 * GiB   # exercise 7
FLASH_SHAPE = (24, 4, 2, 16)                 # exercise 8: T, H, KVH, Dh
# Exercise 9: the tiny preset's model, a fixed batch of random ids, a few clipped AdamW steps per rate. A run
# "blows up" when some step's loss rises more than BLOW_UP nats above the first (a margin: the exact losses
# of a diverging run change with the BLAS kernel, the verdict does not).
LEARNING_RATES, DIVERGE_STEPS, BLOW_UP = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0), 12, 1.0


def exercise(number: int, title: str, question: str, solution: str) -> str:
    return f"""### Exercise {number}: {title}

{question}

<details><summary>Solution</summary>

{solution}

</details>"""


def chat_tokens(run: Run) -> tuple[str, str, str]:
    tokenizer = qwen3_tokenizer()
    text = tokenizer.apply_chat_template([{"role": "user", "content": CHAT_MESSAGE}], enable_thinking=False)
    ids = tokenizer.encode(text)
    return ("count a chat prompt's tokens",
            f"With the real Qwen3 tokenizer and its chat template (`Tokenizer.apply_chat_template`, "
            f"`enable_thinking=False`), how many tokens does the one user turn `{CHAT_MESSAGE!r}` become, and "
            f"how many of them are the message itself?",
            f"""```python
text = tokenizer.apply_chat_template([{{"role": "user", "content": {CHAT_MESSAGE!r}}}], enable_thinking=False)
len(tokenizer.encode(text))        # {len(ids)}
```

**{len(ids)} tokens**, of which {len(tokenizer.encode(CHAT_MESSAGE))} are `{CHAT_MESSAGE!r}`: the rest is the template's
frame (`<|im_start|>user`, `<|im_end|>`, the assistant's opening and its empty thinking block).""")


def gqa_tile(run: Run) -> tuple[str, str, str]:
    c = run.model.config
    group = c.num_attention_heads // c.num_key_value_heads
    tiled = [h % c.num_key_value_heads for h in range(c.num_attention_heads)]
    repeated = [h // group for h in range(c.num_attention_heads)]
    return ("np.tile instead of np.repeat in GQA",
            "In `layers.attention_scores`, replace `np.repeat(k, group, axis=-2)` by tiling the key heads "
            "(`np.tile`). Which test fails, and why does the model still run?",
            f"""Tiling gives query head h the key head h % KVH instead of h // (H / KVH): on the bundled model
(H = {c.num_attention_heads}, KVH = {c.num_key_value_heads}) the heads read KV heads {tiled} instead of {repeated}.
The shapes are unchanged, so everything still runs, but the numbers are another model's:
`tests/core/test_model.py::test_gqa_query_head_h_reads_kv_head_h_div_group` fails (it checks every query head
against its key head), and so do the comparisons with transformers' logits. With one query head per key
head (MHA, group 1) the two are the same and nothing would notice.""")


def minus_log_p(run: Run) -> tuple[str, str, str]:
    answer = run.answer
    logits = run.logits[-1:].astype(np.float32)                                  # [1, V]
    nll = -float(layers.log_softmax(logits)[0, answer])
    loss, _ = gradients.cross_entropy(logits[None], np.array([[answer]]))
    piece = run.tokenizer.decode([answer])
    return ("the loss of one prediction, by hand",
            f"Compute −ln p of `{piece!r}` after the prompt from the last row of logits, and check that it is the "
            f"cross-entropy training would charge for that one target (`gradients.cross_entropy`).",
            f"""```python
logits = model.forward(ids)[-1:]                                  # [1, V]
-layers.log_softmax(logits)[0, {answer}]                           # {num(nll)}
gradients.cross_entropy(logits[None], np.array([[{answer}]]))[0]   # {num(loss)}
```

Both are **{num(nll)} nats** (p = {num(np.exp(-nll))}): the cross-entropy of a batch is this number averaged
over every position, and training lowers it by raising the true token's probability.""")


def kv_cache_14b(run: Run) -> tuple[str, str, str]:
    config = preset(KV_MODEL)
    per_token = memory.kv_cache_bytes_per_token(config, bytes_per_value=2)
    context = config.max_position_embeddings
    return (f"the KV cache of {KV_NAME}",
            f"How many bytes per token does {KV_NAME}'s KV cache hold in BF16, and how much at its "
            f"full {context:,}-token context? (`python -c \"import qwen_np; print(qwen_np.preset({KV_MODEL!r}))\"` "
            f"gives its L, KVH and Dh.)",
            f"""2 × L × KVH × Dh × 2 bytes = 2 × {config.num_hidden_layers} × {config.num_key_value_heads} × {config.head_dim} × 2
= **{per_token:,} bytes ({per_token // 1024} KiB) per token** (`memory.kv_cache_bytes_per_token`), and
{per_token:,} × {context:,} = **{num(per_token * context / GiB)} GiB** at the full context, for one sequence.""")


def bf16_step(run: Run) -> tuple[str, str, str]:
    probes = np.array(BF16_PROBES, dtype=np.float32)
    rounded = formats.round_trip(probes, "bf16")
    step = float(np.spacing(np.float32(rounded[0]))) * 2 ** (23 - 7)       # FP32's step, 16 mantissa bits finer
    pairs = ", ".join(f"{p:g} → {r:g}" for p, r in zip(probes, rounded))
    return ("BF16's step at 1,000",
            "What is the distance between neighbouring BF16 numbers near 1,000? Round 1,000 to 1,004 to BF16 "
            "(`formats.round_trip(x, \"bf16\")`) and explain what you see.",
            f"""1,000 lies in [512, 1024) = [2⁹, 2¹⁰), and BF16 keeps 7 mantissa bits, so its step there is
2⁹ × 2⁻⁷ = **{step:g}**: {pairs}. 1,002 is halfway and rounds to the even neighbour. An update smaller than
half a step ({step / 2:g} here) is lost entirely: why training keeps FP32 master weights.""")


def decode_bound(run: Run) -> tuple[str, str, str]:
    real = preset(REAL)
    rates = {name: EXAMPLE_BANDWIDTH / weight_bytes_read_per_token(real, width)
             for name, width in (("BF16", 2), ("INT4", 0.5))}
    return ("the fastest decode a memory bus allows",
            f"At {EXAMPLE_BANDWIDTH / 1e9:g} GB/s, at most how many tokens per second can Qwen3-8B decode from "
            f"BF16 weights, and from INT4 weights (ignore the KV cache and the scales)?",
            f"""Each token reads every weight once (`counts.weight_bytes_read_per_token`): at most
**{num(rates["BF16"], 3)} tokens/s** in BF16 and **{num(rates["INT4"], 3)} tokens/s** in INT4, 4× more for 4× fewer
bytes, whatever the core count.""")


def training_fit(run: Run) -> tuple[str, str, str]:
    remedies = step_memory.training_remedies(preset(TRAIN_MODEL), TRAIN_ROWS, TRAIN_CONTEXT)
    names = {"baseline": "nothing", "quarter_batch": f"--batch-size {TRAIN_ROWS // 4}", "bf16_activations": "activations in BF16",
             "grad_accum_4": "--grad-accum 4", "recompute": "--recompute", "all_three": "all three"}
    rows = "\n".join(f"| {names[k]} | {num(v['total'] / GiB)} GiB | {'yes' if v['total'] <= TRAIN_BUDGET else 'no'} |"
                     for k, v in remedies.items())
    budget = f"{TRAIN_BUDGET / GiB:g} GiB"
    recompute = (f"`--recompute` alone fits too ({num(remedies['recompute']['total'] / GiB)} GiB: each layer's tape "
                 "is made again in the backward, the logits' [T, V] arrays, FP32, kept whatever the layers do)"
                 if remedies["recompute"]["total"] <= TRAIN_BUDGET else
                 "`--recompute` alone is over (the logits' [T, V] arrays, FP32, are kept whatever the layers do)")
    return (f"which remedy fits Qwen3-0.6B in {budget}",
            f"Training Qwen3-0.6B on batches of {TRAIN_ROWS} × {TRAIN_CONTEXT:,} tokens, which single remedy of "
            f"section 10 brings the step under {budget}, keeping the same update? (`step_memory.training_remedies`.)",
            f"""| remedy | total | fits in {budget} |
|---|---:|---|
{rows}

**`--grad-accum 4`**: the same update in four passes of {TRAIN_ROWS // 4} rows, for one more set of gradients (the
one it adds into). {recompute}; a smaller batch changes the update.""")


def flash_blocks(run: Run) -> tuple[str, str, str]:
    T, H, KVH, Dh = FLASH_SHAPE
    rng = np.random.default_rng(0)
    q = rng.standard_normal((T, H, Dh), dtype=np.float32)
    k, v = (rng.standard_normal((T, KVH, Dh), dtype=np.float32) for _ in range(2))
    plain = layers.attention(q, k, v, np.arange(T))
    worst = max(float(np.abs(flash_attention(q, k, v, np.arange(T), block=b) - plain).max()) for b in (1, T))
    bound = "less than 1e-06" if worst < 1e-6 else num(worst)
    return ("FlashAttention with one key, and with all of them",
            f"Run `flash.flash_attention` with `block=1` and with `block=T` on random q, k, v (T = {T}, H = {H}, "
            f"KVH = {KVH}, Dh = {Dh}). Do they agree with `layers.attention`? What does each block size store?",
            f"""Both agree with `layers.attention` (largest difference {bound}). With `block=T` the loop runs
once: it *is* the plain softmax, with all [H, T, T] scores. With `block=1` each step adds one key and
rescales the running sums by exp(old max − new max): the scores it holds are [H, T, 1].""")


def losses_at(lr: float) -> list[float]:
    """The losses of DIVERGE_STEPS training steps of the tiny preset's model at a constant learning rate."""
    config = Qwen3Config(**PRESET_CONFIGS["tiny"])
    batch = np.random.default_rng(0).integers(0, 64, size=(4, 17))
    params = parameters.init_parameters(config, seed=0)
    model, optimizer = parameters.model_from_parameters(config, params), training.adamw_for(params)
    losses = []
    for _ in range(DIVERGE_STEPS):
        loss, grads = training.loss_and_gradients(model, batch)
        training.clip_gradients(grads, 1.0)
        losses.append(loss)
        optimizer.update(params, grads, lr)
    return losses


def divergence(run: Run) -> tuple[str, str, str]:
    runs = {lr: losses_at(lr) for lr in LEARNING_RATES}
    blown = [lr for lr, losses in runs.items() if max(losses) > losses[0] + BLOW_UP]
    first = blown[0]
    verdicts = ", ".join(f"{lr:g} {'blows up' if lr in blown else 'does not'}" for lr in LEARNING_RATES)
    return ("the learning rate at which training diverges",
            f"Train the `tiny` preset's model (`PRESET_CONFIGS[\"tiny\"]`, fresh weights, seed 0) for "
            f"{DIVERGE_STEPS} steps on one fixed batch of 4 × 16 random token ids, gradients clipped to norm 1, "
            f"with AdamW at constant learning rates {', '.join(f'{lr:g}' for lr in LEARNING_RATES)}. From which rate "
            f"does the loss blow up (rise more than {BLOW_UP:g} nat above its first value)?",
            f"""```python
for lr in {LEARNING_RATES}:
    loss, grads = training.loss_and_gradients(model, batch)    # {DIVERGE_STEPS} times, from fresh weights
    training.clip_gradients(grads, 1.0)
    optimizer.update(params, grads, lr)
```

{verdicts}: from **{first:g}**, where the first steps take the loss from {num(runs[first][0], 3)} to about
{num(max(runs[first]), 2)} nats. AdamW moves every weight by about lr per step, whatever the gradient's
size, and the weights start near 0.02: steps far larger than the weights throw the model anywhere.
Below that the loss comes down (the trainer's `tiny` preset uses {PRESET_SETTINGS["tiny"]["lr"]:g}, with warmup).""")


# The exercises after each section (the page's section numbers), numbered in order down the page.
AFTER_SECTION: dict[int, tuple[Callable[[Run], tuple[str, str, str]], ...]] = {
    1: (chat_tokens,), 3: (gqa_tile,), 5: (minus_log_p,), 6: (kv_cache_14b,), 7: (bf16_step,),
    8: (decode_bound,), 10: (training_fit, flash_blocks), 11: (divergence,)}


def with_exercises(sections: list[str], run: Run) -> list[str]:
    """The page's sections, each followed by its exercises."""
    number = 0
    out: list[str] = []
    for index, section in enumerate(sections):
        parts = [section]
        for make in AFTER_SECTION.get(index, ()):
            number += 1
            parts.append(exercise(number, *make(run)))
        out.append("\n\n".join(parts))
    return out
