"""The walkthrough's recorded measurements: this machine's caches (section 8), and training's memory remedies
and mixed precision (section 10).

Each takes minutes or depends on the machine, so it is RECORDED in docs/figures/NAME.json by the command
that measures it (RECORDS), and the page and figure are written from the record: the same text on every
machine and BLAS kernel, presented as what it is, one measurement on one 2-core machine. The tests repeat
the first steps of the recorded precision runs (check_precision_steps), so that record cannot drift from
the trainer unnoticed; the other two are measurements of a machine, not of the code's arithmetic.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from qwen_np.inspection import hardware
from qwen_np.core import layers
from qwen_np.engine import step_memory
from qwen_np import preset
from qwen_np.training import trainer, run_spec
from qwen_np.commands import hardware as hardware_command
from qwen_np.inspection.report import _render_memory, memory_breakdown
import walkthrough_common
from walkthrough_common import DOCS, REAL, code_block

FIGURES_DIR = DOCS / "figures"
# name -> the command that records it, run from the repository root (hardware: seconds; the others: minutes)
RECORDS = {
    "hardware": "python -m qwen_np hardware --json > docs/figures/hardware.json",
    "training_remedies": "python -m bench.memory --repeats 2 --json docs/figures/training_remedies.json",
    "mixed_precision": "python -m bench.precision_training --json docs/figures/mixed_precision.json "
                       "--png bench/figures/mixed_precision_loss.png",
}
SHARED_MACHINE = "a 2-core machine shared with other jobs"
RECORDED_MACHINE = "a quiet 2-core virtual machine (nothing else running)"          # the hardware record's
BENCH_PRESET = "shakespeare"                   # the model shape bench.memory trains
# The recorded run whose first steps the tests repeat: FP8 goes through the trainer's data, schedule and every
# rounding path (tiles, blocks); the formats' rounding itself is tested bit for bit in tests/training/test_mixed_precision.py.
CHECKED_PRECISIONS = ("fp8 (E4M3, 1x128 / 128x128)",)
CHECKED_STEPS = 2
REMEDY_BATCH, REMEDY_CONTEXT = 16, 4096        # the Qwen3-8B step whose remedies the estimate prices
QUIET_LOAD = 1.5                               # load average below which this 2-core machine has a core to spare


def load(name: str) -> dict[str, Any]:
    path = FIGURES_DIR / f"{name}.json"
    if not path.is_file():
        raise AssertionError(f"{path} is missing: record it with `{RECORDS[name]}`")
    return json.loads(path.read_text(encoding="utf-8"))


def claim(holds: bool, what: str) -> None:
    walkthrough_common.claim(holds, what, "recorded measurements")


def two_digits(x: float) -> str:
    return f"{x:.2g}" if x < 100 else f"{x:,.0f}"


def mib(n: float) -> str:
    """Whole MiB: the recorded peaks repeat to the MiB, not below it."""
    return f"{n / 2 ** 20:,.0f} MiB"


# --- Section 8: this machine's caches ---------------------------------------------------------------

def caches_of(record: dict[str, Any]) -> list[hardware.Cache]:
    return [hardware.Cache(c["level"], c["kind"], c["size_bytes"], c["line_bytes"], c["shared_by"])
            for c in record["topology"]["caches"]]


def rates_of(record: dict[str, Any]) -> dict[int, list[float]]:
    return {int(threads): rates for threads, rates in record["read_gbs"].items()}


def hardware_part(figures: dict[str, Any]) -> str:
    record = load("hardware")
    figures["hardware"] = record
    t, sizes, one = record["topology"], record["sizes"], rates_of(record)[1]
    data = [c for c in caches_of(record) if c.kind != "Instruction"]
    rows = "\n".join(f"| {c.name} | {hardware_command._size(c.size_bytes)} | "
                     f"{'each core its own' if len(c.shared_by) <= 1 else f'shared by CPUs {c.shared_by}'} |"
                     for c in caches_of(record))
    last = data[-1]
    inside = [r for s, r in zip(sizes, one) if s <= data[0].size_bytes]
    beyond = [r for s, r in zip(sizes, one) if s > 2 * last.size_bytes]
    claim(bool(inside) and bool(beyond) and min(inside) > 4 * max(beyond), "reads from the caches are several times RAM's")
    two = rates_of(record)[max(rates_of(record))]
    two_cached = [r for s, r in zip(sizes, two) if s <= last.size_bytes]
    claim(max(two_cached) > max(one), "a second thread speeds up reads from the caches")
    threads = max(rates_of(record))
    peak_size = sizes[two.index(max(two_cached))]
    # The cache that holds the two threads' fastest matrix: a private cache holds each thread's half.
    holder = next(c for c in data if peak_size <= c.size_bytes * (threads if len(c.shared_by) <= 1 else 1))
    ram = two[-1]                                         # the command's decode limits use this rate
    real = preset(REAL)
    blocks = {"q/k/v/o, gate, up": layers.UPCAST_BLOCK_ROWS * real.hidden_size * 4,
              "down_proj": layers.UPCAST_BLOCK_ROWS * real.intermediate_size * 4}
    claim(all(size <= last.size_bytes for size in blocks.values()), "layers.linear's upcast blocks fit in the last cache")
    block_sizes = ", ".join(f"{hardware_command._size(size)} for {what}" for what, size in blocks.items())
    # The limits from the recorded rate by today's rule (hardware.decode_limits, the bytes `inspect` counts), not
    # the record's own: it was written when `hardware` still counted the embedding table, which decode never reads.
    limits = {name: hardware.decode_limits(preset(name), ram) for name in ("qwen3-0.6b", REAL)}
    smt = "no SMT" if all(len(s) == 1 for s in t["siblings"]) else "SMT (two threads per core)"
    largest = hardware_command._size(last.size_bytes)
    return f"""**This machine's caches, measured.** `python -m qwen_np hardware` reads what the OS says about
