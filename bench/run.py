"""`python -m bench`: qwen_np against the memory-bandwidth and GEMM limits of this machine, and against
transformers (and llama.cpp) where installed. See bench/README.md for what every number means.

Every configuration runs in its own process (bench/worker.py), so peak RSS and the measured limits
belong to that run alone. Processes run one at a time (never two 8B models in RAM), interleaved:
repeat 1 of every configuration, then repeat 2, ... so slow drifts of the machine hit all alike.
Each configuration runs with the environment's OpenBLAS settings and with OPENBLAS_CORETYPE and
OPENBLAS_L2_SIZE removed (this machine sets CORETYPE=Haswell, which slows GEMM about 1.5x).
"""

from __future__ import annotations

import argparse
import math
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qwen_np.core.config import PRESETS, Qwen3Config, parameter_count
from qwen_np.inspection import weight_bytes_read_per_token
from qwen_np.engine.memory import available_memory

from .checkpoints import MODELS, ensure_checkpoint, ensure_gguf

GiB = 1024 ** 3
BYTES_PER_VALUE = {"fp32": 4, "bf16": 2, "int8": 1}     # weights read per token (int8's row scales: < 0.4% more)
OPENBLAS_VARS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
# tok/s of the other engines measured once on this machine (2 threads, random weights; bench/README.md).
ANCHORS: dict[tuple[str, str, str], dict[str, float]] = {
    ("0.6b", "decode", "fp32"): {"transformers": 8.0, "llama.cpp": 24.3},
    ("0.6b", "decode", "bf16"): {"transformers": 15.0, "llama.cpp": 37.4},
    ("0.6b", "prefill", "fp32"): {"transformers": 141, "llama.cpp": 248},
    ("0.6b", "prefill", "bf16"): {"transformers": 626, "llama.cpp": 513},
    ("8b", "decode", "bf16"): {"transformers": 1.85, "llama.cpp": 4.5},
}


@dataclass(frozen=True)
class Job:
    model: str        # "0.6b" | "8b"
    engine: str       # "qwen_np" (fast path) | "qwen_np_plain" (readable path) | "transformers" | "llama.cpp"
    mode: str         # "fp32" | "bf16" | "int8": weights resident in FP32, kept BF16 and upcast per use, or int8 rows
    blas_env: str     # "as set" | "unset"

    @property
    def label(self) -> str:
        return f"{self.model} {self.engine} {self.mode} [{self.blas_env}]"


def jobs_for(args: argparse.Namespace, folders: dict[str, Path]) -> list[Job]:
    envs = ["as set", "unset"] if args.openblas == "both" else [args.openblas]
    have_torch = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None
    jobs = []
    for model in args.models:
        if model == "0.6b":
            engines = [("qwen_np", "fp32"), ("qwen_np", "bf16"), ("qwen_np", "int8")]
            if not args.quick:
                engines.append(("qwen_np_plain", "fp32"))
            if have_torch and args.transformers:
                engines += [("transformers", "fp32"), ("transformers", "bf16")]
        else:  # 8B: 30.5 GiB in FP32 cannot be held in 24 GiB; BF16 and int8 residency run
            engines = [("qwen_np", "bf16"), ("qwen_np", "int8")]
            if have_torch and args.transformers:
                engines.append(("transformers", "bf16"))
        jobs += [Job(model, engine, mode, env) for engine, mode in engines for env in envs]
        # llama.cpp does not use OpenBLAS: one environment is enough.
        jobs += [Job(model, "llama.cpp", mode, envs[0]) for mode in ("fp32", "bf16")
                 if (model == "0.6b" or mode == "bf16") and llama_cpp_gguf(folders[model], mode, args)]
    return jobs


def llama_cpp_gguf(folder: Path, mode: str, args: argparse.Namespace) -> Path | None:
    """The GGUF llama.cpp runs for this checkpoint and precision, when llama-cpp-python is installed."""
    if not args.llama_cpp or importlib.util.find_spec("llama_cpp") is None:
        return None
    gguf = ensure_gguf(folder, mode, args.llama_convert)
    if gguf is None:
        print(f"  llama.cpp skipped for {folder.name} {mode}: no GGUF; give --llama-convert "
              "PATH/convert_hf_to_gguf.py (llama.cpp's converter) to make one")
    return gguf


