"""`python -m bench.contention`: every command's speed on a busy machine, as a ratio to its idle speed.

A laptop with a browser open is a busy machine. This benchmark starts its own competitors (processes
that spin on one core each, as a busy neighbour does), runs each workload idle, beside one competitor
and beside three, interleaved over the repeats, and prints loaded / idle speed side by side. On 2 cores
a fair share is 0.5x beside one competitor (a core each) and 0.4x beside three (two of five busy
threads); the goal is at least GOALS of idle speed.

The workloads, each a fresh process:
  decode-0.6b     greedy decode on a random Qwen3-0.6B-shaped checkpoint (bench/checkpoints.py), tok/s over
                  --decode-seconds after a warm-up (a long generation's steady state)
  decode-bundled  the same on the bundled Shakespeare model, tok/s
  train-step      the trainer's step (rows split over the threads) on bench.training's model, tok/s
  eval            `python -m qwen_np eval --text FILE` on the bundled model, the whole command
  precision       `python -m qwen_np precision` on the bundled model, the whole command

With `--baseline PATH` (another checkout, e.g. `git worktree add ../before HEAD~1`) every workload also
runs on that checkout's qwen_np in the same run, for a before/after figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "weights"
SPIN = "while True: pass"
GOALS = {1: 0.45, 3: 0.3}          # competitors -> the least loaded / idle speed every workload should keep
WORKLOADS = ("decode-0.6b", "decode-bundled", "train-step", "eval", "precision")

DECODE = """
import json, sys, time
from qwen_np import load_model, runtime          # before NumPy, as the CLI (qwen_np/__init__.py)
import numpy as np
folder, seconds = sys.argv[1], float(sys.argv[2])
runtime.set_threads(None)
model = load_model(folder)

def decode(until):
    # Greedy steps until `until`; a full cache (the bundled model has 256 positions) starts a new one.
    steps, cache, token = 0, None, 0
    while time.perf_counter() < until:
        if cache is None or cache.length >= cache.max_tokens - 1:
            cache = model.new_cache(min(model.config.max_position_embeddings, 1024))
            token = int(model.forward(np.arange(1, 9), cache, last_only=True)[-1].argmax())
        token = int(model.forward([token], cache)[-1].argmax())
        steps += 1
    return steps

decode(time.perf_counter() + 0.5)            # warm-up: buffers, page faults, the thread count settling to the load
start = time.perf_counter()
steps = decode(start + seconds)
print(json.dumps({"rate": steps / (time.perf_counter() - start)}))
"""

TRAIN_STEP = """
import json, sys, time
import qwen_np                                   # before NumPy, as the CLI (qwen_np/__init__.py)
import numpy as np
from bench.training import MODEL
from qwen_np import runtime, training
from qwen_np.core.config import Qwen3Config
from qwen_np.training.parameters import hf_config, init_parameters, model_from_parameters
steps, threads = int(sys.argv[1]), runtime.usable_cores()
config = Qwen3Config.from_dict(hf_config(MODEL))
params = init_parameters(config, seed=0)
model, optimizer = model_from_parameters(config, params), training.adamw_for(params)
rng = np.random.default_rng(0)
seconds = []
for step in range(steps + 1):                                     # step 0 warms up
    batch = rng.integers(0, config.vocab_size, size=(8, 129))
    start = time.perf_counter()
    _, grads = training.loss_and_accumulated_gradients(model, batch, 1, threads=threads)
    training.clip_gradients(grads, 1.0)
    optimizer.update(params, grads, 1e-3)
    seconds.append(time.perf_counter() - start)