the CPU (`/sys/devices/system/cpu`, `/proc/cpuinfo`) and then measures a matrix-vector product's read
rate against the matrix's size, from 16 KiB to 1 GiB. Recorded on {RECORDED_MACHINE}, in
`docs/figures/hardware.json` (`{RECORDS['hardware']}`): {t['model'] or 'an unnamed CPU'}, {len(t['usable'])} logical CPUs,
{t['cores']} cores, {smt}, NUMA nodes: {t['numa_nodes']}; the OS does not say: {'; '.join(t['unknown']) or 'nothing missing'}.

| cache | size | shared |
|---|---:|---|
{rows}

![Read rate against working-set size on this machine, the caches marked](figures/hardware.png)

On one thread, a matrix that fits in L1 is read at about {two_digits(max(inside))} GB/s; once it is more than
twice the {largest} {last.name}, at about {two_digits(float(np.median(beyond)))} GB/s: the rate of RAM, several
times slower, and the rate decode lives on, since the weights are far larger than any cache.
`layers.linear`'s upcast blocks ({block_sizes} at Qwen3-8B's width) fit in the recorded machine's
{largest} {last.name}, so each block is still in cache when the product reads it back; a CPU whose last
cache is smaller than a block pays one extra trip to RAM for it (`layers.UPCAST_BLOCK_ROWS` sets the size).

