"""The walkthrough's training chapters: one optimizer step on the bundled model, and what training holds
in memory and in a checkpoint. Every number comes from running qwen_np.training.step / qwen_np.training.trainer."""

from __future__ import annotations

import inspect
import tempfile
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np

from qwen_np import load_model, preset
from qwen_np.engine import step_memory
from qwen_np.training import step as training, run_state, text_data
from qwen_np.training.settings import PRESET_SETTINGS
from qwen_np.core import layers
from qwen_np.core.config import Qwen3Config, parameter_count
from qwen_np.core.flash import KEY_BLOCK, flash_attention
from qwen_np.precision.lab import PASSAGE
from qwen_np.files.tokenizer import Tokenizer
from walkthrough_chapter_measured import mixed_precision_part, remedies_part
from walkthrough_common import code_block

# The text the training step reads: the start of Hamlet's soliloquy, in the training text's layout
# (the passage `precision` scores when no text is given).
TRAIN_TEXT = "".join(PASSAGE.splitlines(keepends=True)[:11])
BATCH, CONTEXT = 4, 16                 # the step shown: B sequences of T tokens (+1 for the targets)
MEASURED_BATCH, MEASURED_CONTEXT = 4, 128  # the step whose memory is measured
WATCHED = "model.layers.0.self_attn.q_proj.weight"
PRESET = "shakespeare"                 # the run that trained the bundled model (PRESET_SETTINGS)
LONG_CONTEXT = 4096                    # a context where the attention probabilities dominate the activations
REMEDY_BATCH = 16                      # the Qwen3-8B step of the remedies' table: 16 x LONG_CONTEXT tokens
FLASH_MEASURED_CONTEXT = 1024          # the attention call whose peak memory is measured, plain and in blocks


def below(x: float, bound: float) -> str:
    """A rounding-noise figure as the bound it stays under: its digits are the BLAS kernel's choice (OpenBLAS's
    Haswell and SkylakeX kernels sum in different orders), the bound is not. Fails loudly if the bound breaks."""
    if not float(x) < bound:
        raise AssertionError(f"{float(x):g} is not below {bound:g}: the page's claim no longer holds")
    return f"{bound:g}"


def mib(n: float) -> str:
    return f"{n / 2 ** 20:.3g} MiB"


def training_step_data(config: Qwen3Config, batch: np.ndarray, params: dict[str, np.ndarray]) -> dict[str, Any]:
    """The shapes the training step diagram labels its arrows with: this step's, counted, no values."""
    B, T = batch.shape[0], batch.shape[1] - 1
    return {"B": B, "T": T, "V": config.vocab_size, "D": config.hidden_size, "L": config.num_hidden_layers,
            "tensors": len(params), "parameters": int(sum(p.size for p in params.values()))}


# The diagram's boxes (column, row, title, what it holds: filled from the data) and arrows, in the order of a step.
STEP_BOXES = (
    ("batch", 0, 0, "batch", "token ids [B, T+1] = [{B}, {T1}]"),
    ("weights", 2, 0, "weights", "{tensors} tensors, {parameters:,} numbers (FP32)"),
    ("forward", 1, 1, "forward pass, with a tape",
     "reads batch[:, :-1] [B, T]; keeps each layer's\nactivations for the backward"),
    ("logits", 1, 2, "logits", "[B, T, V] = [{B}, {T}, {V}]"),
    ("loss", 0, 3, "cross-entropy loss", "against batch[:, 1:] [B, T]: one number,\nthe mean over B x T = {BT} predictions"),
    ("backward", 1, 4, "backward pass (gradients.py)", "dlogits [B, T, V] back through the {L} layers,\nreading the tape"),
    ("gradients", 1, 5, "gradients", "one per weight tensor, its shape:\n{parameters:,} numbers"),
    ("clip", 0, 6, "clip_gradients", "all of them as one vector:\nnorm scaled down to at most 1"),
    ("adamw", 2, 6, "AdamW.update", "m, v: 2 x {parameters:,} numbers;\nw -= lr (m^ / (sqrt(v^) + eps) + wd w)"),
)
STEP_ARROWS = (("batch", "forward"), ("weights", "forward"), ("forward", "logits"), ("logits", "loss"), ("batch", "loss"),
               ("loss", "backward"), ("backward", "gradients"), ("gradients", "clip"), ("clip", "adamw"),
               ("adamw", "weights"))


