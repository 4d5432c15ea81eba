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
first step: so gradients, AdamW's moments, the tape and temporaries), memory.training_memory's estimate of
the same (gradients + AdamW + activations + attention probabilities), the median tokens/s, and both as
ratios to the baseline. The figures in README.md come from this script.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

CONFIGS: dict[str, dict[str, object]] = {
    "baseline": {},
    "--batch-size 4": {"batch": 4},
    "--grad-accum 4": {"grad_accum": 4},
    "--recompute": {"recompute": True},
    "--recompute --grad-accum 4": {"recompute": True, "grad_accum": 4},
    "--precision bf16": {"precision": "bf16"},
    "--precision fp8": {"precision": "fp8"},
}


def worker(args: argparse.Namespace) -> dict[str, float]:
    """One process: `args.steps` timed training steps after one warm-up; peak RSS and median tokens/s."""
    import numpy as np

    from qwen_np import memory, training
    from qwen_np.config import Qwen3Config
    from qwen_np.runtime import peak_rss_bytes, steady_threads
    from qwen_np.trainer import PRESET_CONFIGS, hf_config, init_parameters, model_from_parameters

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
    estimate = memory.training_memory(config, args.batch // args.grad_accum, args.context, recompute=args.recompute)
    predicted = memory.training_total(estimate) - estimate["weights"]        # the weights are in the baseline
    return {"peak_above_baseline": peak_rss_bytes() - baseline, "estimate": predicted,
            "tokens_per_s": args.batch * args.context / float(np.median(seconds[1:]))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration (default 3)")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=16, help=argparse.SUPPRESS)
    parser.add_argument("--grad-accum", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--recompute", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return
    print(f"shakespeare-preset model, batch 16 x {args.context}, 1 thread, {args.steps} timed steps per configuration")
    print("| configuration | peak RSS above baseline | estimate | tokens/s | memory vs baseline | time per token vs baseline |")
    print("|---|---:|---:|---:|---:|---:|")
    first: dict[str, float] = {}
    for name, config in CONFIGS.items():
        command = [sys.executable, "-m", "bench.memory", "--worker", "--steps", str(args.steps),
                   "--context", str(args.context), "--batch", str(config.get("batch", 16)),
                   "--grad-accum", str(config.get("grad_accum", 1)), "--precision", str(config.get("precision", "fp32"))]
        command += ["--recompute"] if config.get("recompute") else []
        done = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).parents[1])
        if done.returncode:
            print(f"{name}: worker failed\n{done.stderr[-2000:]}")
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        first = first or r
        print(f"| {name} | {r['peak_above_baseline'] / 2**20:.0f} MiB | {r['estimate'] / 2**20:.0f} MiB | "
              f"{r['tokens_per_s']:.0f} | {r['peak_above_baseline'] / first['peak_above_baseline']:.2f}x | "
              f"{first['tokens_per_s'] / r['tokens_per_s']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