Two threads read a cache-sized matrix faster than one, up to {two_digits(max(two_cached))} GB/s here, at a
{hardware_command._size(peak_size)} matrix: one that only the {holder.name} holds.
Beyond the L3 every thread reads through the one memory bus,
shared with whatever else the machine runs, so a record's RAM rate is that of its moment (on this
virtual machine it varies between processes too: bench/README.md, "The numbers"). At this record's rate
for {threads} threads reading the largest matrix, {two_digits(ram)} GB/s, reading once per token the weights a step
needs would allow
{limits['qwen3-0.6b']['fp32']:.3g} tokens/s for Qwen3-0.6B in FP32 and {limits[REAL]['bf16']:.3g} for Qwen3-8B in BF16
(the command's decode limits: the weights a step reads, every one but the embedding table's unread rows,
as `inspect` counts them): a limit of that moment, not of the machine. Run `python -m qwen_np hardware` on yours.
More BLAS threads than cores (`-t`) add no core to read with, only switching between threads."""


def hardware_figure(record: dict[str, Any]) -> Any:
    return hardware_command.figure(caches_of(record), record["sizes"], rates_of(record),
                                   f"{record['topology']['model'] or 'this CPU'}: a matrix-vector product's read "
                                   f"rate against the matrix's size\n(recorded on {RECORDED_MACHINE})")


# --- Section 10: memory remedies and mixed precision -------------------------------------------------

REMEDY_NOTES = {"baseline": "16 rows at once", "--batch-size 4": "another, noisier update",
                "--grad-accum 4": "the same update in 4 passes", "--recompute": "each layer rerun in the backward",
                "--recompute --grad-accum 4": "both", "--precision bf16": "rounding only: the tape stays FP32",
                "--precision fp8": "the same, with per-tile scales"}


def quiet(record: dict[str, Any]) -> bool:
    """Whether the machine was quiet when bench.memory started (load average below QUIET_LOAD: the load at
    its end counts its own two training threads): only then are its speeds worth comparing (its peaks repeat
    to the MiB under any load)."""
    return record["load_average"]["start"][0] < QUIET_LOAD


def recorded_on(record: dict[str, Any]) -> str:
    return RECORDED_MACHINE if quiet(record) else SHARED_MACHINE


def remedies_table(record: dict[str, Any]) -> str:
    rows, speeds = record["rows"], quiet(record)
    base = rows["baseline"]
    head = ("| configuration | peak RSS, fixed mmap threshold | with glibc's defaults | estimate | memory vs baseline |"
            + (" tokens/s | time per token vs baseline |" if speeds else ""))
    lines = [head, "|---" + "|---:" * (head.count("|") - 2) + "|"]
    for name, r in rows.items():
        line = (f"| `{name}` ({REMEDY_NOTES[name]}) | {mib(r['peak_fixed_threshold'])} | {mib(r['peak_above_baseline'])} | "
                f"{mib(r['estimate'])} | {r['peak_fixed_threshold'] / base['peak_fixed_threshold']:.2f}× |")
        lines.append(line + (f" {r['tokens_per_s']:,.0f} | {base['tokens_per_s'] / r['tokens_per_s']:.2f}× |" if speeds else ""))
    return "\n".join(lines)


def remedies_part(figures: dict[str, Any], step_estimate: dict[str, int]) -> str:
    """The remedies measured; step_estimate: step_memory.training_memory of the shape bench.memory trains, whose total
    the table above this part shows."""
    record = load("training_remedies")
    figures["training_remedies"] = record
    rows = record["rows"]
    claim(rows["--recompute --grad-accum 4"]["peak_fixed_threshold"] < rows["--grad-accum 4"]["peak_fixed_threshold"]
          < rows["baseline"]["peak_fixed_threshold"], "each remedy measured lowers the peak, and both together lower it most")
    load_average = record["load_average"]["start"][0]
    speeds = (f"Its speeds are in the table: nothing else was running when it started (load average below "
              f"{QUIET_LOAD:g}); one run's tokens/s, so their last digits are the machine's mood."
              if quiet(record) else
              f"Its speeds are left out: other jobs kept the load average at {load_average:.1f} when it started, and "
              "tokens/s on a loaded machine measure the other jobs more than the remedy (run the command on a quiet "
              "machine to see them). Recomputation costs one more forward pass of every layer, whatever the machine.")
    total, weights = step_memory.training_total(step_estimate), step_estimate["weights"]
    claim(record["rows"]["baseline"]["estimate"] == total - weights,
          "the baseline's estimate is the step's total without the weights")
    real = preset(REAL)
    # inspect's memory report, its training half (the first paragraph is the memory to run the model)
    report = {"memory": memory_breakdown(real, REMEDY_CONTEXT, REMEDY_BATCH), "weights_file": None}   # no GGUF
    estimate = _render_memory(report).split("\n\n", 1)[1]
    return f"""**The remedies, side by side.** Out of memory, the notes say: a smaller batch, BF16/FP16, gradient
accumulation; and every large trainer adds **recomputation** (`train --recompute`: keep only each
layer's input, run the layer again during the backward pass; the same weights bit for bit, one more
forward pass of time). What each saves for Qwen3-8B, a step of {REMEDY_BATCH} × {REMEDY_CONTEXT:,} tokens, is the estimate that
`python -m qwen_np inspect --preset {REAL} --batch-size {REMEDY_BATCH} --context {REMEDY_CONTEXT}` prints:

