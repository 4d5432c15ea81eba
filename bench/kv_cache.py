"""`python -m bench.kv_cache`: the paged KV cache's five figures, each measured side by side.

1. Block size: reading a sequence's keys of one layer from scattered blocks (a gather, what attention
   does every step for every layer) against reading them from one contiguous array (a copy of the same
   bytes), at Qwen3-0.6B's KV shapes (KVH 8, Dh 128, FP32) and 2,048 positions, for block sizes 1..256.
2. Prefix caching: time to first token of a request, and of a second request sharing its long prefix
   (the prefix's blocks come from the prefix cache; only the rest is prefilled), in one BatchGenerator,
   as `serve` runs them. Each repeat uses a fresh prefix; medians; the ratio is first / second.
3. A batched decode step of 8 sequences of `--context` positions each in one shared pool, taking their
   blocks in turn as rows decoding side by side in `serve` do (the pool keeps each one's blocks in a
   few runs), and with every other block of the pool held elsewhere (each block its own run: the
   worst case), against each sequence in a cache of its own whose blocks lie in order (one run: what
   the contiguous cache before paging was). Interleaved repeats, medians.
4. KV cache precision: the KL divergence of the predictions with a BF16, FP16 or int8 cache from those
   with an FP32 cache, on the bundled Shakespeare model (trained: its predictions are peaked like a real
   model's), with the precision lab's statistics (qwen_np.precision.divergence.Comparison).
5. KV dtype speed: one decode step of one sequence at `--context` positions with its cache stored as
   FP32 (read in place), BF16 (widened as read) and int8 (codes times scales as read), interleaved
   repeats, medians, beside each cache's bytes.

    python -m bench.kv_cache                      # the bundled model (a 256-token context: a short prefix)
    python -m bench.kv_cache --model 0.6b         # random weights at Qwen3-0.6B's shapes (bench/checkpoints.py)
    python -m bench.kv_cache --model 0.6b --prefix 512 --context 1024 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from qwen_np import load_model
from qwen_np.generation.batching import BatchGenerator, Request
from qwen_np.precision.divergence import Comparison
from qwen_np.engine.budget import blocks_for
from qwen_np.engine.paged import BlockPool, PagedKVCache, block_bytes, block_runs
from qwen_np.core.sampling import SamplingParams
from qwen_np.files.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "weights"
REAL_TOKENIZER = ROOT / "tests" / "fixtures" / "qwen3_tokenizer_random"   # Qwen3's tokenizer, for random checkpoints
TEXT = ("HAMLET:\nTo be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"
        "The slings and arrows of outrageous fortune,\nOr to take arms against a sea of troubles\n")


def block_sizes(positions: int = 2048, kv_heads: int = 8, head_dim: int = 128, repeats: int = 20) -> None:
    rng = np.random.default_rng(0)
    contiguous = rng.standard_normal((positions, kv_heads, head_dim)).astype(np.float32)
    copy_time = _median_time(lambda: contiguous.copy(), repeats)
    print(f"1. reading {positions} positions of one layer's keys ({contiguous.nbytes / 2**20:.0f} MiB FP32)")
    print(f"   {'block size':>10} {'gather':>10} {'contiguous copy':>16} {'ratio':>7}")
    for size in (1, 4, 16, 64, 256):
        n = blocks_for(positions, size)
        pool = rng.standard_normal((2 * n, size, kv_heads, head_dim)).astype(np.float32)   # [N, BS, KVH, Dh]
        table = rng.permutation(2 * n)[:n]                       # scattered over a pool twice as big
        gather = _median_time(lambda pool=pool, table=table: pool[table].reshape(-1, kv_heads, head_dim)[:positions],
                              repeats)
        print(f"   {size:>10} {gather * 1e3:>8.2f}ms {copy_time * 1e3:>14.2f}ms {gather / copy_time:>7.2f}")


def _median_time(work, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def prefix_ttft(folder: Path, prefix: int, repeats: int) -> None:
    model = load_model(folder, max_tokens=prefix + 64)
    tok = Tokenizer.from_folder(folder if (folder / "tokenizer.json").exists() else REAL_TOKENIZER)
    greedy = SamplingParams(temperature=0)
    first, second, prefilled = [], [], []
    for r in range(repeats):
        rng = np.random.default_rng(r)
        shared = rng.integers(0, model.config.vocab_size, prefix).tolist()
        generator = BatchGenerator(model, tok, max_batch=1, context=prefix + 64,
                                   pool=BlockPool(model.config, 2 * blocks_for(prefix + 64), prefix_caching=True))
        for times in (first, second):
            ids = shared + rng.integers(0, model.config.vocab_size, 16).tolist()     # a new question each
            before = generator.prefilled_tokens
            row = generator.submit(Request(ids, greedy, 1))
            while not row.done:
                generator.step()
            assert row.first_token is not None
            times.append(row.first_token - row.submitted)
        prefilled.append(generator.prefilled_tokens - before)
    a, b = statistics.median(first), statistics.median(second)
    print(f"2. time to first token, {prefix}-token shared prefix + 16 new tokens, {folder.name}, median of {repeats}")
    print(f"   {'first request':>14} {'shared prefix':>14} {'ratio':>7}   (second prefilled {prefilled[0]} tokens)")
    print(f"   {a * 1e3:>12.1f}ms {b * 1e3:>12.1f}ms {a / b:>7.1f}")


def scattered_decode(folder: Path, context: int, repeats: int, rows: int = 8) -> None:
    model = load_model(folder, max_tokens=context + repeats + 2)
    size = context + repeats + 2
    shared, worst = BlockPool(model.config, rows * blocks_for(size)), BlockPool(model.config, 2 * rows * blocks_for(size))
    for odd in range(1, worst.num_blocks, 2):
        worst.allocate(after=odd - 1)                  # held elsewhere: the rows get every other block
    caches = {"own caches": [model.new_cache(size) for _ in range(rows)],
              "one pool": [PagedKVCache(shared, size) for _ in range(rows)],
              "worst case": [PagedKVCache(worst, size) for _ in range(rows)]}
    # Filled without a prefill (the keys' values do not change the step's time), the rows in turn.
    for _ in range(0, context, shared.block_size):
        for group in caches.values():
            for cache in group:
                cache.reserve(shared.block_size)
                cache.advance([0] * shared.block_size)
    times: dict[str, list[float]] = {name: [] for name in caches}
    for _ in range(repeats):
        for name, group in caches.items():
            started = time.perf_counter()
            model.forward_batch([[1]] * rows, group, last_only=True)
            times[name].append(time.perf_counter() - started)
    medians = {name: statistics.median(t) for name, t in times.items()}
    print(f"3. one decode step of {rows} sequences at {context} positions, {folder.name}, median of {repeats}")
    print(f"   {'':>12} {'runs per row':>13} {'step':>10} {'x own caches':>13}")
    for name, group in caches.items():
        runs = statistics.mean(len(block_runs(cache.table)) for cache in group)
        print(f"   {name:>12} {runs:>13.1f} {medians[name] * 1e3:>8.1f}ms {medians[name] / medians['own caches']:>13.3f}")


def kv_precision() -> None:
    model, tok = load_model(BUNDLED), Tokenizer.from_folder(BUNDLED)
    ids = tok.encode(TEXT * 4)

    def logits(dtype: str) -> np.ndarray:
        cache = model.new_cache(len(ids), dtype)
        return np.concatenate([model.forward(ids[i:i + 64], cache) for i in range(0, len(ids), 64)])

    base = logits("fp32")
    print(f"4. KV cache precision vs an FP32 cache, bundled model, {len(ids) - 1} positions")
    print(f"   {'kv dtype':>8} {'KLD mean':>10} {'KLD max':>10} {'same top':>9} {'PPL ratio':>10}")
    for dtype in ("bf16", "fp16", "int8"):
        comparison = Comparison()
        comparison.add(base[:-1], logits(dtype)[:-1], np.array(ids[1:]))
        s = comparison.summary()
        print(f"   {dtype:>8} {s['kld_mean']:>10.2e} {s['kld_max']:>10.2e} {s['same_top_percent']:>8.1f}% "
              f"{s['ppl_ratio']:>10.5f}")


def kv_dtype_decode(folder: Path, context: int, repeats: int, dtypes: tuple[str, ...] = ("fp32", "bf16", "int8")) -> None:
    model = load_model(folder, max_tokens=context + 2)
    caches = {dtype: model.new_cache(context + 1, dtype) for dtype in dtypes}
    for cache in caches.values():                      # filled without a prefill: the values do not change the time
        cache.reserve(context)
        cache.advance([0] * context)
    times: dict[str, list[float]] = {dtype: [] for dtype in dtypes}
    for _ in range(repeats):
        for dtype, cache in caches.items():
            started = time.perf_counter()
            model.forward([1], cache)
            times[dtype].append(time.perf_counter() - started)
            cache.truncate(context)
    medians = {dtype: statistics.median(t) for dtype, t in times.items()}
    print(f"5. one decode step of one sequence at {context} positions by KV dtype, {folder.name}, median of {repeats}")
    print(f"   {'kv dtype':>8} {'KV bytes':>10} {'step':>10} {'x fp32':>7}")
    for dtype, cache in caches.items():
        held = cache.pool.num_blocks * block_bytes(model.config, dtype)
        print(f"   {dtype:>8} {held / 2 ** 20:>7.1f}MiB {medians[dtype] * 1e3:>8.1f}ms {medians[dtype] / medians['fp32']:>7.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(BUNDLED), help="a checkpoint folder, or 0.6b / 8b (random weights)")
    parser.add_argument("--prefix", type=int, help="shared prefix tokens (default: 2048, 192 for the bundled model)")
    parser.add_argument("--context", type=int, help="positions of each sequence in the decode step (default: 2048, "
                                                    "240 for the bundled model)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.model in ("0.6b", "8b"):
        from .checkpoints import ensure_checkpoint
        folder = ensure_checkpoint(args.model)
    else:
        folder = Path(args.model)
    block_sizes()
    bundled = folder.resolve() == BUNDLED.resolve()
    prefix_ttft(folder, args.prefix or (192 if bundled else 2048), args.repeats)
    scattered_decode(folder, args.context or (240 if bundled else 2048), max(args.repeats, 5))
    kv_precision()
    kv_dtype_decode(folder, args.context or (240 if bundled else 2048), max(args.repeats, 5))


if __name__ == "__main__":
    main()
