"""`python -m bench.loadtime`: how long load_model takes for Qwen3-0.6B, and whether decoding from the
memory-mapped FP32 weight cache is as fast as from weights converted into anonymous memory.

Load times: each configuration loads in its own process, after the files it reads were put in a state:

* cold: the checkpoint's files and its FP32 cache evicted from the page cache (posix_fadvise
  DONTNEED on those files only: the same as `echo 3 > /proc/sys/vm/drop_caches` for them, without
  emptying the cache of every other process on a shared machine);
* warm: those files read just before, with the rest of RAM as other processes left it (the
  pressure state's filler evicted again);
* pressure: a sparse filler file read until less than PRESSURE_FREE bytes of RAM are free, then the
  model's files read: they are in the page cache, but every fresh page must be reclaimed from it
  first (a user who has just downloaded or converted models).

Configurations: fp32 converted into memory (QWEN_NP_CACHE=off), fp32 mapped from a built cache,
fp32's first load (building the cache into an empty folder), and bf16 (the checkpoint mapped as
stored). Each measures load_model, then one decode step (which faults in whatever load left
unmapped). Configurations run interleaved (repeat 1 of every state and configuration, then repeat 2).

Decode: one process loads the model twice, fp32 in memory and fp32 mapped from the cache, and times
decode rounds and one token's weight products alone, alternating between the two models.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from .checkpoints import cache_dir, ensure_checkpoint

GiB = 1024 ** 3
STATES = ("cold", "warm", "pressure")
CONFIGS = ("fp32 in memory", "fp32 cache", "fp32 first load (builds cache)", "bf16")
PRESSURE_FREE = 512 * 1024 ** 2     # pressure: fill the page cache until less than this is free
CHUNK = 64 * 1024 ** 2


def meminfo(field: str) -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def evict(paths: list[Path]) -> None:
    """Drop these files' pages from the page cache (clean pages; the cache file is fsynced when built)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read(path: Path, stop_below_free: int | None = None) -> None:
    """Read a file into the page cache (stopping once less than stop_below_free bytes of RAM are free)."""
    chunk = bytearray(CHUNK)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(chunk):
            if stop_below_free is not None and meminfo("MemFree") < stop_below_free:
                return


def resident_fraction(paths: list[Path]) -> float | None:
    """The share of these files' bytes in the page cache, from util-linux fincore (None without it)."""
    if shutil.which("fincore") is None:
        return None
    done = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES,SIZE", *map(str, paths)],
                          capture_output=True, text=True)
    pairs = [tuple(map(int, line.split())) for line in done.stdout.splitlines() if line.strip()]
    return sum(r for r, _ in pairs) / max(sum(s for _, s in pairs), 1) if done.returncode == 0 else None


def filler_file() -> Path:
    """A sparse file as large as RAM: reading its holes fills the page cache without any disk I/O."""
    path = cache_dir() / "page-cache-filler"
    size = meminfo("MemTotal")
    if not path.exists() or path.stat().st_size != size:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.truncate(size)
    return path


def prepare(state: str, files: list[Path]) -> None:
    """Put the model's files in `state`; outside "pressure" the filler's pages are let go first, so the
    RAM the previous pressure trial filled is free again."""
    if state == "pressure":
        read(filler_file(), stop_below_free=PRESSURE_FREE)
    else:
        evict([filler_file()])
    if state == "cold":
        evict(files)
    else:
        for path in files:
            read(path)


def trial(config: str, folder: str) -> dict[str, Any]:
    """One load (this process): load_model, then one decode step, timed apart."""
    import qwen_np

    start = time.perf_counter()
    model = qwen_np.load_model(folder, memory="bf16" if config == "bf16" else "fp32", max_tokens=64)
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    model.forward([1000], model.new_cache(64))
    first_token_s = time.perf_counter() - start
    return {"load_s": load_s, "first_token_s": first_token_s}