{code_block(estimate, "text")}

Measured on one small model (the `{BENCH_PRESET}` preset's shape, a batch of 16 × {record['context']} tokens, full
training steps on one thread), recorded on {recorded_on(record)} by
`{RECORDS['training_remedies']}`. Peak memory is the process's peak RSS above its
baseline once the model is built, first with a fixed mmap threshold (`MALLOC_MMAP_THRESHOLD_=131072`:
every array freed goes back to the OS, so it is what the step needs), then with glibc's defaults
(which keep a freed tape in the heap). The first repeats to the MiB between runs, the second within
a few percent. {speeds}

{remedies_table(record)}

The baseline's estimate here is {mib(total - weights)}, where the table of the whole step above says {mib(total)}: the
baseline RSS is taken once the model is built, so the FP32 weights ({mib(weights)}) are already in it, and the
estimate this column compares with leaves them out (`bench/memory.py`: `training_total(estimate) − weights`).

![Peak memory of each remedy, measured, against the estimate](figures/training_remedies.png)

The estimate is the step's peak moment with its temporaries (the attention probabilities stacked a second
time at the forward's end, the loss's [T, V] arrays, a layer's backward arrays: `step_memory.TRAINING_MOMENTS`;
the column is today's plan, the peaks the record's), so the peaks with a fixed threshold sit within a tenth of
it: under with --grad-accum, over with --recompute alone, which it counts with every layer's gradients at
once. `--precision` changes no memory here: qwen_np keeps its tape in
FP32 arrays and only rounds the matrix products' inputs, extra elementwise passes in NumPy that a GPU's
narrow inputs get for free."""


def remedies_figure(record: dict[str, Any]) -> Any:
    """Peak memory of each configuration (both allocator settings, and the estimate); its speed beside it when
    the record was made on a quiet machine."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(record["rows"])
    rows = [record["rows"][name] for name in names]
    speeds = quiet(record)
    fig, axes = plt.subplots(1, 2 if speeds else 1, figsize=(11 if speeds else 8, 4.8), dpi=100, sharey=True,
                             squeeze=False, gridspec_kw={"width_ratios": [1.6, 1] if speeds else [1]})
    peak = axes[0, 0]
    y = np.arange(len(names))
    for offset, key, label, colour in ((-0.27, "peak_fixed_threshold", "measured, fixed mmap threshold", "#4f81bd"),
                                       (0, "peak_above_baseline", "measured, glibc's defaults", "#9bbb59"),
                                       (0.27, "estimate", "step_memory.training_memory's estimate", "#cccccc")):
        peak.barh(y + offset, [r[key] / 2 ** 20 for r in rows], 0.26, color=colour, label=label)
    peak.set_yticks(y, names, fontsize=8)
    peak.invert_yaxis()
    peak.set(xlabel="MiB above the process's baseline", title="Peak memory of a training step")
    peak.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.17), ncol=2)   # below: the bars fill the axes
    peak.grid(axis="x", alpha=0.3)
    if speeds:
        speed = axes[0, 1]
        speed.barh(y, [r["tokens_per_s"] for r in rows], 0.6, color="#f79646")
        speed.set(xlabel="tokens per second (one thread)", title="Speed of the same step")
        speed.grid(axis="x", alpha=0.3)
    fig.suptitle(f"The memory remedies, measured ({BENCH_PRESET} preset, 16 x {record['context']} tokens; {recorded_on(record)})",
                 fontsize=9)
    fig.tight_layout()
    return fig


