"""The walkthrough's exercises: qwen_np/exercises/'s catalog (`python -m qwen_np exercises`), each after its
section with its task (its solution module's docstring), the commands that write its stub and grade it, and a
collapsed solution: the reference solution's code and, for the questions with a number for an answer, that
number worked out here with qwen_np's own functions."""

from __future__ import annotations

from typing import Callable

import numpy as np

from qwen_np import preset
from qwen_np.core import layers
from qwen_np.core.flash import flash_attention
from qwen_np.engine import memory, step_memory
from qwen_np.exercises import catalog, checks
from qwen_np.inspection.counts import weight_bytes_read_per_token
from qwen_np.numbers import formats
from qwen_np.training import gradients
from qwen_np.training.settings import PRESET_SETTINGS
from walkthrough_common import EXAMPLE_BANDWIDTH, REAL, Run, num, qwen3_tokenizer

GiB = 2 ** 30
CHAT_MESSAGE = "Hello!"                      # exercise 1's chat turn
KV_MODEL, KV_NAME = "qwen3-14b", "Qwen3-14B"   # exercise 12's model
BF16_PROBES = (1000.0, 1001.0, 1002.0, 1003.0, 1004.0)
TRAIN_MODEL, TRAIN_ROWS, TRAIN_CONTEXT, TRAIN_BUDGET = "qwen3-0.6b", 8, 1024, 24 * GiB   # exercise 16
FLASH_SHAPE = (24, 4, 2, 16)                 # exercise 17: T, H, KVH, Dh


def exercise(entry: catalog.Exercise, answer: str | None) -> str:
    """Exercise `entry` as the page shows it: its title and task, its commands, the reference solution's code
    and the worked answer, if it has one."""
    first, _, task = entry.task().partition("\n\n")
    title = first.split(": ", 1)[1].rstrip(".")
    source = entry.solution_source()
    code = source[source.index('"""', 3) + 3:].replace("from __future__ import annotations\n", "").strip()   # no task
    return f"""### Exercise {entry.number}: {title}

{task}

`python -m qwen_np exercises start {entry.number}` writes the stub into the current folder,
`python -m qwen_np exercises check {entry.number}` grades it.

<details><summary>Solution</summary>

```python
{code}
```
{"" if answer is None else chr(10) + answer + chr(10)}
</details>"""


def chat_tokens(run: Run) -> str:
    tokenizer = qwen3_tokenizer()
    text = tokenizer.apply_chat_template([{"role": "user", "content": CHAT_MESSAGE}], enable_thinking=False)
    ids = tokenizer.encode(text)
    return f"""```python
text = tokenizer.apply_chat_template([{{"role": "user", "content": {CHAT_MESSAGE!r}}}], enable_thinking=False)
len(tokenizer.encode(text))        # {len(ids)}
```

**{len(ids)} tokens**, of which {len(tokenizer.encode(CHAT_MESSAGE))} are `{CHAT_MESSAGE!r}`: the rest is the template's
frame (`<|im_start|>user`, `<|im_end|>`, the assistant's opening and its empty thinking block)."""


