"""`python -m bench.streams`: aggregate decode tokens/s with 1, 2, 4, 8 concurrent streams, side by side.

Decoding is memory-bound: a step for 8 sequences reads every weight once, like a step for one, so
batching the streams' decode steps (qwen_np.generation.batching.BatchGenerator, what `serve` runs) should turn
the same memory traffic into several times the tokens. Each configuration runs N greedy requests with
different random prompts together in one BatchGenerator (max_batch N) and times the decode steps
only (after every stream has its first token): aggregate tok/s = N x decode steps / seconds.

`single` is one stream through generate()'s own loop (model.forward one token at a time), in a fresh
process; with `--baseline PATH` the same loop also runs on another checkout's qwen_np (e.g. main, from
`git worktree add` or `git archive`), so "single-stream speed unchanged" is measured in the same run.
Configurations are interleaved over the repeats; medians are reported.

llama.cpp with the same number of parallel sequences runs when llama-cpp-python is installed (it is
not on this machine: see bench/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

SINGLE_STREAM = """
import json, sys, time
from qwen_np import load_model
from qwen_np.engine import runtime            # before NumPy, as the CLI (qwen_np/__init__.py)
import numpy as np
folder, memory, prompt_len, decode, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
runtime.set_threads(threads)
model = load_model(folder, memory=memory)
prompt = np.random.default_rng(99).integers(0, min(50000, model.config.vocab_size), prompt_len)
cache = model.new_cache(prompt_len + decode + 1)
token = int(model.forward(prompt, cache, last_only=True)[-1].argmax())
token = int(model.forward([token], cache)[-1].argmax())          # warm-up step: buffers, page faults
start = time.perf_counter()
for _ in range(decode - 1):
    token = int(model.forward([token], cache)[-1].argmax())
print(json.dumps({"tok_s": (decode - 1) / (time.perf_counter() - start)}))
"""


def single_stream(tree: Path, folder: Path, memory: str, prompt: int, decode: int) -> float:
    """generate()'s loop, one stream, in a fresh process importing qwen_np from `tree`."""
    from qwen_np.engine import runtime

    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-c", SINGLE_STREAM, str(folder), memory, str(prompt), str(decode),
                           str(runtime.threads())],
                          env=env, capture_output=True, text=True, check=True, cwd=tree)
    return json.loads(done.stdout.strip().splitlines()[-1])["tok_s"]


def batched(model, tokenizer, streams: int, prompt: int, decode: int, seed: int) -> float:
    """Aggregate decode tok/s of `streams` greedy requests sharing one BatchGenerator."""
    from qwen_np.generation.batching import BatchGenerator, Request
    from qwen_np.core.sampling import SamplingParams

    rng = np.random.default_rng(seed)
    generator = BatchGenerator(model, tokenizer, max_batch=streams, prefill_chunk=streams * prompt)
    vocab = min(50000, model.config.vocab_size)           # random prompts, in any model's vocabulary
    rows = [generator.submit(Request(rng.integers(0, vocab, prompt).tolist(), SamplingParams(temperature=0), decode))
            for _ in range(streams)]
    while not all(row.generated for row in rows):          # prefill: every stream gets its first token
        generator.step()
    generator.step()                                       # warm-up decode step (buffers for this batch size)
    steps, start = 0, time.perf_counter()
    while not generator.idle:
        generator.step()
        steps += 1
    seconds = time.perf_counter() - start
    assert all(len(row.generated) == decode for row in rows) and steps == decode - 2
    return streams * steps / seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.streams", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="0.6b", help="0.6b or 8b (random weights at the real shapes), or a folder")
    parser.add_argument("--memory", default="auto", choices=("auto", "fp32", "bf16"),
                        help="load_model's memory (default auto: FP32 as numerics.Panels where it fits)")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens per stream (default 16)")
    parser.add_argument("--decode", type=int, default=34, help="new tokens per stream (default 34: 32 timed)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, help="threads for qwen_np (default: all cores)")
    parser.add_argument("--baseline", type=Path, help="another checkout whose single-stream decode runs alongside")
    parser.add_argument("--json", type=Path, help="also write the settings and every repeat's tok/s here")
    args = parser.parse_args(argv)

    from bench.checkpoints import MODELS, ensure_checkpoint
    from qwen_np import load_model
    from qwen_np.engine import runtime
    from qwen_np.files.tokenizer import Tokenizer

    folder = ensure_checkpoint(args.model) if args.model in MODELS else Path(args.model)
    runtime.set_threads(args.threads)
    model = load_model(folder, memory=args.memory)
    # The checkpoint's own tokenizer, else the real Qwen3 one (bench's random checkpoints have none).
    tokenizer = Tokenizer.from_folder(folder if (folder / "tokenizer.json").is_file()
                                      else ROOT / "tests" / "fixtures" / "qwen3_tokenizer_random")
    names = ["single (generate loop)"] + ([f"single, baseline {args.baseline}"] if args.baseline else [])
    names += [f"{n} stream{'s' if n > 1 else ''} (batched)" for n in args.streams]
    results: dict[str, list[float]] = {name: [] for name in names}
    print(f"{folder.name}, {args.memory}, {runtime.threads()} threads, prompt {args.prompt}, "
          f"{args.decode - 2} timed decode steps, {args.repeats} repeats (interleaved)", file=sys.stderr)
    load = os.getloadavg()[0]                              # what else was running when it started
    for repeat in range(args.repeats):
        results[names[0]].append(single_stream(ROOT, folder, args.memory, args.prompt, args.decode))
        if args.baseline:
            results[names[1]].append(single_stream(args.baseline.resolve(), folder, args.memory, args.prompt,
                                                   args.decode))
        for n in args.streams:
            results[f"{n} stream{'s' if n > 1 else ''} (batched)"].append(
                batched(model, tokenizer, n, args.prompt, args.decode, seed=repeat))
        print(f"repeat {repeat + 1}: " + ", ".join(f"{name} {values[-1]:.1f}" for name, values in results.items()),
              file=sys.stderr)
    single = statistics.median(results[names[0]])
    one = statistics.median(results["1 stream (batched)"]) if 1 in args.streams else single
    print("| configuration | aggregate decode tok/s (median) | x single | x 1 stream batched |")
    print("|---|---|---|---|")
    for name, values in results.items():
        rate = statistics.median(values)
        print(f"| {name} | {rate:.1f} | {rate / single:.2f} | {rate / one:.2f} |")
    if args.json:
        record = {"command": "python -m bench.streams " + " ".join(argv if argv is not None else sys.argv[1:]),
                  "model": folder.name, "memory": args.memory, "threads": runtime.threads(), "prompt": args.prompt,
                  "timed_decode_steps": args.decode - 2, "repeats": args.repeats, "load_average_at_start": load,
                  "streams": args.streams, "tok_s": results}
        args.json.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