def run_trial(config: str, state: str, folder: Path, cache: Path, files: list[Path]) -> dict[str, Any]:
    build_root = cache.parent / "loadtime-build"
    shutil.rmtree(build_root, ignore_errors=True)
    root = {"fp32 in memory": "off", "fp32 first load (builds cache)": str(build_root)}.get(config, str(cache))
    prepare(state, files)
    before = {"free_gib": meminfo("MemFree") / GiB, "resident": resident_fraction(files)}
    done = subprocess.run([sys.executable, "-m", "bench.loadtime", "--trial", config, str(folder)],
                          env={**os.environ, "QWEN_NP_CACHE": root}, capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1])
    shutil.rmtree(build_root, ignore_errors=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{config} / {state} failed: {done.stderr.strip()[-2000:]}")
    return {**json.loads(lines[-1]), **before}


def decode_side_by_side(folder: Path, cache: Path, rounds: int, tokens: int) -> dict[str, Any]:
    """Decode tok/s and one token's weight products, fp32 in memory against fp32 mapped, alternating."""
    import qwen_np

    from .worker import weight_stream_seconds

    models = {}
    for name, root in (("in memory", "off"), ("mapped", str(cache))):
        os.environ["QWEN_NP_CACHE"] = root
        models[name] = qwen_np.load_model(folder, memory="fp32", max_tokens=32 + tokens)
    prompt = (np.arange(32) * 7919 + 1000) % models["mapped"].config.vocab_size
    rates: dict[str, list[float]] = {name: [] for name in models}
    streams: dict[str, list[float]] = {name: [] for name in models}
    for r in range(rounds):
        for name in (list(models) if r % 2 == 0 else list(models)[::-1]):
            model = models[name]
            cache_kv = model.new_cache(32 + tokens)
            token = int(model.forward(prompt, cache_kv, last_only=True)[-1].argmax())
            start = time.perf_counter()
            for _ in range(tokens):
                token = int(model.forward([token], cache_kv)[-1].argmax())
            rates[name].append(tokens / (time.perf_counter() - start))
            streams[name].append(weight_stream_seconds(model))
    ratios = [m / a for m, a in zip(rates["mapped"], rates["in memory"])]
    stream_ratios = [a / m for m, a in zip(streams["mapped"], streams["in memory"])]
    return {"rates": rates, "streams": streams, "decode_ratios": ratios, "stream_ratios": stream_ratios}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.loadtime", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3,
                        help="processes per configuration and state (default 3; 0: decode only)")
    parser.add_argument("--states", default=",".join(STATES), help=f"comma-separated, of {', '.join(STATES)}")
    parser.add_argument("--decode-rounds", type=int, default=6, help="alternating decode rounds (default 6; 0 skips)")
    parser.add_argument("--decode-tokens", type=int, default=32, help="tokens per decode round (default 32)")
    parser.add_argument("--threads", type=int, default=None, help="threads for the decode comparison (default: all cores)")
    parser.add_argument("--trial", nargs=2, metavar=("CONFIG", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trial:
        print(json.dumps(trial(*args.trial)))
        return

    from qwen_np.files.checkpoint import Checkpoint
    from qwen_np.core.config import load_config
    from qwen_np.engine.weight_cache import CACHE_ENV, cache_file

    folder = ensure_checkpoint("0.6b")
    cache = cache_dir() / "weight-cache"
    os.environ[CACHE_ENV] = str(cache)
    checkpoint = Checkpoint(folder, load_config(folder))
    cache_path = cache_file(checkpoint)
    assert cache_path is not None
    if not cache_path.exists():
        subprocess.run([sys.executable, "-m", "bench.loadtime", "--trial", "fp32 cache", str(folder)], check=True,
                       cwd=Path(__file__).resolve().parents[1])
    files = sorted({info.path for info in checkpoint.tensors.values()}) + [cache_path]
    if args.decode_rounds:
        from qwen_np.engine import runtime

        runtime.set_threads(args.threads)
        result = decode_side_by_side(folder, cache, args.decode_rounds, args.decode_tokens)
        for name in result["rates"]:
            print(f"decode fp32 {name}: {statistics.median(result['rates'][name]):.2f} tok/s "
                  f"({', '.join(f'{r:.1f}' for r in result['rates'][name])}); one token's products "
                  f"{1e3 * statistics.median(result['streams'][name]):.1f} ms")
        for what in ("decode", "stream"):
            q1, median, q3 = statistics.quantiles(result[what + "_ratios"], n=4)
            print(f"mapped / in memory, per-round {'decode tok/s' if what == 'decode' else 'weight product speed'}: "
                  f"median {median:.3f} (quartiles {q1:.3f}-{q3:.3f})", flush=True)

    states = [s.strip() for s in args.states.split(",") if s.strip()]
    if not (states and args.repeats):
        return
    results: dict[tuple[str, str], list[dict[str, Any]]] = {(c, s): [] for s in states for c in CONFIGS}
    for repeat in range(args.repeats):
        for state in states:
            for config in CONFIGS:
                r = run_trial(config, state, folder, cache, files)
                results[config, state].append(r)
                resident = "?" if r["resident"] is None else f"{100 * r['resident']:.0f}%"
                print(f"repeat {repeat + 1} {state:>8} {config:<31} load {r['load_s']:6.3f} s, first token "
                      f"{r['first_token_s']:6.3f} s (before: {r['free_gib']:.1f} GiB free, model files {resident} "
                      "in page cache)", flush=True)
    print()
    print("| weights | " + " | ".join(f"{s}: load s | {s}: + first token s" for s in states) + " |")
    print("|---|" + "---|---|" * len(states))
    for config in CONFIGS:
        cells = []
        for state in states:
            rows = results[config, state]
            cells += [f"{statistics.median(r['load_s'] for r in rows):.2f}",
                      f"{statistics.median(r['load_s'] + r['first_token_s'] for r in rows):.2f}"]
        print(f"| {config} | " + " | ".join(cells) + " |")
    speedups = {s: statistics.median(a["load_s"] / c["load_s"] for a, c in
                                     zip(results["fp32 in memory", s], results["fp32 cache", s])) for s in states}
    print(f"\nmedians of {args.repeats}; fp32 in-memory load time over the fp32 cache's, per repeat, median: "
          + ", ".join(f"{s} {x:.1f}x" for s, x in speedups.items()))

if __name__ == "__main__":
    main()
