"""Peak memory of attention, plain against FlashAttention's key blocks: `python -m bench.flash_memory`.

One attention call at Qwen3-8B's head shape (32 query heads, 8 key heads, head_dim 128; one layer,
one sequence) on random FP32 inputs for a few context lengths T (a prefill: T queries over T keys).
tracemalloc (which sees NumPy's allocations) measures the most bytes held at once beyond the inputs,
for layers.attention (its [H, T, T] scores and probabilities) and core/flash.flash_attention (one
[H, T, block] block of scores at a time, and the [H, T, Dh] running sums), and prints their ratio.
Both give the same output (tests/core/test_flash_attention.py); the figure is memory, not time.
"""

from __future__ import annotations

import argparse
import tracemalloc
from typing import Callable

import numpy as np

from qwen_np.core import layers
from qwen_np.core.flash import KEY_BLOCK, flash_attention

H, KVH, Dh = 32, 8, 128                                   # Qwen3-8B's attention heads


def peak_extra_bytes(attend: Callable[..., np.ndarray], *args: np.ndarray, **options: int) -> int:
    """The most bytes NumPy held at once during attend(*args), beyond what was allocated before it."""
    tracemalloc.start()
    attend(*args, **options)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--block", type=int, default=KEY_BLOCK, help="keys per block")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"one attention call, H={H} KVH={KVH} Dh={Dh}, FP32, key block {args.block}")
    print(f"{'T':>6} {'plain MiB':>10} {'flash MiB':>10} {'plain / flash':>14}")
    for T in args.contexts:
        q = rng.standard_normal((T, H, Dh), dtype=np.float32)
        k = rng.standard_normal((T, KVH, Dh), dtype=np.float32)
        v = rng.standard_normal((T, KVH, Dh), dtype=np.float32)
        positions = np.arange(T)
        plain = peak_extra_bytes(layers.attention, q, k, v, positions)
        flash = peak_extra_bytes(flash_attention, q, k, v, positions, block=args.block)
        print(f"{T:>6} {plain / 2 ** 20:>10.1f} {flash / 2 ** 20:>10.1f} {plain / flash:>13.1f}x")


if __name__ == "__main__":
    main()