def mixed_precision_part(figures: dict[str, Any]) -> str:
    record = load("mixed_precision")
    figures["mixed_precision"] = record
    runs = record["runs"]
    fp32 = runs["fp32"]["evals"][-1]["loss"]
    claim(all(abs(r["evals"][-1]["loss"] - fp32) < 0.05 for r in runs.values()),
          "every precision ends within 0.05 nats of FP32")
    table = "\n".join(f"| {name} | {r['evals'][-1]['loss']:.4f} | {r['evals'][-1]['loss'] - fp32:+.4f} | {r['skipped']} |"
                      for name, r in runs.items())
    underflow = record["underflow"]
    stalled = record["stalled"]
    return f"""**Mixed precision, measured.** `train --precision bf16|fp16|fp8` runs exactly that recipe: the
master weights and AdamW's moments stay FP32, and the inputs of every matrix product, forward and
backward, are rounded to the format as a tensor core is fed them (`qwen_np/training/mixed.py`; NumPy then
multiplies in FP32, what an FP32-accumulating tensor core computes). RMSNorm, RoPE, softmax, the loss
and the optimizer stay FP32. FP16 scales the loss dynamically (skip the step and halve the scale on an
overflow, double it after 200 clean steps); FP8 follows DeepSeek-V3: E4M3 with one scale per 1 × 128
tile of an activation or gradient and per 128 × 128 block of a weight. The same `{record['preset']}` preset,
seed, data order and {record['steps']} steps in each precision, validated in FP32 on the master weights every
{record['eval_every']} steps, recorded once by

```bash
{RECORDS['mixed_precision']}
```

| precision | final validation loss | vs FP32 | skipped steps |
|---|---:|---:|---:|
{table}

![Validation loss of the same run in each precision, and its difference from FP32](figures/mixed_precision.png)

At this size every precision trains almost like FP32. What the recipes guard against shows in the
numbers behind them, measured on the bundled model by the same script: without loss scaling, FP16
flushes {underflow['1']:.1%} of the nonzero gradient values entering the backward's products to zero
({underflow['256']:.1%} at a scale of 2^8, {underflow['65536']:.2%} at 2^16): small gradients fall below FP16's
smallest number (section 7). And if the weights themselves were held in BF16, an update of 2e-4 could
not move {stalled['0.0002']:.1%} of them ({stalled['0.0001']:.0%} at 1e-4, {stalled['0.001']:.1%} at 1e-3): half a
BF16 step of those weights is larger than the update, so it rounds away. That is why the master
weights stay FP32."""


def mixed_precision_figure(record: dict[str, Any]) -> Any:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, gap) = plt.subplots(1, 2, figsize=(11, 4), dpi=100)
    fp32 = np.array([e["loss"] for e in record["runs"]["fp32"]["evals"]])
    for name, run in record["runs"].items():
        steps = [e["step"] for e in run["evals"]]
        losses = np.array([e["loss"] for e in run["evals"]])
        curves.plot(steps, losses, "o-", ms=3, label=name)
        gap.plot(steps, losses - fp32, "o-", ms=3, label=name)
    curves.set(xlabel="optimizer step", ylabel="validation loss (nats per token)",
               title=f"train --preset {record['preset']} in each --precision (same seed and data)")
    gap.axhline(0, color="#888888", lw=0.8)
    gap.set(xlabel="optimizer step", ylabel="validation loss minus FP32's",
            title="The same, as the gap to FP32 (colours as on the left)")
    curves.legend(fontsize=8)
    for side in (curves, gap):
        side.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def check_precision_steps(record: dict[str, Any] | None = None, steps: int = CHECKED_STEPS) -> None:
    """Repeat the first steps of the recorded runs in CHECKED_PRECISIONS with `train`'s own loop (trainer.run,
    the schedule stretched to the record's length); raise naming the first loss that differs beyond rounding."""
    from bench.precision_training import RUNS

    record = record or load("mixed_precision")
    for name in CHECKED_PRECISIONS:
        with tempfile.TemporaryDirectory() as folder:
            overrides = {"steps": steps, "decay_steps": record["steps"], "eval_every": record["eval_every"],
                         "threads": 1, **RUNS[name]}
            fresh = [h["loss"] for h in trainer.run(run_spec.RunSpec(Path(folder) / "run", preset=record["preset"],
                                                                     overrides=overrides)).state.history]
        wanted = record["runs"][name]["loss"][:steps]
        if not np.allclose(fresh, wanted, rtol=1e-3):
            raise AssertionError(f"{name}: the first {steps} training losses are {fresh} now, {wanted} in "
                                 f"mixed_precision.json: the code changed; re-record with `{RECORDS['mixed_precision']}`")
