"""`python -m bench.few_tokens`: a forward pass of k new tokens over the KV cache, over one token's.

Decoding is memory-bound: one token reads every weight once, and k tokens read the same weights
once too, so forward(k tokens, cache) should cost about forward(1 token, cache) for a handful of k
(what speculative decoding and batched streams rest on). This measures the ratio for k = 1, 2, 3, 5, 9
through the public API (model.forward(ids, cache): all k positions' logits, as a speculative check
needs them), after a 128-token prompt, for each model with the OpenBLAS kernel NumPy picks on its
own (SkylakeX here: OPENBLAS_CORETYPE unset) and with OPENBLAS_CORETYPE=Haswell OPENBLAS_L2_SIZE=512
(a kernel with no small-matrix GEMM), each in its own process, interleaved over the repeats, with
all threads throughout (runtime.steady_threads: no dropping threads while the machine is busy). With
`--baseline PATH` every configuration also runs on another checkout's qwen_np (e.g. main) in the
same run.

A second pass times each step of fast.py (each matrix product by its weight, attention, the KV
cache's reads and writes, norms, RoPE, SiLU): `rest` is the call's time outside them (Python per
layer, the embedding, residual adds, RoPE angles). Only the outermost timed step counts (a step
inside another is part of it). The wrappers add ~1 us per call, so this pass's totals run a little
above the first pass's.

`8b` is Qwen3-8B's real shapes with `--layers` decoder layers (default 4: a 4 GB checkpoint instead of
16 GB). Its LM head is then ~half the bytes instead of 7.6%, so the table also gives the ratio the
breakdown predicts for all 36 layers: every step but the LM head scaled by 36 / layers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNELS = {"SkylakeX (unset)": {}, "Haswell": {"OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_L2_SIZE": "512"}}
# "0.6b-fp32" holds plain [out, in] arrays (memory="fp32" by name); "0.6b-auto" what load_model's
# default holds when FP32 fits, numerics.Panels (the same values in the fast path's layout).
# "0.6b-q4_k_m" and "0.6b-q8_0": bench.gguf_kinds' GGUFs of those shapes, kept as stored (the block kinds'
# grouped products: fast.grouped_rows).
MODELS = {"0.6b-auto": ("0.6b", "auto"), "0.6b-fp32": ("0.6b", "fp32"), "0.6b-bf16": ("0.6b", "bf16"),
          "8b-bf16": ("8b", "bf16"), "0.6b-q4_k_m": ("0.6b", "stored"), "0.6b-q8_0": ("0.6b", "stored")}
TIMED_STEPS = ("_attention", "_decode_attention", "_rms_norm", "_rope", "_silu_times")
TIMED_CACHE = ("write", "append", "runs")


def product_names(config) -> dict[tuple[int, int], str]:
    """Each matrix product's name by its weight's shape [out, in] (Qwen3's shapes tell them apart)."""
    D, F, V = config.hidden_size, config.intermediate_size, config.vocab_size
    H, KVH, Dh = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    names: dict[tuple[int, int], str] = {}
    for shape, name in ((((H + 2 * KVH) * Dh, D), "qkv"), ((H * Dh, D), "q"), ((KVH * Dh, D), "k|v"),
                        ((D, H * Dh), "o"), ((2 * F, D), "gate|up"), ((F, D), "gate|up"), ((D, F), "down"),
                        ((V, D), "lm_head")):
        names[shape] = name if names.get(shape, name) == name else f"{names[shape]}|{name}"   # 8B: q and o alike
    return names


def install_timers(model, totals: dict[str, float], clock) -> None:
    """Wrap fast.py's steps (and the KV cache's methods) so that each adds its seconds to totals[name]."""
    from qwen_np.engine import fast
    from qwen_np.engine import paged as kv_cache

    depth = [0]
    names = product_names(model.config)

    def timed(function, name_of):
        def wrapper(*args, **kwargs):
            if depth[0]:
                return function(*args, **kwargs)
            depth[0] += 1
            start = clock()
            try:
                return function(*args, **kwargs)
            finally:
                depth[0] -= 1
                name = name_of(args)
                totals[name] = totals.get(name, 0.0) + clock() - start
        return wrapper

    fast.linear = timed(fast.linear, lambda args: names.get(tuple(args[1].shape), "other products"))
    for step in TIMED_STEPS:
        if hasattr(fast, step):
            label = "attention" if "attention" in step else step.strip("_").replace("_times", "")
            setattr(fast, step, timed(getattr(fast, step), lambda args, label=label: label))
    for method in TIMED_CACHE:
        cls = kv_cache.PagedKVCache
        setattr(cls, method, timed(getattr(cls, method), lambda args: "kv cache"))


def worker(folder: str, memory: str, ks: list[int], context: int, repeats: int, cpu: bool = False) -> dict:
    """Median ms of forward(k new tokens, cache) per k, and a per-step breakdown (ms) per k."""
    from qwen_np import load_model  # before NumPy, as the CLI (qwen_np/__init__.py)
    from qwen_np.engine import runtime

    import numpy as np

    clock = time.thread_time if cpu else time.perf_counter
    model = load_model(folder, memory=memory)
    steady = runtime.steady_threads()      # all threads throughout: the ratios at a fixed thread count
    steady.__enter__()
    rng = np.random.default_rng(0)
    cache = model.new_cache(context + max(ks) + 1)
    model.forward(rng.integers(0, 50000, context), cache, last_only=True)

    def run(k: int) -> float:
        ids = rng.integers(0, 50000, k)
        start = clock()
        model.forward(ids, cache)
        seconds = clock() - start
        cache.truncate(context)
        return seconds

    for k in ks:                                  # warm-up: buffers for each k, page faults
        run(k)
    times: dict[int, list[float]] = {k: [] for k in ks}
    for _ in range(repeats):
        for k in ks:
            times[k].append(run(k))
    totals: dict[str, float] = {}
    install_timers(model, totals, clock)
    steps: dict[int, list[dict[str, float]]] = {k: [] for k in ks}
    for _ in range(repeats):
        for k in ks:
            totals.clear()
            seconds = run(k)
            steps[k].append({**totals, "rest": seconds - sum(totals.values())})
    breakdown = {k: {name: 1e3 * statistics.median(s.get(name, 0.0) for s in steps[k]) for name in steps[k][0]}
                 for k in ks}
    blas = runtime.blas_info()
    return {"ms": {k: 1e3 * statistics.median(times[k]) for k in ks}, "breakdown": breakdown,
            "layers": model.config.num_hidden_layers, "threads": runtime.threads(),
            "kernel": blas[0].get("architecture") if blas else "?"}


def run_worker(tree: Path, env: dict[str, str], folder: Path, memory: str, ks: list[int], context: int,
               repeats: int, threads: int | None, cpu: bool = False) -> dict:
    """worker() in a fresh process importing qwen_np from `tree`, with the OpenBLAS variables `env`."""
    clean = {name: value for name, value in os.environ.items() if not name.startswith("OPENBLAS_")}
    args = [sys.executable, str(Path(__file__).resolve()), "--worker", str(folder), memory, str(context),
            str(repeats), ",".join(map(str, ks)), str(threads or 0), "cpu" if cpu else "wall"]
    done = subprocess.run(args, env={**clean, **env, "PYTHONPATH": str(tree)}, capture_output=True, text=True,
                          cwd=tree)
    if done.returncode:
        raise SystemExit(f"worker failed ({tree}): {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def estimated_ratio(result: dict, k: int, layers: int) -> float:
    """forward(k) / forward(1) predicted for `layers` decoder layers from the breakdown: every step but the
    LM head scaled by layers / the layers measured."""
    def full(ms: dict[str, float]) -> float:
        head = ms.get("lm_head", 0.0)
        return head + (sum(ms.values()) - head) * layers / result["layers"]
    return full(result["breakdown"][str(k)]) / full(result["breakdown"]["1"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.few_tokens", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 5, 9], help="new tokens per call (1 first)")
    parser.add_argument("--context", type=int, default=128, help="cached positions before the k new tokens")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the 8b checkpoint (default 4)")
    parser.add_argument("--repeats", type=int, default=3, help="processes per configuration, interleaved")
    parser.add_argument("--calls", type=int, default=5, help="timed calls per k in each process (median)")
    parser.add_argument("--threads", type=int, help="threads for qwen_np (default: all cores)")
    parser.add_argument("--baseline", type=Path, help="another checkout whose qwen_np runs alongside")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: this thread's CPU time instead of wall time, which a busy machine's "
                             "time slices do not inflate (meaningful with --threads 1 only)")
    parser.add_argument("--wait-quiet", type=float, default=20, metavar="S",
                        help="wait up to S seconds for other processes to go quiet before each process")
    args = parser.parse_args(argv)
    if args.k[0] != 1:
        parser.error("--k: the first k must be 1 (the ratios are over it)")

    from bench.checkpoints import ensure_checkpoint
    from qwen_np.core.config import PRESETS

    trees = {"this": ROOT, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    from bench.gguf_kinds import ensure_gguf

    folders = {name: ensure_gguf(model, name.partition("-")[2]) if memory == "stored" else
               ensure_checkpoint(model, layers=args.layers if model == "8b" else None)
               for name, (model, memory) in MODELS.items() if name in args.models}
    from bench.run import busy_cpu_seconds, children_cpu_seconds, wait_for_quiet

    configs = [(m, kernel, tree) for m in args.models for kernel in args.kernels for tree in trees]
    results: dict[tuple[str, str, str], list[dict]] = {c: [] for c in configs}
    for repeat in range(args.repeats):
        for m, kernel, tree in configs:
            with contextlib.redirect_stdout(sys.stderr):     # its notes are progress, not the tables
                wait_for_quiet(args.wait_quiet)
            busy, ours, start = busy_cpu_seconds(), children_cpu_seconds(), time.monotonic()
            result = run_worker(trees[tree], KERNELS[kernel], folders[m], MODELS[m][1], args.k, args.context,
                                args.calls, args.threads, args.clock == "cpu")
            others = (busy_cpu_seconds() - busy - (children_cpu_seconds() - ours)) / (time.monotonic() - start)
            result["others"] = max(0.0, others)
            results[(m, kernel, tree)].append(result)
            ms = result["ms"]
            print(f"repeat {repeat + 1} {m} {kernel} {tree} ({result['kernel']}, {result['threads']} threads): "
                  + ", ".join(f"k={k} {ms[str(k)]:.1f} ms" for k in args.k), file=sys.stderr, flush=True)

    print(f"forward(k new tokens, cache) / forward(1 token), {args.context} cached positions, all k logits; "
          f"median of {args.repeats} processes x {args.calls} calls, {args.clock} time\n")
    print("| model | BLAS kernel | code | other processes (cores) | 1 token ms | "
          + " | ".join(f"k={k}" for k in args.k[1:]) + " |")
    print("|---|---|---|---|---|" + "---|" * len(args.k[1:]))
    for (m, kernel, tree), runs in results.items():
        ones = statistics.median(r["ms"]["1"] for r in runs)
        ratios = [statistics.median(r["ms"][str(k)] / r["ms"]["1"] for r in runs) for k in args.k[1:]]
        others = statistics.median(r["others"] for r in runs)
        print(f"| {m} | {kernel} | {tree} | {others:.1f} | {ones:.1f} | " + " | ".join(f"{x:.2f}" for x in ratios) + " |")
    full_layers = PRESETS["qwen3-8b"].num_hidden_layers
    if "8b-bf16" in args.models:
        print(f"\n8b-bf16 has {args.layers} layers; the ratio the breakdown predicts for all {full_layers}:\n")
        print("| BLAS kernel | code | " + " | ".join(f"k={k}" for k in args.k[1:]) + " |")
        print("|---|---|" + "---|" * len(args.k[1:]))
        for (m, kernel, tree), runs in results.items():
            if m == "8b-bf16":
                print(f"| {kernel} | {tree} | " + " | ".join(
                    f"{statistics.median(estimated_ratio(r, k, full_layers) for r in runs):.2f}" for k in args.k[1:])
                    + " |")
    print("\nWhere the time goes (ms per call, medians, timed pass):\n")
    for (m, kernel, tree), runs in results.items():
        steps = sorted({name for r in runs for b in r["breakdown"].values() for name in b},
                       key=lambda name: -runs[0]["breakdown"][str(args.k[-1])].get(name, 0.0))
        print(f"{m}, {kernel}, {tree}:\n")
        print("| k | " + " | ".join(steps) + " | total |")
        print("|---|" + "---|" * (len(steps) + 1))
        for k in args.k:
            cells = [statistics.median(r["breakdown"][str(k)].get(name, 0.0) for r in runs) for name in steps]
            print(f"| {k} | " + " | ".join(f"{c:.1f}" for c in cells) + f" | {sum(cells):.1f} |")
        print()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        folder, memory, context, calls, ks, threads, clock = sys.argv[2:9]
        from qwen_np.engine import runtime
        runtime.set_threads(int(threads) or None)
        print(json.dumps(worker(folder, memory, [int(k) for k in ks.split(",")], int(context), int(calls),
                                clock == "cpu")))
    else:
        main()