def training_step_figure(data: dict[str, Any]) -> Any:
    """The step of section 9 as boxes and arrows, each labelled with the shape it holds at this B and T."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    fill = {**data, "T1": data["T"] + 1, "BT": data["B"] * data["T"]}
    fig, ax = plt.subplots(figsize=(10, 7.2), dpi=100)
    width, height = 3.0, 0.78
    rows = max(row for _, _, row, _, _ in STEP_BOXES)
    centre = {name: (column * 3.4, rows - row) for name, column, row, _, _ in STEP_BOXES}
    colours = {"forward": "#dbe9f6", "logits": "#dbe9f6", "loss": "#f6e0c8", "backward": "#e2f0d9", "gradients": "#e2f0d9",
               "clip": "#e8dff0", "adamw": "#e8dff0"}
    for name, _, _, title, what in STEP_BOXES:
        x, y = centre[name]
        ax.add_patch(FancyBboxPatch((x - width / 2, y - height / 2), width, height, boxstyle="round,pad=0.03",
                                    facecolor=colours.get(name, "#eeeeee"), edgecolor="#555555"))
        ax.text(x, y + 0.2, title, ha="center", va="center", fontsize=8.5, weight="bold")
        ax.text(x, y - 0.12, what.format(**fill), ha="center", va="center", fontsize=7, family="monospace")
    for source, target in STEP_ARROWS:
        (sx, sy), (tx, ty) = centre[source], centre[target]
        if sy == ty:                                   # side by side: from edge to edge
            start, end = (sx + np.sign(tx - sx) * width / 2, sy), (tx - np.sign(tx - sx) * width / 2, ty)
        elif source == "adamw":                         # the loop back: up the right-hand side to the weights
            start, end = (sx + width / 2, sy), (tx + width / 2, ty)
        else:
            start, end = (sx, sy - height / 2), (tx, ty + height / 2)
        style = "arc3,rad=-0.35" if source == "adamw" else "arc3"
        ax.annotate("", end, start, arrowprops={"arrowstyle": "->", "color": "#c0504d" if source == "adamw" else "#555555",
                                                "lw": 1.3, "connectionstyle": style})
    ax.text(centre["weights"][0] + width / 2 + 0.15, rows / 2, "the next step\nuses the\nupdated weights", fontsize=7.5,
            color="#c0504d", va="center")
    ax.set_xlim(-width / 2 - 0.2, centre["adamw"][0] + width / 2 + 1.2)
    ax.set_ylim(-0.7, rows + 0.7)
    ax.axis("off")
    ax.set_title(f"One training step: B = {data['B']} windows of T = {data['T']} tokens, V = {data['V']:,}, "
                 f"{data['L']} layers\nblue: forward, orange: the loss, green: backward, purple: the update", fontsize=9)
    fig.tight_layout()
    return fig


def training_step_section(model_dir: Path, num: Any, code_block: Any, facts: dict[str, Any],
                          figures: dict[str, Any]) -> str:
    """Section 9: a batch, the loss, gradients, clipping, the learning rate, one AdamW update."""
    settings = PRESET_SETTINGS[PRESET]
    model = load_model(model_dir, memory="fp32", fast=False)       # a private copy: the step changes it
    tokenizer = Tokenizer.from_folder(model_dir)
    tokens = np.array(tokenizer.encode(TRAIN_TEXT), dtype=np.int64)
    order = text_data.WindowOrder(len(tokens), CONTEXT, seed=0)
    batch = order.next_batch(tokens, BATCH)                                     # [B, T+1]
    params = training.named_parameters(model)
    optimizer = training.adamw_for(params, weight_decay=settings.get("weight_decay", 0.1))
    figures["training_step"] = training_step_data(model.config, batch, params)

    loss, grads = training.loss_and_gradients(model, batch)
    facts["training loss"] = loss
    _, halves = training.loss_and_accumulated_gradients(model, batch, 2)
    accumulation_error = max(float(np.abs(halves[n] - g).max()) for n, g in grads.items())
    shown = ["model.embed_tokens.weight", WATCHED, f"model.layers.{model.config.num_hidden_layers - 1}.mlp.down_proj.weight",
             "model.norm.weight"]
    norms = "\n".join(f"| `{name}` | {list(grads[name].shape)} | {num(np.linalg.norm(grads[name]))} |" for name in shown)
    clip = 1.0
    norm_before = training.clip_gradients(grads, clip)
    norm_after = training.global_norm(grads)
    warmup, total, peak = settings["warmup"], settings["steps"], settings["lr"]
    schedule = {step: training.learning_rate(step, peak, warmup, total) for step in (0, warmup // 2, warmup - 1,
                                                                                   total // 2, total - 1)}
    lr = schedule[warmup - 1]
    index = np.unravel_index(int(np.argmax(np.abs(grads[WATCHED]))), grads[WATCHED].shape)
    before, g = float(params[WATCHED][index]), float(grads[WATCHED][index])
    optimizer.update(params, grads, lr)
    after = float(params[WATCHED][index])
    m, v = float(optimizer.m[WATCHED][index]), float(optimizer.v[WATCHED][index])
    loss_after, _ = training.loss_and_gradients(model, batch)
    first_row = tokenizer.decode(batch[0].tolist())
    clipped = (f"scaled by {num(clip / (norm_before + 1e-6))}, the norm is now {num(norm_after)}" if norm_before > clip
               else f"below the limit, so nothing changes (norm {num(norm_after)})")
    lr_rows = "\n".join(f"| {step} | {num(value)} |" for step, value in schedule.items())
    return f"""## 9. Training: one step from a batch of text to updated weights