def gqa_tile(run: Run) -> str:
    c = run.model.config
    group = c.num_attention_heads // c.num_key_value_heads
    tiled = [h % c.num_key_value_heads for h in range(c.num_attention_heads)]
    repeated = [h // group for h in range(c.num_attention_heads)]
    return f"""Tiling gives query head h the key head h % KVH instead of h // (H / KVH): on the bundled model
(H = {c.num_attention_heads}, KVH = {c.num_key_value_heads}) the heads read KV heads {tiled} instead of {repeated}.
The shapes are unchanged, so everything still runs, but the numbers are another model's:
`tests/core/test_model.py::test_gqa_query_head_h_reads_kv_head_h_div_group` fails (it checks every query head
against its key head), and so do the comparisons with transformers' logits. With one query head per key
head (MHA, group 1) the two are the same and nothing would notice."""


def minus_log_p(run: Run) -> str:
    answer = run.answer
    logits = run.logits[-1:].astype(np.float32)                                  # [1, V]
    nll = -float(layers.log_softmax(logits)[0, answer])
    loss, _ = gradients.cross_entropy(logits[None], np.array([[answer]]))
    piece = run.tokenizer.decode([answer])
    return f"""```python
logits = model.forward(ids)[-1:]                                  # [1, V]
-layers.log_softmax(logits)[0, {answer}]                           # {num(nll)}
gradients.cross_entropy(logits[None], np.array([[{answer}]]))[0]   # {num(loss)}
```

For {piece!r}, the token that follows the prompt, both are **{num(nll)} nats** (p = {num(np.exp(-nll))}):
the cross-entropy of a batch is this number averaged
over every position, and training lowers it by raising the true token's probability."""


def kv_cache_14b(run: Run) -> str:
    config = preset(KV_MODEL)
    per_token = memory.kv_cache_bytes_per_token(config, bytes_per_value=2)
    context = config.max_position_embeddings
    return f"""2 × L × KVH × Dh × 2 bytes = 2 × {config.num_hidden_layers} × {config.num_key_value_heads} × {config.head_dim} × 2
= **{per_token:,} bytes ({per_token // 1024} KiB) per token** (`memory.kv_cache_bytes_per_token`), and
{per_token:,} × {context:,} = **{num(per_token * context / GiB)} GiB** at the full context, for one sequence."""


def bf16_step(run: Run) -> str:
    probes = np.array(BF16_PROBES, dtype=np.float32)
    rounded = formats.round_trip(probes, "bf16")
    step = float(np.spacing(np.float32(rounded[0]))) * 2 ** (23 - 7)       # FP32's step, 16 mantissa bits finer
    pairs = ", ".join(f"{p:g} → {r:g}" for p, r in zip(probes, rounded))
    return f"""1,000 lies in [512, 1024) = [2⁹, 2¹⁰), and BF16 keeps 7 mantissa bits, so its step there is
2⁹ × 2⁻⁷ = **{step:g}**: {pairs}. 1,002 is halfway and rounds to the even neighbour. An update smaller than
half a step ({step / 2:g} here) is lost entirely: why training keeps FP32 master weights."""


def decode_bound(run: Run) -> str:
    real = preset(REAL)
    rates = {name: EXAMPLE_BANDWIDTH / weight_bytes_read_per_token(real, width)
             for name, width in (("BF16", 2), ("INT4", 0.5))}
    return f"""Each token reads every weight once (`counts.weight_bytes_read_per_token`): at most
**{num(rates["BF16"], 3)} tokens/s** in BF16 and **{num(rates["INT4"], 3)} tokens/s** in INT4, 4× more for 4× fewer
bytes, whatever the core count."""


def training_fit(run: Run) -> str:
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
    return f"""| remedy | total | fits in {budget} |
|---|---:|---|
{rows}

**`--grad-accum 4`**: the same update in four passes of {TRAIN_ROWS // 4} rows, for one more set of gradients (the
one it adds into). {recompute}; a smaller batch changes the update."""


def flash_blocks(run: Run) -> str:
    T, H, KVH, Dh = FLASH_SHAPE
    rng = np.random.default_rng(0)
    q = rng.standard_normal((T, H, Dh), dtype=np.float32)
    k, v = (rng.standard_normal((T, KVH, Dh), dtype=np.float32) for _ in range(2))
    plain = layers.attention(q, k, v, np.arange(T))
    worst = max(float(np.abs(flash_attention(q, k, v, np.arange(T), block=b) - plain).max()) for b in (1, T))
    bound = "less than 1e-06" if worst < 1e-6 else num(worst)
    return f"""Both agree with `layers.attention` (largest difference {bound}). With `block=T` the loop runs
once: it *is* the plain softmax, with all [H, T, T] scores. With `block=1` each step adds one key and
rescales the running sums by exp(old max − new max): the scores it holds are [H, T, 1]."""


def divergence(run: Run) -> str:
    first, rises = checks.first_diverging_rate()
    verdicts = ", ".join(f"{lr:g} {'blows up' if rise > checks.BLOW_UP else 'does not'} (rises {num(rise, 2)})"
                         for lr, rise in rises.items())
    return f"""{verdicts}: from **{first:g}**. Below it the loss comes down or wobbles (at 0.3 it rises by
about one nat and recovers); from it the loss rises by over ten. AdamW moves every weight by about lr per step,
whatever the gradient's size, and the weights start near 0.02: steps far larger than the weights throw the model
anywhere. The trainer's `tiny` preset uses {PRESET_SETTINGS["tiny"]["lr"]:g}, with warmup."""


# The exercises whose answer is a number or a verdict, worked out here (the others' answer is their code).
ANSWERS: dict[str, Callable[[Run], str]] = {
    "e01_chat_tokens": chat_tokens, "e05_gqa_heads": gqa_tile, "e10_minus_log_p": minus_log_p,
    "e12_kv_cache_bytes": kv_cache_14b, "e13_bf16_rounding": bf16_step, "e14_decode_bound": decode_bound,
    "e16_memory_remedy": training_fit, "e17_flash_attention": flash_blocks, "e18_divergence": divergence}


def with_exercises(sections: list[str], run: Run) -> list[str]:
    """The page's sections (index = the page's section number), each followed by the catalog's exercises of
    that section, in the catalog's order (numbered down the page)."""
    out: list[str] = []
    for index, section in enumerate(sections):
        parts = [section] + [exercise(entry, ANSWERS[entry.module](run) if entry.module in ANSWERS else None)
                             for entry in catalog.EXERCISES if int(entry.section.split(".")[0]) == index]
        out.append("\n\n".join(parts))
    return out