print(json.dumps({"rate": 8 * 128 / float(np.median(seconds[1:]))}))
"""


def measure(workload: str, checkout: Path, folder_06b: Path, text: Path, args: argparse.Namespace) -> float:
    """One fresh process of `workload` on `checkout`'s qwen_np: its speed (higher is faster)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(checkout), str(ROOT)])}
    if workload in ("eval", "precision"):
        command = [sys.executable, "-m", "qwen_np", workload, "--model", str(BUNDLED)]
        command += ["--text", str(text)] if workload == "eval" else []
        start = time.perf_counter()
        subprocess.run(command, env=env, check=True, capture_output=True, cwd=checkout)
        return 1.0 / (time.perf_counter() - start)                  # commands per second
    if workload == "train-step":
        code, argv = TRAIN_STEP, [str(args.train_steps)]
    else:
        folder = folder_06b if workload == "decode-0.6b" else BUNDLED
        code, argv = DECODE, [str(folder), str(args.decode_seconds)]
    result = subprocess.run([sys.executable, "-c", code, *argv], env=env, check=True, capture_output=True, cwd=checkout)
    return float(json.loads(result.stdout.decode().strip().splitlines()[-1])["rate"])


def with_competitors(count: int, job: Callable[..., float], *args: object) -> float:
    """job(*args) while `count` processes spin, one core each."""
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(count)]
    try:
        time.sleep(0.3 if count else 0.0)                           # let them reach the scheduler
        return job(*args)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.contention", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--competitors", type=int, nargs="+", default=[1, 3], help="busy processes beside (default 1 3)")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved rounds; medians are reported (default 2)")
    parser.add_argument("--decode-seconds", type=float, default=4.0,
                        help="seconds of timed decode, after a 0.5 s warm-up (default 4)")
    parser.add_argument("--train-steps", type=int, default=4, help="timed training steps (default 4)")
    parser.add_argument("--baseline", type=Path, help="another checkout measured alongside (before/after)")
    args = parser.parse_args(argv)

    folder_06b = Path()
    if "decode-0.6b" in args.workloads:
        from bench.checkpoints import ensure_checkpoint

        folder_06b = ensure_checkpoint("0.6b", log=lambda *a: print(*a, file=sys.stderr))
    from qwen_np.precision.lab import PASSAGE

    checkouts = {"this checkout": ROOT} | ({f"baseline {args.baseline}": args.baseline.resolve()} if args.baseline else {})
    loads = [0, *args.competitors]
    rates: dict[tuple[str, str, int], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "passage.txt"
        text.write_text(PASSAGE * 4, encoding="utf-8")
        for repeat in range(args.repeats):
            for workload in args.workloads:
                for name, checkout in checkouts.items():
                    for load in loads:
                        rate = with_competitors(load, measure, workload, checkout, folder_06b, text, args)
                        rates.setdefault((workload, name, load), []).append(rate)
                    shown = ", ".join(f"{n} beside: {rates[workload, name, n][-1]:.3g}" for n in loads)
                    print(f"round {repeat + 1} {workload} ({name}) {shown}", file=sys.stderr)

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    openblas = " ".join(f"{v}={os.environ[v]}" for v in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if v in os.environ)
    goals = ", ".join(f"{n} competitor(s): >= {GOALS[n]}x" for n in args.competitors if n in GOALS)
    print(f"{cores} cores, OpenBLAS {openblas or 'as it picks'}, {args.repeats} interleaved rounds, medians; goals: {goals}")
    columns = " | ".join(f"{n} competitor{'s' * (n > 1)}: x idle" for n in args.competitors)
    print(f"| workload | checkout | idle speed | {columns} |")
    print("|---|---|---|" + "---|" * len(args.competitors))
    unit = {"eval": "commands/s", "precision": "commands/s", "train-step": "tok/s"}
    for workload in args.workloads:
        for name in checkouts:
            idle = statistics.median(rates[workload, name, 0])
            ratios = " | ".join(f"{statistics.median(rates[workload, name, n]) / idle:.2f}" for n in args.competitors)
            print(f"| {workload} | {name} | {idle:.3g} {unit.get(workload, 'tok/s')} | {ratios} |")


if __name__ == "__main__":
    main()