`python -m qwen_np train` made the bundled model by repeating one step {total:,} times (its
`{PRESET}` preset: batches of {settings['batch_size']} × {settings['context']} tokens, peak learning rate
{peak:g}). Here is one such step, run with the same functions (`qwen_np/training/step.py`) on the trained
weights and a short fixed text (the start of Hamlet's soliloquy) instead of the whole corpus, with
B = {BATCH} and T = {CONTEXT}.

**The batch.** `text_data.WindowOrder` cuts the token ids into windows of T + 1 tokens at a random
offset and shuffles them (an **epoch** is one pass over all windows); `next_batch` stacks B of them
into a [B, T+1] = {list(batch.shape)} integer array. Row 0 is `{first_row!r}`:

{code_block(repr(batch), "text")}

The model reads `batch[:, :-1]` ([B, T]) and is scored on predicting `batch[:, 1:]`: every position
predicts the token after it, so one row gives T training examples. The whole step, with the shapes
each part holds here:

![One training step: forward, loss, backward, clipping and the AdamW update, with their shapes](figures/training_step.png)

**The loss.** `training.loss_and_gradients` runs the forward pass with a tape (the activations the
backward pass needs, `gradients.forward_with_tape`), the cross-entropy of the [B, T, V] logits
against the targets, then the hand-written backward pass (`qwen_np/training/gradients.py`):

{code_block(inspect.getsource(training.loss_and_gradients))}

Mean cross-entropy here: **{num(loss)} nats per token** (perplexity e^loss = {num(np.exp(loss))}; a model that
knew nothing would score ln V = {num(np.log(model.config.vocab_size))}). The gradients: one FP32 array per
parameter tensor, of that tensor's shape; their L2 norms:

| tensor | shape | gradient norm |
|---|---|---:|
{norms}

**Accumulation.** With `--grad-accum 2` the batch is processed as two halves of B/2 rows and their
gradients averaged (`training.loss_and_accumulated_gradients`): the same gradient (largest difference
here less than {below(accumulation_error, 1e-6)}, FP32 rounding) with half the activations alive at a time.

**Clipping.** All gradients together, as one vector, have norm {num(norm_before)}.
`training.clip_gradients` scales them down to norm at most {clip:g}, so one unusual batch cannot
throw the weights far: {clipped}.

**The learning rate** follows `training.learning_rate`: a linear warmup over the first {warmup} steps
(AdamW's moment estimates are poor at first), then a cosine decay to a tenth of the peak:

| step | learning rate |
|---:|---:|
{lr_rows}

**The update.** `training.AdamW.update` moves every parameter in place. This optimizer is fresh (an
exported model keeps no optimizer state), so its moments start at 0, and we use the rate of step
{warmup - 1}, the peak. Take the element of `{WATCHED}` with the largest gradient, at index
{tuple(int(i) for i in index)}:

* weight before: {num(before, 6)}; its clipped gradient g = {num(g)}
* first moment m = (1 − β1) g = {num(m)}, second moment v = (1 − β2) g² = {num(v)}; bias-corrected,
  m̂ = g and v̂ = g², so the step is lr · m̂ / (sqrt(v̂) + ε) ≈ lr · sign(g) = {num(lr)}: on its first
  step Adam moves every weight by about the learning rate, whatever its gradient's size
* decoupled weight decay first shrinks the weight by the factor 1 − lr · {optimizer.weight_decay:g}
* weight after: {num(after, 6)} (change {num(after - before)})

The loss of the same batch after this one step: {num(loss_after)} (before: {num(loss)}); on the very batch
the gradient came from, so it says little about other text.

{code_block(inspect.getsource(training.AdamW.update))}"""


def memory_section(model_dir: Path, num: Any, figures: dict[str, Any]) -> str:
    """Section 10: training memory (estimated and measured) and the bytes of a resumable checkpoint."""
    settings = PRESET_SETTINGS[PRESET]
    model = load_model(model_dir, memory="fp32", fast=False)
    config = model.config
    rows, context = settings["batch_size"], settings["context"]
    estimate = step_memory.training_memory(config, rows, context)
    table = "\n".join(f"| {what} | {mib(estimate[key])} |" for key, what in (
        ("weights", "weights (FP32)"), ("gradients", "gradients (FP32)"), ("adamw", "AdamW moments m and v (FP32)"),
        ("activations", f"activations: {estimate['activations_per_token'] / 1024:.4g} KiB per token × {rows} × {context}")))
    total = step_memory.training_total(estimate)            # the step's peak moment, its transients included
    transients = total - sum(estimate[key] for key in ("weights", "gradients", "adamw", "activations"))
    figures["training_memory"] = {"preset": PRESET, "rows": rows, "context": context,
                                  "parts": {key: estimate[key] for key in ("weights", "gradients", "adamw", "activations")},
                                  "grad_accum_4": step_memory.training_memory(config, rows // 4, context)["activations"]}

    measured_rows, measured_context = MEASURED_BATCH, MEASURED_CONTEXT
    small = step_memory.training_memory(config, measured_rows, measured_context)
    tokens = np.resize(np.array(Tokenizer.from_folder(model_dir).encode(TRAIN_TEXT), dtype=np.int64),
                       (measured_rows, measured_context + 1))
    tracemalloc.start()
    training.loss_and_gradients(model, tokens)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    moments = step_memory.training_moments(small)             # one loss_and_gradients: every moment but the update's
    predicted = max(v for k, v in moments.items() if k != "update") - small["weights"] - small["adamw"]

    params = training.named_parameters(model)
    optimizer = training.adamw_for(params)
    optimizer.m = {n: np.zeros_like(p) for n, p in params.items()}
    optimizer.v = {n: np.zeros_like(p) for n, p in params.items()}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "last.safetensors"
        run_state.save_state(path, params, optimizer, {"history": []})
        checkpoint_bytes = path.stat().st_size
    n = parameter_count(config)
    share = attention_share(preset("qwen3-8b"), LONG_CONTEXT)
    return f"""## 10. What training holds in memory, and what a checkpoint saves

While it trains, qwen_np holds four numbers per parameter, all FP32 (`step_memory.training_memory`): the
weight, its gradient, and AdamW's two moments; plus the **activations** the backward pass needs, which
grow with batch size × context, and faster still with the context: each layer keeps the attention
probabilities, H numbers per token per earlier token, so they grow as batch × context². For Qwen3-8B
at {LONG_CONTEXT:,} tokens they are {share:.0%} of a layer's activations. For the `{PRESET}` preset ({n:,} parameters, batches of
{rows} × {context} tokens):

| what | bytes |
|---|---:|
{table}
| transients at the step's peak (the logits and their gradient, copies: `step_memory.training_peak`) | {mib(transients)} |
| **total** | **{mib(total)}** |

![Training memory of the preset's step, whole and with --grad-accum 4](figures/training_memory.png)

The activations dominate; `--grad-accum N` divides them by N (N micro-batches, one alive at a time).
Measured: one `loss_and_gradients` call on a batch of {measured_rows} × {measured_context} tokens allocates at
most {mib(peak)} of NumPy arrays at once (`tracemalloc`), against {mib(predicted)} predicted for its gradients,
activations and transients at their peak.

{remedies_part(figures, estimate)}

**A checkpoint to resume training** (`last.safetensors`, `run_state.save_state`) must hold what the
next step needs: the FP32 weights and both AdamW moments, **12 bytes per parameter**, plus the step,
the data position and the random number generator's state (small). Measured: {checkpoint_bytes:,} bytes for
{n:,} parameters ({num(checkpoint_bytes / n, 3)} bytes each). Gradients are not saved: the next step
computes new ones. A **released model** keeps only the weights, in BF16: 2 bytes per parameter, 6×
smaller. For Qwen3-8B:

{model_bytes_table(preset("qwen3-8b"), num)}

Large runs train in **mixed precision**: matrix products in BF16 from a BF16 copy of the weights,
with FP32 master weights for the update (many updates are smaller than a BF16 step, section 7, and
would round away): 2 + 4 bytes of weights, BF16 gradients (2) and FP32 moments (4 + 4), 16 bytes per
parameter in memory; the checkpoint still needs the 12 of master weights and moments.

{mixed_precision_part(figures)}

{flash_part(num)}

{sharding_part(num)}"""


def peak_bytes(attend: Any, *args: Any, **options: Any) -> int:
    """The most bytes of NumPy arrays held at once while attend(*args) runs (tracemalloc)."""
    tracemalloc.start()
    attend(*args, **options)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def flash_part(num: Any) -> str:
    """FlashAttention: what it never stores, measured on one call, and what it does to the remedies' table."""
    real = preset("qwen3-8b")
    H, KVH, Dh, L = real.num_attention_heads, real.num_key_value_heads, real.head_dim, real.num_hidden_layers
    T = FLASH_MEASURED_CONTEXT
    rng = np.random.default_rng(0)
    q = rng.standard_normal((T, H, Dh), dtype=np.float32)
    k, v = (rng.standard_normal((T, KVH, Dh), dtype=np.float32) for _ in range(2))
    positions = np.arange(T)
    plain, flash = peak_bytes(layers.attention, q, k, v, positions), peak_bytes(flash_attention, q, k, v, positions)
    difference = float(np.abs(layers.attention(q, k, v, positions) - flash_attention(q, k, v, positions)).max())
    # The exact difference is rounding noise that changes with the BLAS kernel, so state the bound.
    agreement = "they differ by less than 1e-05" if difference < 1e-5 else f"they differ by {num(difference)}: a bug"
    rows, context = REMEDY_BATCH, LONG_CONTEXT
    gib = 2 ** 30

    def totals(recompute: bool) -> tuple[float, float]:
        estimate = step_memory.training_memory(real, rows, context, recompute=recompute)
        probabilities = step_memory.attention_probabilities(real, rows, context, recompute=recompute)
        kept_rows = 4 * (1 if recompute else L) * H * context * rows      # one FP32 number per query row and head
        flash = {**estimate, "activations": estimate["activations"] - probabilities + kept_rows,
                 "stacked_probabilities": 0, "recomputed_probabilities": 0}   # no probabilities to stack either
        return step_memory.training_total(estimate) / gib, step_memory.training_total(flash) / gib

    whole, whole_flash = totals(False)
    again, again_flash = totals(True)
    return f"""**FlashAttention: the probabilities need not be stored at all.** The biggest line of that
table, {num(step_memory.attention_probabilities(real, rows, context) / gib)} GiB of attention probabilities, is
what every large trainer no longer keeps. The softmax seems to need a row's max and sum over all keys
before any weight is known; the **online softmax** does without: read the keys a block at a time and
keep, per query row, the running max, the running sum of exp(score − max) and the running weighted
sum of values. When a block brings a larger max, the sums so far are multiplied by exp(old max − new
max), and after the last block the weighted sum divided by the sum is exactly softmax · v, up to the
rounding of adding in another order. `qwen_np/core/flash.py` does it in NumPy ({KEY_BLOCK} keys per block):

{code_block(inspect.getsource(flash_attention))}

On Qwen3-8B's heads ({H} query heads, {KVH} KV heads, Dh {Dh}), one {T:,}-token causal attention call
gives the same output as `layers.attention` ({agreement}) and holds at most
{num(flash / 2 ** 20, 3)} MiB of arrays at once against {num(plain / 2 ** 20, 3)} MiB
(`tracemalloc`; {num(plain / flash, 2)}× less; `python -m bench.flash_memory` measures other lengths):
the plain one's [H, T, T] scores and probabilities grow with T², the blocks' [H, T, {KEY_BLOCK}] with T.
FlashAttention (Dao et al., 2022) is this loop on a GPU, each block kept in on-chip memory, and its
backward pass stores neither the scores nor the probabilities: it keeps one number per query row and
head (the log of the row's sum, max included) and recomputes each block's probabilities from q and k.
In the estimate `inspect` printed above for the same step of {rows} × {context:,} tokens, that takes the total from
{num(whole)} GiB to {num(whole_flash)} GiB, and with `--recompute` from {num(again)} GiB to
{num(again_flash)} GiB: the activations left are linear in the context. qwen_np's trainer keeps the
plain attention (its backward reads the stored probabilities, `training/gradients.py`)."""


def sharding_part(num: Any) -> str:
    """Sharding and offload, and dense against mixture-of-experts models, with their sizes."""
    real = preset("qwen3-8b")
    n = parameter_count(real)
    per_parameter = 16                                   # FP32 weight, gradient and AdamW's m and v
    gpus = 8
    return f"""**Sharding and offload.** What is left is still more than one accelerator holds: Qwen3-8B's
FP32 weights, gradients and AdamW moments alone are {num(n * per_parameter / 2 ** 30)} GiB. Data-parallel
training over N devices can **shard** them (ZeRO, PyTorch's FSDP): each device keeps 1/N of the weights,
gradients and moments and fetches the other weights layer by layer when it needs them, so on {gpus}
devices each holds {num(n * per_parameter / gpus / 2 ** 30)} GiB of them, paid for in network traffic.
Tensor and pipeline parallelism split each matrix, or the layers, across devices instead. **Offload**
moves what is touched least often, AdamW's moments and the FP32 master weights, to the host's RAM
or to NVMe (ZeRO-Offload, ZeRO-Infinity), and runs the update on the CPU: device memory for time.

**Dense and mixture-of-experts models.** Every Qwen3 model on this page but one of section 12 is **dense**: each token goes
through every weight. Qwen3's **mixture-of-experts** (MoE) models replace each layer's MLP by many
small MLPs (experts) and a router that sends each token to a few of them: Qwen3-30B-A3B has
30.5B parameters in all but 3.3B active per token (128 experts per layer, 8 used), Qwen3-235B-A22B
235B in all and 22B active. A token then costs the arithmetic, and in decode the bytes read (section 8),
of a 3.3B or 22B dense model, while memory must still hold all 30.5B or 235B; and training keeps
gradients and AdamW moments for every expert. qwen_np runs and trains both; section 12 draws a MoE's router."""


def attention_share(config: Qwen3Config, context: int) -> float:
    """The attention probabilities' share of the layers' training activations: step_memory.training_memory's tape,
    less its part outside the layers (the final norm's input and output), against H * T numbers per token per layer."""
    per_token = step_memory.training_memory(config, 1, context)["activations_per_token"]
    layers = per_token - 4 * 2 * config.hidden_size
    return 4 * config.num_hidden_layers * config.num_attention_heads * context / layers


def model_bytes_table(config: Qwen3Config, num: Any) -> str:
    n = parameter_count(config)
    rows = (("released weights (BF16)", 2), ("resumable checkpoint: FP32 weights + m + v", 12),
            ("training in memory, qwen_np (FP32 weights, gradients, m, v), before activations", 16))
    return "| what | bytes per parameter | Qwen3-8B |\n|---|---:|---:|\n" + "\n".join(
        f"| {what} | {width} | {num(n * width / 1e9)} GB |" for what, width in rows)