def busy_cpu_seconds() -> float:
    """CPU seconds all processes have used since boot (every core summed), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]                                 # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def wait_for_quiet(max_wait: float) -> None:
    """Wait (up to max_wait s) until other processes use under a fifth of a core: on 2 cores any
    neighbour steals bandwidth and time slices from the run."""
    deadline = time.monotonic() + max_wait
    while True:
        before = busy_cpu_seconds()
        time.sleep(1.0)
        others = busy_cpu_seconds() - before
        if others < 0.2 or time.monotonic() > deadline:
            if others >= 0.2:
                print(f"  (machine still busy after {max_wait:.0f} s: {others:.1f} cores in use; running anyway)")
            return


def run_job(job: Job, folder: Path, args: argparse.Namespace) -> dict[str, Any] | None:
    env = dict(os.environ)
    if job.blas_env == "unset":
        for name in OPENBLAS_VARS:
            env.pop(name, None)
    config = PRESETS[MODELS[job.model]]
    need = BYTES_PER_VALUE[job.mode] * parameter_count(config) + 2 * GiB
    if job.model == "8b" and available_memory() < need:
        print(f"  skip {job.label}: needs ~{need / GiB:.1f} GiB, {available_memory() / GiB:.1f} GiB available")
        return None
    command = [sys.executable, "-m", "bench.worker", job.engine, str(folder), job.mode,
               str(args.prefill), str(args.decode), str(args.threads)]
    wait_for_quiet(args.wait_quiet)
    busy, ours, start = busy_cpu_seconds(), children_cpu_seconds(), time.monotonic()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout,
                              cwd=Path(__file__).resolve().parents[1])
    except subprocess.TimeoutExpired:
        print(f"  FAILED {job.label}: still running after --timeout {args.timeout} s")
        return None
    others = (busy_cpu_seconds() - busy - (children_cpu_seconds() - ours)) / (time.monotonic() - start)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        print(f"  FAILED {job.label} (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
        return None
    result = json.loads(lines[-1])
    result["others_cores"] = max(others, 0.0)
    result.update(derived(job, config, result, args))
    streams = (f"own weights stream at {stream_gbs(job, config, result):.0f} GB/s, test matrix "
               f"{result['read_gbs']:.0f} GB/s, " if "stream_s" in result else "")
    print(f"  {job.label}: prefill {result['prefill_tps']:.1f} tok/s (x{result['prefill_ratio']:.2f} of limit, "
          f"GEMM efficiency {result['gemm_efficiency']:.2f}), "
          f"decode {result['decode_tps']:.2f} tok/s (x{result['decode_ratio']:.2f}), "
          f"peak RSS {result['peak_rss_bytes'] / GiB:.2f} GiB, load {result['load_s']:.2f} s, {streams}{kld_text(result)}"
          f"other processes {result['others_cores']:.2f} cores", flush=True)
    return result


def kld_text(r: dict[str, Any]) -> str:
    """int8 runs: how far its logits are from the checkpoint's own weights (worker.kld_against_stored)."""
    if "kld_mean" not in r:
        return ""
    return f"KLD vs stored weights {r['kld_mean']:.2e} (same top {r['same_top_percent']:.1f}%), "


def stream_gbs(job: Job, config: Qwen3Config, r: dict[str, Any]) -> float:
    """GB/s at which one token's matrix products read the model's own weights (worker.weight_stream_seconds)."""
    return weight_bytes_read_per_token(config, BYTES_PER_VALUE[job.mode]) / r["stream_s"] / 1e9


