"""`python -m bench.serve_load`: `serve` under a KV memory budget, through HTTP, as clients meet it.

1. Many concurrent long requests (default 32) against `serve --kv-memory SIZE --max-batch N`: the
   server's peak RSS (VmHWM, read from /proc after the run) against what it may hold (its weights'
   resident bytes before the first request + the budget), how many times rows were preempted
   (/metrics), and whether every greedy text equals the text of the same request sent alone to a fresh
   server (one request at a time: no batching, no preemption, no prefix shared with another request).
2. Prefix caching: time to first streamed token of a request with a long new prefix (default 1,500
   tokens) + 16 tokens, then of a second request sharing that prefix with 16 other tokens; the issue's
   goal is second <= 0.1 x first. Repeated with fresh prefixes; medians.

Prompts are random token ids (the random-weight checkpoints have no text worth prompting); every
request is greedy (temperature 0), so a text is a function of its prompt alone.

    python -m bench.serve_load                           # Qwen3-0.6B shapes (random weights, bench/checkpoints.py)
    python -m bench.serve_load --requests 32 --prompt 256 --tokens 64 --kv-memory 512MiB --prefix 1500
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import shutil
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from bench.checkpoints import cache_dir, ensure_checkpoint

ROOT = Path(__file__).resolve().parents[1]
REAL_TOKENIZER = ROOT / "tests" / "fixtures" / "qwen3_tokenizer_random"   # Qwen3's tokenizer and template
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def servable(folder: Path) -> Path:
    """A folder `serve` can open: the random checkpoint's files linked beside Qwen3's tokenizer files."""
    if (folder / "tokenizer.json").exists():
        return folder
    served = cache_dir() / f"{folder.name}-served"
    served.mkdir(exist_ok=True)
    for path in folder.iterdir():
        link = served / path.name
        if not link.exists():
            link.symlink_to(path)
    for name in TOKENIZER_FILES:
        shutil.copy(REAL_TOKENIZER / name, served / name)
    return served


@contextlib.contextmanager
def serving(folder: Path, *flags: str) -> Iterator[tuple[str, int]]:
    """A `serve` process on an ephemeral port: (its base URL, its pid); stopped on leaving."""
    process = subprocess.Popen([sys.executable, "-m", "qwen_np", "serve", "--model", str(folder), "--port", "0",
                                "--quiet", *flags], cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                               env={**os.environ, "PYTHONPATH": str(ROOT)}, bufsize=0)
    assert process.stderr is not None
    try:
        line = b""
        while b"serving" not in line:
            ready, _, _ = select.select([process.stderr], [], [], 600)
            if not ready or process.poll() is not None:
                raise SystemExit(f"serve did not start: {line.decode(errors='replace')}")
            line = process.stderr.readline()
            print("   serve:", line.decode(errors="replace").rstrip())
        yield line.decode().split(" on ")[1].split()[0], process.pid
    finally:
        process.terminate()
        process.wait(30)


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=3600) as response:
            return json.load(response)
    except urllib.error.HTTPError as refused:
        raise SystemExit(f"serve refused a request: {refused.code} {refused.read().decode()}") from None


def completion(url: str, prompt: list[int], tokens: int) -> str:
    answer = post(url + "/completions", {"prompt": prompt, "max_tokens": tokens, "temperature": 0})
    return answer["choices"][0]["text"]


def first_token_seconds(url: str, prompt: list[int]) -> float:
    """Seconds from sending a streamed request to reading its first token's event."""
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True}
    request = urllib.request.Request(url + "/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=3600) as response:
        for raw in response:
            if raw.startswith(b"data: {"):
                elapsed = time.perf_counter() - started
                response.read()
                return elapsed
    raise SystemExit("the stream ended without a token")


def status_kib(pid: int, field: str) -> int:
    """A memory field of /proc/PID/status (VmRSS, VmHWM), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=30) as response:
        lines = response.read().decode().splitlines()
    return {name.removeprefix("qwen_np_"): float(value)
            for name, value in (line.split(" ") for line in lines if not line.startswith("#"))}


def concurrent_requests(folder: Path, args: argparse.Namespace) -> None:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, args.vocab, args.prompt).tolist() for _ in range(args.requests)]
    flags = ["--kv-memory", args.kv_memory, "--max-batch", str(args.max_batch), "-c", str(args.context)]
    print(f"1. {args.requests} concurrent requests of {args.prompt} prompt + {args.tokens} new tokens, "
          f"--kv-memory {args.kv_memory} --max-batch {args.max_batch}, {folder.name}")
    with serving(folder, *flags) as (url, pid):
        before = status_kib(pid, "VmRSS")                      # the weights, loaded, before any request
        started = time.perf_counter()
        with ThreadPoolExecutor(args.requests) as pool:
            together = list(pool.map(lambda p: completion(url, p, args.tokens), prompts))
        seconds = time.perf_counter() - started
        peak, counts = status_kib(pid, "VmHWM"), metrics(url)
    with serving(folder, *flags) as (url, _):
        alone = [completion(url, p, args.tokens) for p in prompts]
    budget = parse_size(args.kv_memory)
    same = sum(a == b for a, b in zip(together, alone))
    over = peak * 1024 - (before * 1024 + budget)
    print(f"   RSS with the weights loaded, before any request, {before / 2**20:.2f} GiB; + the budget "
          f"{(before * 1024 + budget) / 2**30:.2f} GiB; peak {peak / 2**20:.2f} GiB "
          f"({abs(over) / 2**20:.0f} MiB {'above' if over > 0 else 'below'} that: a step's activations and buffers)")
    print(f"   preemptions {counts['preemptions_total']:.0f}; {args.requests * args.tokens} tokens in {seconds:.0f} s; "
          f"texts equal to each request's solo run: {same} of {args.requests}")


def parse_size(text: str) -> int:
    from qwen_np.engine.sizes import parse_size as parse

    return parse(text, "kv_memory")


def prefix_reuse(folder: Path, args: argparse.Namespace) -> None:
    first, second = [], []
    with serving(folder, "-c", str(args.prefix + 64)) as (url, _):
        completion(url, [1, 2, 3], 2)                         # warm-up: the first request's one-time costs
        for repeat in range(args.repeats):
            rng = np.random.default_rng(100 + repeat)
            shared = rng.integers(0, args.vocab, args.prefix).tolist()
            first.append(first_token_seconds(url, shared + rng.integers(0, args.vocab, 16).tolist()))
            second.append(first_token_seconds(url, shared + rng.integers(0, args.vocab, 16).tolist()))
    a, b = statistics.median(first), statistics.median(second)
    print(f"2. time to first streamed token, {args.prefix}-token prefix + 16 new tokens, median of {args.repeats}:")
    print(f"   first request {a * 1e3:.0f} ms; second, sharing the prefix, {b * 1e3:.0f} ms: "
          f"{b / a:.3f}x the first ({a / b:.1f}x faster; goal <= 0.1x)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.serve_load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="0.6b", help="0.6b (random weights, generated once) or a folder")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens of each concurrent request")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens of each concurrent request")
    parser.add_argument("--kv-memory", default="512MiB", help="serve's --kv-memory for the concurrent run")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--prefix", type=int, default=1500, help="tokens of the shared prefix (0: skip 2.)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-concurrent", action="store_true")
    args = parser.parse_args(argv)
    folder = servable(Path(args.model) if Path(args.model).is_dir() else ensure_checkpoint(args.model))
    args.vocab = min(50000, json.loads((folder / "config.json").read_text())["vocab_size"])   # ordinary ids
    if not args.skip_concurrent:
        concurrent_requests(folder, args)
    if args.prefix:
        prefix_reuse(folder, args)


if __name__ == "__main__":
    main()
