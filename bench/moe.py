"""`python -m bench.moe`: Qwen3-30B-A3B beside Qwen3-8B, both Q4_K_M GGUFs kept as stored, in one run: decode
tok/s in interleaved rounds (8B, 30B-A3B, 8B, 30B-A3B, ...) and their ratio within each round, each process's
peak RSS against the memory plan, and in the first 30B-A3B process a 256-token prefill grouped by expert against
the same prompt's MoE blocks run per token.

Checkpoints are bench.gguf_kinds' random GGUFs at the real shapes, written tensor by tensor in llama.cpp's
Q4_K_M mix (gguf_kinds.q4_k_m: Q4_K, Q6_K for the output and for attn_v and ffn_down, ffn_down_exps
included, in use_more_bits' layers; the MoE router F32 as llama.cpp leaves it), each layer's experts
stacked into the 3-D ffn_{gate,up,down}_exps tensors as llama.cpp's converter writes them, each expert's
blocks random (seeded by its own name). Qwen3-30B-A3B's file is 18.6 GB (the hub's Q4_K_M 18.6 GB too),
the 8B's 5.0 GB. A decode step reads and multiplies every weight it reaches whatever its value, and random
routers spread the tokens over the experts as a trained one roughly does, so random weights give the
speed and memory of real ones (not their text).

Each model runs in its own process (gguf_kinds.decode_run: load, an 8-token prompt, greedy steps), one at a
time, after waiting until the memory its plan needs is available (the 30B-A3B's ~19 GiB: this machine has
24 GiB, shared). Prefill (prefill_run): one forward of 256 tokens into a fresh cache (the experts' tokens
grouped: one product per expert and weight), then for SAMPLED_LAYERS sparse layers their MoE block over
256 normed random rows, grouped and one row at a time (what a prompt fed token by token costs there); the
wall and the process's CPU time of each. The load average is recorded before and after every process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .big_models import wait_for_memory
from .gguf_kinds import decode_run, ensure_gguf, run_worker

GiB = 1024 ** 3
SIZES = ("8b", "30b-a3b")          # gguf_kinds.MODELS keys: the baseline first
PREFILL_TOKENS = 256
SAMPLED_LAYERS = 4
MEMORY_MARGIN = int(0.5 * GiB)     # beyond the plan: Python, NumPy, the parsed GGUF metadata


def timed(run: Callable[[], object]) -> tuple[float, float]:
    """(wall s, this process's CPU s, all threads) of run()."""
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    return time.perf_counter() - wall, time.process_time() - cpu


def prefill_run(model: Any, tokens: int, sampled_layers: int) -> dict[str, Any]:
    """A `tokens`-token prompt in one forward (experts grouped), and the MoE block of `sampled_layers` sparse
    layers (spread over the depth) over `tokens` random normed rows, grouped against one row at a time."""
    from qwen_np.engine import fast, moe, runtime

    config = model.config
    prompt = (np.arange(tokens) * 7919 + 1000) % config.vocab_size
    cache = model.new_cache(tokens)
    forward_s, forward_cpu = timed(lambda: model.forward(prompt, cache, last_only=True))
    sparse = [i for i in range(config.num_hidden_layers) if model.layers[i].experts]
    picked = sparse[::max(1, -(-len(sparse) // sampled_layers))][:sampled_layers]
    h = np.random.default_rng(0).standard_normal((tokens, config.hidden_size)).astype(np.float32)   # [T, D]: rms 1
    grouped, per_token = np.empty_like(h), np.empty_like(h)
    blocks = {"grouped": [0.0, 0.0], "per_token": [0.0, 0.0]}

    def block(layer: Any, rows: slice, out: np.ndarray) -> None:
        """The layer's MoE block over h[rows] into out[rows]."""
        moe.sparse_mlp(h[rows], layer.router, layer.experts, config.num_experts_per_tok, config.norm_topk_prob,
                       out[rows], fast.linear)

    with runtime.single_threaded_blas():                      # as forward runs the products
        for layer in (model.layers[i] for i in picked):
            for name, run in (("grouped", lambda: block(layer, slice(None), grouped)),               # noqa: B023
                              ("per_token", lambda: [block(layer, slice(t, t + 1), per_token) for t in range(tokens)])):  # noqa: B023
                wall, cpu = timed(run)
                blocks[name][0] += wall
                blocks[name][1] += cpu
    # The same sums in the same order, but BLAS's blocking differs with the rows a product has.
    difference = float(np.max(np.abs(grouped - per_token)) / np.max(np.abs(per_token)))
    return {"prefill_tokens": tokens, "prefill_forward_s": forward_s, "prefill_forward_cpu_s": forward_cpu,
            "moe_layers": picked, "moe_grouped_s": blocks["grouped"][0], "moe_grouped_cpu_s": blocks["grouped"][1],
            "moe_per_token_s": blocks["per_token"][0], "moe_per_token_cpu_s": blocks["per_token"][1],
            "moe_relative_difference": difference}


def worker(path: str, decode: int, threads: int, prefill: int, sampled_layers: int) -> dict[str, Any]:
    """gguf_kinds.decode_run on the file kept as stored, then prefill_run when `prefill` tokens are asked for.

    load_model refuses a plan over SAFETY_FRACTION (0.85) of the available memory: for the 30B-A3B's 19.3 GiB
    that asks 22.7 GiB available, more than this shared 24 GiB machine ever has. The runner has already waited
    until the plan and MEMORY_MARGIN were available, so the worker lets the plan take all of it."""
    from qwen_np.engine import memory

    memory.SAFETY_FRACTION = 1.0
    model, result = decode_run(path, "stored", decode, threads, max_tokens=prefill)
    return {**result, **(prefill_run(model, prefill, sampled_layers) if prefill else {})}


def plan_bytes(size: str, memory: str, tokens: int) -> int:
    """The memory plan's total for Qwen3-{size} held as `memory` with `tokens` KV positions (before loading),
    computed in a child process: opening a GGUF parses and maps it (the 30B-A3B's ~18,000 expert tensors:
    ~0.6 GiB), which this runner would otherwise keep while the model it waits for memory for loads."""
    done = subprocess.run([sys.executable, "-m", "bench.moe", "--plan", size, memory, str(tokens)], check=True,
                          capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    return int(done.stdout.split()[-1])


def plan_in_this_process(size: str, memory: str, tokens: int) -> int:
    """plan_bytes, in this process (`python -m bench.moe --plan SIZE MEMORY TOKENS` prints it)."""
    from qwen_np.engine.memory import candidate_plans
    from qwen_np.files.model_files import open_checkpoint

    checkpoint = open_checkpoint(ensure_gguf(size, "q4_k_m"))
    return candidate_plans(checkpoint.config, tokens, checkpoint.held_bytes_per_value())[memory].total_bytes


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.moe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=8, help="timed greedy decode steps")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill", type=int, default=PREFILL_TOKENS,
                        help="prompt tokens of the prefill measurement (in the first 30B-A3B process; 0: none)")
    parser.add_argument("--sampled-layers", type=int, default=SAMPLED_LAYERS,
                        help="sparse layers whose MoE block is timed grouped and per token")
    parser.add_argument("--wait-memory", type=float, default=900, help="seconds to wait for the memory a model needs")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        path, decode, threads, prefill, sampled = argv[1:6]
        print(json.dumps(worker(path, int(decode), int(threads), int(prefill), int(sampled))))
        return
    if argv[:1] == ["--plan"]:
        print(plan_in_this_process(argv[1], argv[2], int(argv[3])))
        return
    args = parse_args(argv)
    log = lambda text: print(text, flush=True)                                        # noqa: E731
    paths = {size: ensure_gguf(size, "q4_k_m", log) for size in SIZES}
    int8 = plan_bytes("30b-a3b", "int8", args.tokens + 10)
    log(f"--memory int8 for Qwen3-30B-A3B: the plan needs {int8 / GiB:.1f} GiB (this machine has 24 GiB): not run")
    results: dict[str, list[dict[str, Any]]] = {size: [] for size in SIZES}
    for round_ in range(args.rounds):
        for size in SIZES:
            prefill = args.prefill if size == "30b-a3b" and round_ == 0 else 0
            need = plan_bytes(size, "bf16", max(args.tokens + 10, prefill)) + MEMORY_MARGIN
            if not wait_for_memory(need, args.wait_memory, log):
                log(f"  skip {size} in round {round_ + 1}: {need / GiB:.1f} GiB needed")
                continue
            result = run_worker(["bench.moe", "--worker", str(paths[size]), str(args.tokens), str(args.threads),
                                 str(prefill), str(args.sampled_layers)])
            if result is not None:
                results[size].append({**result, "round": round_})
                log(f"  round {round_ + 1} {size}: {json.dumps(result)}")
    print(f"\n{args.threads} threads, {args.tokens} greedy steps after an 8-token prompt, {args.rounds} rounds\n{HEADER}")
    for size in SIZES:
        if results[size]:
            print(row(size, results[size], results["8b"]))
    first = results["30b-a3b"][0] if results["30b-a3b"] else {}
    if "prefill_tokens" in first:
        print(prefill_lines(first))


HEADER = ("| model (Q4_K_M, kept as stored) | file GB | plan GiB | peak RSS GiB | load s | decode tok/s, each round "
          "| x Qwen3-8B (same round) | CPU s a token | GB read a token | limit tok/s (copy GB/s) | x limit "
          "| load average (before-after) |\n" + "|---" * 12 + "|")


def row(size: str, runs: list[dict[str, Any]], baseline: list[dict[str, Any]]) -> str:
    by_round = {r["round"]: r["decode_tps"] for r in baseline}
    ratios = [r["decode_tps"] / by_round[r["round"]] for r in runs if r["round"] in by_round]
    median = lambda key: statistics.median(r[key] for r in runs)                       # noqa: E731
    loads = ", ".join(f"{r['load_average']:.1f}-{r['load_average_after']:.1f}" for r in runs)
    ratio = f"{statistics.median(ratios):.2f} ({', '.join(f'{x:.2f}' for x in ratios)})" if ratios else "-"
    return (f"| Qwen3-{size.upper()} | {runs[0]['file_gb']:.2f} | {runs[0]['predicted_bytes'] / GiB:.2f} "
            f"| {max(r['peak_rss_bytes'] for r in runs) / GiB:.2f} | {median('load_s'):.0f} "
            f"| {', '.join(format(r['decode_tps'], '.3f') for r in runs)} | {ratio} | {median('decode_cpu_s_per_token'):.2f} "
            f"| {runs[0]['token_bytes'] / 1e9:.2f} | {median('limit_tps'):.2f} ({median('bandwidth_gbs'):.0f}) "
            f"| {median('decode_tps') / median('limit_tps'):.2f} | {loads} |")


def prefill_lines(r: dict[str, Any]) -> str:
    T = r["prefill_tokens"]
    return (f"\nprefill, Qwen3-30B-A3B, {T} tokens in one forward (experts grouped): {r['prefill_forward_s']:.1f} s wall, "
            f"{r['prefill_forward_cpu_s']:.1f} s CPU ({T / r['prefill_forward_s']:.1f} tok/s)\n"
            f"MoE blocks of layers {r['moe_layers']} over {T} rows: grouped {r['moe_grouped_s']:.1f} s wall / "
            f"{r['moe_grouped_cpu_s']:.1f} s CPU, per token {r['moe_per_token_s']:.1f} s / {r['moe_per_token_cpu_s']:.1f} s "
            f"(grouped {r['moe_per_token_s'] / r['moe_grouped_s']:.1f}x faster in wall, "
            f"{r['moe_per_token_cpu_s'] / r['moe_grouped_cpu_s']:.1f}x in CPU; outputs within "
            f"{r['moe_relative_difference']:.1e} of each other)")


if __name__ == "__main__":
    main()