def derived(job: Job, config: Qwen3Config, r: dict[str, Any], args: argparse.Namespace) -> dict[str, float]:
    """tok/s and the limits of the same process: bytes per token over bandwidth, FLOPs over GEMM rate."""
    values = weight_bytes_read_per_token(config, 1)
    bytes_per_value = BYTES_PER_VALUE[job.mode]
    bandwidth_limit = r["read_gbs"] * 1e9 / (values * bytes_per_value)
    # NumPy has no BF16 or int8 product: qwen_np must cast those weights to FP32 as they stream by, so
    # the fused cast+GEMV rate is its ceiling. torch and llama.cpp multiply BF16 directly: bandwidth is theirs.
    cast_rate = {"bf16": r["fused_gbs"] / 2, "int8": r.get("int8_fused_gbs", math.inf)}.get(job.mode, math.inf)
    if job.engine.startswith("qwen_np"):
        decode_limit = min(bandwidth_limit, cast_rate * 1e9 / values)     # weights per second / weights per token
    else:
        decode_limit = bandwidth_limit
    # Never below the rate the model's own weights stream at (placement in memory changes bandwidth).
    decode_limit = max(decode_limit, 1 / r["stream_s"]) if "stream_s" in r else decode_limit
    # The prefill limit: every weight does 2 FLOPs for every prompt token. A prefill for
    # generation needs the LM head for the last token only, so the FLOPs actually done are fewer;
    # gemm_efficiency is those FLOPs per second over the GEMM rate.
    prefill_limit = r["gemm_gflops"] * 1e9 / (2 * values)
    head = config.vocab_size * config.hidden_size
    flops_done = 2 * (args.prefill * (values - head) + head)
    prefill_tps, decode_tps = args.prefill / r["prefill_s"], args.decode / r["decode_s"]
    return {"prefill_tps": prefill_tps, "decode_tps": decode_tps, "decode_limit": decode_limit,
            "bandwidth_limit": bandwidth_limit, "prefill_limit": prefill_limit,
            "decode_ratio": decode_tps / decode_limit, "prefill_ratio": prefill_tps / prefill_limit,
            "gemm_efficiency": flops_done / r["prefill_s"] / (r["gemm_gflops"] * 1e9)}


def same_run_rows(results: dict[Job, list[dict[str, Any]]], job: Job, engine: str) -> list[dict[str, Any]] | None:
    """This run's results of another `engine` for the same model and precision, to compare `job` with
    (the same OpenBLAS environment; llama.cpp runs in one environment only)."""
    if engine == job.engine:
        return None
    for other, rows in results.items():
        same = (other.model, other.engine, other.mode) == (job.model, engine, job.mode)
        if rows and same and (other.blas_env == job.blas_env or engine == "llama.cpp"):
            return rows
    return None


