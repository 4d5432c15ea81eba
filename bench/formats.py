"""`python -m bench.formats`: dequantize + GEMV throughput of the storage formats an inference mode
could keep its weights in, side by side in one process, as ratios to the BF16 upcast path.

Each configuration computes y = x W^T for one token (x [1, in], W [out, in]) the way a streaming
mode does: dequantize a block of rows into a reused FP32 buffer, multiply, next block. Rates are
weights per second; the configurations are interleaved over the repeats (so a slow patch of the
machine hits all alike) and the median is reported. BLAS runs on one thread unless --threads says.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
from threadpoolctl import threadpool_limits

from qwen_np.numbers.formats import (dequantize_int8_rows, dequantize_q4_0, dequantize_q8_0, quantize_int8_rows,
                                     quantize_q4_0, quantize_q8_0)
from qwen_np.numbers.numerics import bf16_bits_to_f32, f32_to_bf16_bits

try:  # the cast qwen_np.engine.fast uses for BF16; shown for comparison when installed
    import ml_dtypes
except ImportError:
    ml_dtypes = None

GEMV = Callable[[np.ndarray, np.ndarray], None]      # (x [1, in], y [1, out]) -> fills y


def streamed(rows: int, block_rows: int, columns: int,
             product: Callable[[slice, np.ndarray, np.ndarray, np.ndarray], None]) -> GEMV:
    """A GEMV that calls product(block, buffer, x, y) for each block of rows, with one reused FP32 buffer."""
    buffer = np.empty((block_rows, columns), dtype=np.float32)

    def gemv(x: np.ndarray, y: np.ndarray) -> None:
        for start in range(0, rows, block_rows):
            block = slice(start, min(start + block_rows, rows))
            product(block, buffer[:block.stop - start], x, y)
    return gemv


def configurations(w: np.ndarray, block_rows: int) -> dict[str, tuple[float, GEMV]]:
    """name -> (bytes per weight, GEMV) for FP32, BF16 and the int8 formats of w [out, in]."""
    rows, columns = w.shape
    bits = f32_to_bf16_bits(w)
    q_rows, row_scale = quantize_int8_rows(w)
    q_blocks, block_scale = quantize_q8_0(w)
    nibbles, nibble_scale = quantize_q4_0(w)
    views = {fmt: file_blocks(codes, scale) for fmt, (codes, scale) in
             {"q8_0": (q_blocks, block_scale), "q4_0": (nibbles, nibble_scale)}.items()}

    def fp32(x: np.ndarray, y: np.ndarray) -> None:
        np.matmul(x, w.T, out=y)

    def bf16_upcast(block, buffer, x, y):
        np.matmul(x, bf16_bits_to_f32(bits[block], out=buffer).T, out=y[:, block])

    def bf16_ml_dtypes(block, buffer, x, y):
        np.copyto(buffer, bits[block].view(ml_dtypes.bfloat16), casting="unsafe")
        np.matmul(x, buffer.T, out=y[:, block])

    def int8_rows(block, buffer, x, y):
        np.matmul(x, dequantize_int8_rows(q_rows[block], row_scale[block], out=buffer).T, out=y[:, block])

    def int8_rows_scale_after(block, buffer, x, y):
        # per-row scales factor out of each dot product: y[o] = scale[o] * (q[o] . x); cast only, scale T x out
        buffer[...] = q_rows[block]
        np.matmul(x, buffer.T, out=y[:, block])
        y[:, block] *= row_scale[block]

    def blocked(dequantize: Callable[..., np.ndarray], codes: np.ndarray, scale: np.ndarray):
        def product(block, buffer, x, y):
            np.matmul(x, dequantize(codes[block], scale[block], out=buffer).T, out=y[:, block])
        return streamed(rows, block_rows, columns, product)

    found = {"fp32 (no dequantize)": (4.0, fp32),
             "bf16 bit shift": (2.0, streamed(rows, block_rows, columns, bf16_upcast))}
    if ml_dtypes is not None:
        found["bf16 ml_dtypes cast"] = (2.0, streamed(rows, block_rows, columns, bf16_ml_dtypes))
    found["int8 rows"] = (1.0 + 4 / columns, streamed(rows, block_rows, columns, int8_rows))
    found["int8 rows, scale after"] = (1.0 + 4 / columns, streamed(rows, block_rows, columns, int8_rows_scale_after))
    found["q8_0"] = (34 / 32, blocked(dequantize_q8_0, q_blocks, block_scale))
    found["q8_0 GGUF block views"] = (34 / 32, blocked(dequantize_q8_0, *views["q8_0"]))
    found["q4_0"] = (18 / 32, blocked(dequantize_q4_0, nibbles, nibble_scale))
    found["q4_0 GGUF block views"] = (18 / 32, blocked(dequantize_q4_0, *views["q4_0"]))
    return found


def file_blocks(codes: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Codes [out, in/2 | in] and FP16 scales [out, in/32] laid out as ggml's blocks (scale, then codes),
    returned as the strided views a GGUF kept as stored is held as (gguf_file.GGUFCheckpoint.held)."""
    rows, blocks = scale.shape
    raw = np.concatenate([scale.view(np.uint8).reshape(rows, blocks, 2),
                          codes.view(np.uint8).reshape(rows, blocks, -1)], axis=-1)     # [out, in/32, 2 + bytes]
    return raw[..., 2:].view(codes.dtype), raw[..., :2].view(np.float16)[..., 0]


