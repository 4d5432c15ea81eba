"""`python -m bench.int8_limit`: `--memory int8` decode against NumPy's own limit for int8 rows.

NumPy cannot multiply int8 by FP32 in BLAS: every int8 weight must be cast to FP32 on its way to a GEMV.
The limit is the cheapest way NumPy has to do that and nothing else: a bare loop over the model's own int8
matrices (the same rows, where load_model put them) that casts a tile of rows into a cache-resident FP32
buffer (np.copyto, one call), multiplies it by the token (np.matmul, one GEMV) and scales those outputs
(one multiply), the rows split between runtime.threads() threads as the fast path splits them. The best
of several tile sizes counts. Beside it, in the same process and interleaved: one decode token over the
KV cache (model.forward, `--context` cached positions), and the fast path's products alone (every weight
through fast.linear, back to back, as bench.worker.weight_stream_seconds). `x limit` is the limit's time
over each one's: 1.0 means it costs nothing but the cast and the GEMV.

`--clock cpu` times this thread's CPU (with --threads 1: a busy machine's time slices do not count).
`8b` is Qwen3-8B's shapes with `--layers` decoder layers (bench.checkpoints, default 4).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import numpy as np

from bench.checkpoints import ensure_checkpoint

TILE_BYTES = tuple(k * 1024 ** 2 for k in (1, 2, 4, 8, 16))     # FP32 bytes a tile, tried for the limit


def int8_matrices(model: Any) -> list[Any]:
    """Every matrix a decode token reads (numerics.Int8Rows in --memory int8), the LM head last."""
    from qwen_np.numbers.numerics import Int8Rows

    found = [w for layer in model.layers for w in vars(layer).values() if isinstance(w, Int8Rows)]
    return found + [model.lm_head] if isinstance(model.lm_head, Int8Rows) else found


def bare_pass(matrices: list[Any], tile_bytes: int) -> Callable[[], None]:
    """One token through every matrix by the bare loop: cast a tile, one GEMV, scale its outputs."""
    from qwen_np.engine import runtime
    from qwen_np.numbers.numerics import scratch

    inputs = {n: np.ones(n, np.float32) for n in {w.shape[1] for w in matrices}}
    outputs = [np.empty(w.shape[0], np.float32) for w in matrices]

    def rows_of(w: Any, y: np.ndarray, part: slice) -> None:
        x, step = inputs[w.shape[1]], max(1, tile_bytes // (4 * w.shape[1]))
        buffer = scratch("bench.int8_tile", (step * w.shape[1],))
        for start in range(part.start, part.stop, step):
            stop = min(start + step, part.stop)
            tile = buffer[:(stop - start) * w.shape[1]].reshape(stop - start, w.shape[1])
            np.copyto(tile, w.codes[start:stop], casting="unsafe")
            np.matmul(tile, x, out=y[start:stop])
        y[part] *= w.scale[part]

    def run() -> None:
        for w, y in zip(matrices, outputs):
            runtime.split(w.shape[0], runtime.threads(), lambda part, w=w, y=y: rows_of(w, y, part))
    return run


def linear_pass(matrices: list[Any]) -> Callable[[], None]:
    """One token through every matrix by the fast path's own product (fast.linear), back to back."""
    from qwen_np.engine import fast

    inputs = {n: np.ones((1, n), np.float32) for n in {w.shape[1] for w in matrices}}
    outputs = [np.empty((1, w.shape[0]), np.float32) for w in matrices]

    def run() -> None:
        for w, y in zip(matrices, outputs):
            fast.linear(inputs[w.shape[1]], w, y)
    return run


def timed(run: Callable[[], object], clock: Callable[[], float], calls: int) -> float:
    run()                                                 # warm: page faults, scratch buffers, threads
    times = []
    for _ in range(calls):
        start = clock()
        run()
        times.append(clock() - start)
    return statistics.median(times)


def measure(model_name: str, layers: int | None, context: int, calls: int, rounds: int, clock_name: str) -> None:
    import qwen_np
    from qwen_np.engine import runtime

    folder = ensure_checkpoint(model_name, layers=layers)
    model = qwen_np.load_model(folder, memory="int8", max_tokens=context + rounds * calls * 4 + 16)
    clock = time.thread_time if clock_name == "cpu" else time.perf_counter
    cache = model.new_cache(model.plan.max_tokens if hasattr(model.plan, "max_tokens") else context + 1024)
    prompt = (np.arange(context) * 7919 + 1000) % model.config.vocab_size
    token = [int(model.forward(prompt, cache, last_only=True)[-1].argmax())]
    matrices = int8_matrices(model)
    codes = sum(w.codes.nbytes for w in matrices)

    def decode() -> None:
        token[0] = int(model.forward(token, cache)[-1].argmax())

    rows: dict[str, list[float]] = {"decode": [], "fast.linear alone": [], **{f"bare, {t // 1024 ** 2} MiB tiles": []
                                                                                  for t in TILE_BYTES}}
    with runtime.steady_threads():
        for _ in range(rounds):
            rows["decode"].append(timed(decode, clock, calls))
            with runtime.single_threaded_blas():
                rows["fast.linear alone"].append(timed(linear_pass(matrices), clock, calls))
                for t in TILE_BYTES:
                    rows[f"bare, {t // 1024 ** 2} MiB tiles"].append(timed(bare_pass(matrices, t), clock, calls))
    limit = min(min(v) for k, v in rows.items() if k.startswith("bare"))
    print(f"\n{model_name}{'' if layers is None else f' ({layers} layers)'}, --memory int8, {runtime.threads()} threads, "
          f"{clock_name} clock, {context} cached positions, {codes / 1e9:.2f} GB of int8 codes a token; "
          f"BLAS: {runtime.blas_info()[0].get('architecture', '?')}\n")
    print("| per token | ms (best round) | GB/s of codes | x limit |\n|---|---:|---:|---:|")
    for name, values in rows.items():
        best = min(values)
        print(f"| {name} | {best * 1e3:.1f} | {codes / best / 1e9:.1f} | {limit / best:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["0.6b"], choices=["0.6b", "8b"])
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the 8b checkpoint")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--calls", type=int, default=5, help="timed calls per round (median)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (best)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = parser.parse_args()
    from qwen_np.engine import runtime

    if args.threads:
        runtime.set_threads(args.threads)
    for name in args.models:
        measure(name, args.layers if name == "8b" else None, args.context, args.calls, args.rounds, args.clock)


if __name__ == "__main__":
    main()