def summarize(results: dict[Job, list[dict[str, Any]]], args: argparse.Namespace) -> str:
    """A markdown table: medians over repeats (each ratio taken within its own process first)."""
    def med(rows: list[dict[str, Any]], key: str) -> float:
        return statistics.median(row[key] for row in rows)

    header = ("| model | engine | weights | OpenBLAS env | BLAS kernel | prefill tok/s | x GEMM limit | GEMM efficiency | "
              "decode tok/s | x limit | x bandwidth | vs issue anchors | vs the others, this run | "
              "load s | peak RSS GiB | KLD vs stored |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for job, rows in results.items():
        if not rows:
            continue
        blas = rows[0]["blas"][0] if rows[0]["blas"] else {}
        kernel = f"{blas.get('internal_api')} {blas.get('architecture')} x{blas.get('num_threads')}"
        if job.engine == "transformers":
            kernel = f"torch ({kernel} loaded)"
        elif job.engine == "llama.cpp":
            kernel = f"ggml's own ({rows[0].get('gguf')})"
        decode = med(rows, "decode_tps")
        anchor_text = "; ".join(
            f"{phase} " + ", ".join(f"{med(rows, phase + '_tps') / v:.2f}x {k}" for k, v in anchors.items())
            for phase in ("prefill", "decode") if (anchors := ANCHORS.get((job.model, phase, job.mode)))) or "-"
        versus = "; ".join(
            f"prefill {med(rows, 'prefill_tps') / med(ref, 'prefill_tps'):.2f}x, "
            f"decode {decode / med(ref, 'decode_tps'):.2f}x {engine}"
            for engine in ("transformers", "llama.cpp") if (ref := same_run_rows(results, job, engine))) or "-"
        if job.mode == "int8":   # the int8 goals: decode against qwen_np's own bf16 mode and transformers BF16
            versus = "; ".join([f"decode {decode / med(ref, 'decode_tps'):.2f}x {other.engine} bf16"
                                for other, ref in results.items() if ref and other.model == job.model
                                and other.mode == "bf16" and other.engine in ("qwen_np", "transformers")
                                and other.blas_env == job.blas_env])  or "-"
        lines.append(
            f"| {job.model} | {job.engine} | {job.mode} | {job.blas_env} | {kernel} | "
            f"{med(rows, 'prefill_tps'):.1f} | {med(rows, 'prefill_ratio'):.2f} | {med(rows, 'gemm_efficiency'):.2f} | "
            f"{decode:.2f} | "
            f"{med(rows, 'decode_ratio'):.2f} | {decode / med(rows, 'bandwidth_limit'):.2f} | {anchor_text} | "
            f"{versus} | {med(rows, 'load_s'):.2f} | {max(r['peak_rss_bytes'] for r in rows) / GiB:.2f} | "
            f"{kld_text(rows[0]).rstrip(', ') or '-'} |")
    limits = []
    for job, rows in results.items():
        if rows and job.engine == "qwen_np":
            int8 = f", int8 cast+GEMV {med(rows, 'int8_fused_gbs'):.1f} GB/s" if "int8_fused_gbs" in rows[0] else ""
            limits.append(f"{job.label}: read {med(rows, 'read_gbs'):.1f} GB/s, GEMM {med(rows, 'gemm_gflops'):.0f} "
                          f"GFLOP/s, BF16 upcast+GEMV {med(rows, 'fused_gbs'):.1f} GB/s{int8} -> decode limit "
                          f"{med(rows, 'decode_limit'):.2f} tok/s, prefill limit {med(rows, 'prefill_limit'):.0f} tok/s "
                          f"(other processes used {max(r['others_cores'] for r in rows):.2f} cores at most)")
    return "\n".join(lines + ["", "Limits measured in the same processes (medians):", *limits])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="0.6b,8b", help="comma-separated: 0.6b, 8b (default both)")
    parser.add_argument("--repeats", type=int, default=3, help="processes per configuration, interleaved (default 3)")
    parser.add_argument("--prefill", type=int, default=128, help="prompt tokens (default 128)")
    parser.add_argument("--decode", type=int, default=64, help="generated tokens (default 64)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads (default: all cores)")
    parser.add_argument("--openblas", choices=("both", "as set", "unset"), default="both",
                        help="run with the environment's OPENBLAS_CORETYPE/L2_SIZE, without them, or both")
    parser.add_argument("--no-transformers", dest="transformers", action="store_false",
                        help="skip the transformers comparison even when torch is installed")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 0.6B only, 1 repeat, 32+16 tokens, no readable-path run")
    parser.add_argument("--no-llama-cpp", dest="llama_cpp", action="store_false",
                        help="skip llama.cpp even when llama-cpp-python is installed")
    parser.add_argument("--llama-convert", type=Path, default=os.environ.get("QWEN_NP_LLAMA_CONVERT") or None,
                        metavar="PATH", help="llama.cpp's convert_hf_to_gguf.py, to make the GGUF copies llama.cpp "
                        "runs (default $QWEN_NP_LLAMA_CONVERT; made once, cached next to the checkpoints)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per process")
    parser.add_argument("--wait-quiet", type=float, default=120, metavar="S",
                        help="before each process, wait up to S seconds for other processes to go idle")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.repeats, args.prefill, args.decode = "0.6b", 1, 32, 16
    args.models = [m.strip().lower() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {unknown}; known: {', '.join(MODELS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    folders = {model: ensure_checkpoint(model) for model in args.models}
    if importlib.util.find_spec("llama_cpp") is None:
        print("llama-cpp-python is not installed: llama.cpp is compared through the issue's anchors only")
    jobs = jobs_for(args, folders)
    print(f"{len(jobs)} configurations x {args.repeats} repeats, prefill {args.prefill}, decode {args.decode}, "
          f"{args.threads} threads; OpenBLAS env here: "
          + ", ".join(f"{name}={os.environ.get(name, '(unset)')}" for name in OPENBLAS_VARS))
    results: dict[Job, list[dict[str, Any]]] = {job: [] for job in jobs}
    for repeat in range(args.repeats):
        print(f"repeat {repeat + 1}/{args.repeats}", flush=True)
        for job in jobs:
            result = run_job(job, folders[job.model], args)
            if result is not None:
                results[job].append(result)
    print()
    print(f"command: python -m bench {' '.join(sys.argv[1:]) if argv is None else ' '.join(argv)}")
    print(summarize(results, args))