def measure(gemvs: dict[str, tuple[float, GEMV]], x: np.ndarray, rows: int, seconds: float) -> dict[str, list[float]]:
    """Seconds per GEMV of each configuration, interleaved until `seconds` have passed (at least 5 rounds)."""
    y = np.empty((1, rows), dtype=np.float32)
    times: dict[str, list[float]] = {name: [] for name in gemvs}
    for _, gemv in gemvs.values():
        gemv(x, y)                                         # warm up: fault in buffers, load BLAS
    deadline = time.perf_counter() + seconds
    while len(times[next(iter(times))]) < 5 or time.perf_counter() < deadline:
        for name, (_, gemv) in gemvs.items():
            start = time.perf_counter()
            gemv(x, y)
            times[name].append(time.perf_counter() - start)
    return times


def check_agreement(gemvs: dict[str, tuple[float, GEMV]], w: np.ndarray, x: np.ndarray) -> dict[str, float]:
    """Relative RMS difference of each configuration's y from the FP32 product (a sanity check)."""
    reference = x @ w.T
    errors = {}
    for name, (_, gemv) in gemvs.items():
        y = np.empty_like(reference)
        gemv(x, y)
        errors[name] = float(np.sqrt(np.mean((y - reference) ** 2) / np.mean(reference ** 2)))
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.formats", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4096, help="output rows of W (default 4096)")
    parser.add_argument("--columns", type=int, default=4096, help="input columns of W, a multiple of 32")
    parser.add_argument("--block-rows", type=int, default=128, help="rows dequantized per block (default 128)")
    parser.add_argument("--seconds", type=float, default=4.0, help="measuring time, all configurations")
    parser.add_argument("--threads", type=int, default=1, help="BLAS threads (default 1)")
    args = parser.parse_args(argv)

    rng = np.random.default_rng(0)
    w = (0.02 * rng.standard_normal((args.rows, args.columns))).astype(np.float32)
    x = rng.standard_normal((1, args.columns)).astype(np.float32)
    gemvs = configurations(w, args.block_rows)
    with threadpool_limits(args.threads):
        errors = check_agreement(gemvs, w, x)
        times = measure(gemvs, x, args.rows, args.seconds)

    weights = w.size
    rate = {name: weights / statistics.median(t) for name, t in times.items()}
    base = rate["bf16 bit shift"]
    print(f"W [{args.rows}, {args.columns}], blocks of {args.block_rows} rows, {args.threads} BLAS thread(s), "
          f"{len(times['fp32 (no dequantize)'])} interleaved rounds, median")
    print(f"{'configuration':<24} {'bytes/w':>8} {'G weights/s':>12} {'GB/s read':>10} {'vs bf16 upcast':>15} "
          f"{'rel. RMS err':>13}")
    for name, (bytes_per_weight, _) in gemvs.items():
        print(f"{name:<24} {bytes_per_weight:>8.3f} {rate[name] / 1e9:>12.2f} {rate[name] * bytes_per_weight / 1e9:>10.1f} "
              f"{rate[name] / base:>14.2f}x {errors[name]:>13.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
