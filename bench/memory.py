"""Training memory and speed of each remedy, measured: `python -m bench.memory`.

One small model (the shakespeare preset's shape: hidden 256, 6 layers, 8/4 heads, head_dim 32, F 768,
vocab 2048, tied; 4.3M parameters), a batch of 16 x 256 tokens, full training steps (forward, backward,
clipping, AdamW) on random token ids. Each configuration runs in its own process, one after another:
  baseline                    the batch as one micro-batch
  --batch-size 4              a quarter of the batch (another, noisier update)
  --grad-accum 4              the same update in 4 micro-batches of 4 rows
  --recompute                 each layer run again in the backward from its saved input
  --recompute --grad-accum 4
  --precision bf16 / fp8      the rounding's cost (qwen_np's tape stays FP32: no memory saved here)
It prints, per configuration, the process's peak RSS above its baseline (the model built, before the
first step: so gradients, AdamW's moments, the tape and temporaries), with glibc's default allocator and
with a fixed mmap threshold (see FIXED_MMAP_THRESHOLD), step_memory.training_memory's estimate of the same
(gradients + AdamW + activations + attention probabilities), the median tokens/s (default allocator),
and both as ratios to the baseline. The figures in README.md come from this script.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import TYPE_CHECKING
from pathlib import Path

if TYPE_CHECKING:
    from qwen_np.core.config import Qwen3Config

# glibc raises its mmap threshold (up to 32 MiB) each time a large block is freed, so later arrays come
# from the heap, which keeps its high-water mark: with micro-batches or recomputation the freed tape of
# one pass stays resident. A fixed threshold returns every array over 128 KiB to the OS when freed: the
# second column is what the step needs, the first what a default process holds.
FIXED_MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": "131072"}
CONFIGS: dict[str, dict[str, object]] = {
    "baseline": {},
    "--batch-size 4": {"batch": 4},
    "--grad-accum 4": {"grad_accum": 4},
    "--recompute": {"recompute": True},
    "--recompute --grad-accum 4": {"recompute": True, "grad_accum": 4},
    "--precision bf16": {"precision": "bf16"},
    "--precision fp8": {"precision": "fp8"},
}


def estimate(config: Qwen3Config, context: int, batch: int = 16, grad_accum: int = 1, recompute: bool = False,
             precision: str = "fp32") -> int:
    """step_memory.training_memory's peak of the step a worker trains, less the weights (its baseline holds them)."""
    from qwen_np.engine import step_memory

    parts = step_memory.training_memory(config, batch // grad_accum, context, recompute=recompute,
                                   micro_batches=grad_accum, precision=precision)
    return step_memory.training_total(parts) - parts["weights"]


def worker(args: argparse.Namespace) -> dict[str, float]:
    """One process: `args.steps` timed training steps after one warm-up; peak RSS and median tokens/s."""
    import numpy as np

    from qwen_np.training import step as training
    from qwen_np.core.config import Qwen3Config
    from qwen_np.engine.runtime import peak_rss_bytes, steady_threads
    from qwen_np.training.settings import PRESET_CONFIGS
    from qwen_np.training.parameters import hf_config, init_parameters, model_from_parameters

    config = Qwen3Config.from_dict(hf_config(PRESET_CONFIGS["shakespeare"]))
    params = init_parameters(config, seed=0)
    model = model_from_parameters(config, params)
    optimizer = training.adamw_for(params)
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, config.vocab_size, size=(args.batch, args.context + 1)) for _ in range(args.steps + 1)]
    baseline = peak_rss_bytes()
    seconds = []
    with steady_threads():
        for batch in batches:
            started = time.perf_counter()
            _, grads = training.loss_and_accumulated_gradients(model, batch, args.grad_accum, threads=1, shards=1,
                                                               recompute=args.recompute, precision=args.precision)
            training.clip_gradients(grads, 1.0)
            optimizer.update(params, grads, 1e-3)
            seconds.append(time.perf_counter() - started)
            del grads
    predicted = estimate(config, args.context, args.batch, args.grad_accum, args.recompute, args.precision)
    return {"peak_above_baseline": peak_rss_bytes() - baseline, "estimate": predicted,
            "tokens_per_s": args.batch * args.context / float(np.median(seconds[1:]))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration (default 3)")
    parser.add_argument("--repeats", type=int, default=2, help="processes per configuration, interleaved (default 2)")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the table's numbers here (bytes, tokens/s)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=16, help=argparse.SUPPRESS)
    parser.add_argument("--grad-accum", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--recompute", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return
    print(f"shakespeare-preset model, batch 16 x {args.context}, 1 thread, {args.steps} timed steps per configuration, "
          f"best of {args.repeats} interleaved processes")
    results: dict[str, list[list[dict[str, float]]]] = {name: [] for name in CONFIGS}
    started_load = list(os.getloadavg())
    for _ in range(args.repeats):              # repeat 1 of every configuration, then repeat 2, ...
        for name, config in CONFIGS.items():
            command = [sys.executable, "-m", "bench.memory", "--worker", "--context", str(args.context),
                       "--batch", str(config.get("batch", 16)), "--grad-accum", str(config.get("grad_accum", 1)),
                       "--precision", str(config.get("precision", "fp32"))]
            command += ["--recompute"] if config.get("recompute") else []
            # the fixed-threshold process only measures memory: two steps reach the peak (AdamW's
            # moments are made in the first update)
            runs = [_worker(command + ["--steps", str(steps)], env)
                    for steps, env in ((args.steps, {}), (1, FIXED_MMAP_THRESHOLD))]
            if runs[0] is not None and runs[1] is not None:
                results[name].append([runs[0], runs[1]])
    print("| configuration | peak RSS above baseline | same, fixed mmap threshold | estimate | tokens/s "
          "| memory vs baseline | time per token vs baseline |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    best = {name: _best(runs) for name, runs in results.items() if runs}
    base = best["baseline"]
    for name, (default_peak, fixed_peak, estimate, rate) in best.items():
        print(f"| {name} | {default_peak / 2**20:.0f} MiB | {fixed_peak / 2**20:.0f} MiB | {estimate / 2**20:.0f} MiB "
              f"| {rate:.0f} | {fixed_peak / base[1]:.2f}x | {base[3] / rate:.2f}x |")
    if args.json:
        keys = ("peak_above_baseline", "peak_fixed_threshold", "estimate", "tokens_per_s")
        # the machine's load while it ran, beside the speeds it disturbs (the peaks it does not)
        args.json.write_text(json.dumps({"context": args.context, "steps": args.steps, "repeats": args.repeats,
                                         "load_average": {"start": started_load, "end": list(os.getloadavg())},
                                         "rows": {name: dict(zip(keys, row)) for name, row in best.items()}},
                                        indent=1) + "\n", encoding="utf-8")


def _best(runs: list[list[dict[str, float]]]) -> tuple[float, float, float, float]:
    """Over the repeats: the lowest peaks (the least disturbed allocator) and the highest tokens/s
    (the least disturbed by other processes on a shared machine); the estimate is the same in each."""
    return (min(default["peak_above_baseline"] for default, _ in runs),
            min(fixed["peak_above_baseline"] for _, fixed in runs),
            runs[0][0]["estimate"], max(default["tokens_per_s"] for default, _ in runs))

def _worker(command: list[str], env: dict[str, str]) -> dict[str, float] | None:
    """One worker process's result, or None (its error printed) if it failed."""
    done = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).parents[1],
                          env={**os.environ, **env})
    if done.returncode:
        print(done.stderr[-2000:])
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])

if __name__ == "__main__":
    main()
