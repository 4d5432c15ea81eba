"""`python -m bench.gguf_kinds`: the files people have, side by side in one run: decode tok/s and peak RSS
of Qwen3-0.6B shapes as BF16 safetensors (kept as stored) and as GGUFs in Q8_0, Q4_0, Q4_K_M and Q6_K
(kept as stored), and `--memory int8` from the Q4_K_M file; each decode speed also as a ratio to the
BF16 run of the same round.

Checkpoints are random, at the real shapes: the BF16 one is bench/checkpoints.py's; the GGUFs are
written tensor by tensor (gguf_export.write_gguf_tensors), every code byte random and each block's FP16
scales drawn so the weights have a spread like a trained matrix's (DEFAULT_D), norms 1.0. A Q4_K_M file
mixes Q4_K and Q6_K tensors by llama.cpp's rule (llama_tensor_get_type): Q6_K for the output matrix
(Qwen3-0.6B ties it to token_embd, which llama.cpp then treats as the output) and for attn_v and
ffn_down in the layers use_more_bits picks (the first and last eighth, every third between). gguf-py
quantizes none of the K-kinds, and a decode step reads and multiplies every weight whatever its value,
so random blocks decode at the speed real ones do (not their text).

Each configuration runs in its own process (its peak RSS is its own), one at a time, in rounds: every
configuration once per round, in the same order, so a busy spell of this shared machine hits a round's
runs alike; the ratio to BF16 is taken within each round, and the medians over rounds are reported,
with the load average (os.getloadavg, 1 minute) before each run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
from gguf import GGMLQuantizationType as GGML
from gguf import LlamaFileType

from qwen_np.core.config import LAYER_MATRICES, PRESETS, Qwen3Config
from qwen_np.files.gguf_export import Mix

from .checkpoints import FORMAT_VERSION, TOKENIZER, WEIGHT_STD, cache_dir, ensure_checkpoint

GiB = 1024 ** 3
MODELS = {"0.6b": "qwen3-0.6b", "8b": "qwen3-8b", "30b-a3b": "qwen3-30b-a3b"}
# name -> (file, --memory): the BF16 checkpoint, a random GGUF of that type, int8 requantized from the Q4_K_M file.
CONFIGURATIONS = {"bf16": ("bf16", "bf16"), "q8_0": ("q8_0", "stored"), "q4_0": ("q4_0", "stored"),
                  "q4_k_m": ("q4_k_m", "stored"), "q6_k": ("q6_k", "stored"), "int8-from-q4_k_m": ("q4_k_m", "int8")}
PROMPT_TOKENS = 8

# Each block's FP16 scales (d, and dmin where the kind has one) are drawn as U(0.5, 1.5) x this, so that a
# block's weights have a standard deviation near 0.02 (random codes and 6-/8-bit sub-block scales):
# Q4_K's w = d s6 q - dmin m6, s6 ~ 32 and q's spread 4.6 -> 0.02 / (32 x 4.6); Q6_K's s8 rms 74 and
# (q - 32)'s 18.5; ...
DEFAULT_D = {GGML.Q2_K: 2e-3, GGML.Q3_K: 4.7e-4, GGML.Q4_K: 1.4e-4, GGML.Q5_K: 7e-5, GGML.Q6_K: 1.5e-5}
# Byte offsets of the FP16 fields (d, dmin) in each K-kind's block.
FP16_AT = {GGML.Q2_K: (80, 82), GGML.Q3_K: (108,), GGML.Q4_K: (0, 2), GGML.Q5_K: (0, 2), GGML.Q6_K: (208,)}


# --- the files -----------------------------------------------------------------------------------------

def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers (i of n) a _M mix gives more bits: the first and last eighth and
    every third one between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def q4_k_m(config: Qwen3Config) -> Mix:
    """llama.cpp's Q4_K_M (LLAMA_FTYPE_MOSTLY_Q4_K_M) for this model: Q4_K, and Q6_K for the output matrix
    (token_embd where the embedding is tied: llama.cpp treats it as the output then) and for attn_v and
    ffn_down in use_more_bits' layers. A Qwen3-MoE's stacked experts follow the same rule (llama.cpp matches
    "ffn_down" in ffn_down_exps), and its router (ffn_gate_inp) stays F32: llama.cpp never quantizes it."""
    n = config.num_hidden_layers
    output = "token_embd.weight" if config.tie_word_embeddings else "output.weight"

    def matrix_type(name: str) -> GGML:
        parts = name.split(".")
        if name == output:
            return GGML.Q6_K
        if parts[0] == "blk" and parts[2] == "ffn_gate_inp":
            return GGML.F32
        if parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down", "ffn_down_exps") and use_more_bits(int(parts[1]), n):
            return GGML.Q6_K
        return GGML.Q4_K
    return Mix(LlamaFileType.MOSTLY_Q4_K_M, matrix_type)


def file_types(config: Qwen3Config) -> dict[str, str | Mix]:
    """The GGUF files' types: a gguf_export.FILE_TYPES name, or a Mix."""
    return {"q8_0": "q8_0", "q4_0": "q4_0", "q4_k_m": q4_k_m(config),
            "q6_k": Mix(LlamaFileType.MOSTLY_Q6_K, lambda name: GGML.Q6_K)}


def gguf_path(model: str, file_type: str) -> Path:
    return cache_dir() / f"{MODELS[model]}-random-{file_type}-v{FORMAT_VERSION}.gguf"


def random_tensor(hf_name: str, gguf_name: str, shape: tuple[int, ...], kind: GGML) -> np.ndarray:
    """A tensor's data as GGUFWriter takes it (seeded by its Hugging Face name: each expert of a stacked
    qwen3moe tensor its own): norms 1.0; an F32 matrix (a MoE's router) N(0, WEIGHT_STD); Q8_0/Q4_0 as
    bench.big_models writes them; a K-kind's blocks [out, in/256 x bytes] of random bytes with FP16 scales
    U(0.5, 1.5) DEFAULT_D."""
    from .big_models import random_tensor as legacy_tensor

    rng = np.random.default_rng(zlib.crc32(hf_name.encode()))
    if len(shape) == 2 and kind == GGML.F32:
        return (WEIGHT_STD * rng.standard_normal(shape)).astype(np.float32)
    if len(shape) == 1 or kind not in DEFAULT_D:
        return legacy_tensor(hf_name, gguf_name, shape, kind)
    return random_k_blocks(rng, shape, kind).reshape(gguf.quants.quant_shape_to_byte_shape(shape, kind))


def random_k_blocks(rng: np.random.Generator, shape: tuple[int, ...], kind: GGML) -> np.ndarray:
    """uint8 [out, in/256, bytes]: random bytes, the block's FP16 fields U(0.5, 1.5) x DEFAULT_D[kind]."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    data = np.frombuffer(bytearray(rng.bytes(shape[0] * (shape[1] // block) * size)), np.uint8)
    data = data.reshape(shape[0], shape[1] // block, size)
    table = (DEFAULT_D[kind] * rng.uniform(0.5, 1.5, 256)).astype(np.float16)
    for at in FP16_AT[kind]:
        data[..., at:at + 2].view(np.float16)[..., 0] = table[rng.integers(0, 256, size=data.shape[:2], dtype=np.uint8)]
    return data


def ensure_gguf(model: str, file_type: str, log: Callable[[str], None] = print) -> Path:
    """The cached random GGUF of `model` in `file_type`, written tensor by tensor when missing."""
    from qwen_np.core.sampling import SamplingParams
    from qwen_np.files.gguf_export import write_gguf_tensors
    from qwen_np.files.tokenizer import Tokenizer

    path, config = gguf_path(model, file_type), PRESETS[MODELS[model]]
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    log(f"writing {path} ...")
    started = time.perf_counter()
    write_gguf_tensors(path, config, Tokenizer.from_folder(TOKENIZER), SamplingParams(), random_tensor,
                       file_types(config)[file_type], name=f"{MODELS[model]}-random")
    log(f"  written in {time.perf_counter() - started:.0f} s ({path.stat().st_size / 1e9:.2f} GB)")
    return path


# --- the worker: one configuration in its own process -------------------------------------------------

def worker(path: str, memory: str, decode: int, threads: int) -> dict[str, Any]:
    """Load, prefill PROMPT_TOKENS tokens, decode greedily; peak RSS and the plan's total (decode_run)."""
    return decode_run(path, memory, decode, threads)[1]


def decode_run(path: str, memory: str, decode: int, threads: int, max_tokens: int = 0) -> tuple[Any, dict[str, Any]]:
    """The model (for more measurements in the same process: bench.moe's prefill) and what its load, a
    PROMPT_TOKENS prefill and `decode` greedy steps measured: wall and CPU time, peak RSS against the plan,
    the bytes a token reads and the copy-bandwidth limit. max_tokens: the plan's KV positions, if more."""
    import qwen_np
    from qwen_np.engine import runtime

    from qwen_np.inspection.bandwidth import measure_bandwidth

    from .big_models import current_rss_bytes
    from .worker import read_into_page_cache

    runtime.set_threads(threads)
    files = [Path(path)] if path.endswith(".gguf") else sorted(Path(path).glob("*.safetensors"))
    read_into_page_cache(files)
    baseline = current_rss_bytes()
    started = time.perf_counter()
    model = qwen_np.load_model(path, memory=memory, max_tokens=max(PROMPT_TOKENS + decode + 1, max_tokens))
    load_s = time.perf_counter() - started
    cache = model.new_cache(PROMPT_TOKENS + decode + 1)
    prompt = (np.arange(PROMPT_TOKENS) * 7919 + 1000) % model.config.vocab_size
    started = time.perf_counter()
    token = int(model.forward(prompt, cache, last_only=True)[-1].argmax())
    prefill_s = time.perf_counter() - started
    token = int(model.forward([token], cache)[-1].argmax())          # one untimed step: buffers, pages
    steps, cpu = [], time.process_time()
    for _ in range(decode):
        started = time.perf_counter()
        token = int(model.forward([token], cache)[-1].argmax())
        steps.append(time.perf_counter() - started)
    cpu = time.process_time() - cpu
    peak = high_water_rss_bytes()                    # before the bandwidth probe's arrays add to it
    read = per_token_bytes(model)
    bandwidth = measure_bandwidth(threads=threads)
    return model, {"file_gb": sum(f.stat().st_size for f in files) / 1e9, "mode": model.plan.mode, "load_s": load_s,
                   "prefill_s": prefill_s, "decode_tps": len(steps) / sum(steps), "median_step_s": float(np.median(steps)),
                   "decode_cpu_s_per_token": cpu / decode, "peak_rss_bytes": peak, "baseline_rss_bytes": baseline,
                   "predicted_bytes": model.plan.total_bytes, "token_bytes": read, "bandwidth_gbs": bandwidth / 1e9,
                   "limit_tps": bandwidth / read}


def per_token_bytes(model: Any) -> int:
    """Bytes of the weights a decode step reads as held: every layer's matrices, of a sparse layer's experts
    the K a token is routed to (K times their mean size, and the router), and the LM head (of the embedding
    table only a row)."""
    total = int(model.lm_head.nbytes)
    for layer in model.layers:
        total += sum(int(m.nbytes) for m in (getattr(layer, name) for name in LAYER_MATRICES) if m is not None)
        if layer.experts:
            experts = sum(int(m.nbytes) for expert in layer.experts for m in expert)
            total += int(layer.router.nbytes) + model.config.num_experts_per_tok * experts // len(layer.experts)
    return total


def high_water_rss_bytes() -> int:
    """This process's peak RSS since it started (VmHWM). Not ru_maxrss: on Linux that survives fork and exec,
    so a worker would report at least its parent's resident memory at the fork."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


# --- the runner ----------------------------------------------------------------------------------------

def checkpoint(model: str, file: str, log: Callable[[str], None]) -> Path:
    return ensure_checkpoint(model, log) if file == "bf16" else ensure_gguf(model, file, log)


def run_one(path: Path, memory: str, args: argparse.Namespace) -> dict[str, Any] | None:
    return run_worker(["bench.gguf_kinds", "--worker", str(path), memory, str(args.tokens), str(args.threads)])


def run_worker(module_args: list[str]) -> dict[str, Any] | None:
    """`python -m <module_args>` in its own process: the JSON line it prints, with the 1-minute load average
    before it started (load_average) and as it ended (load_average_after); None (said why) if it failed."""
    load = os.getloadavg()[0]
    done = subprocess.run([sys.executable, "-m", *module_args], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1])
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        print(f"  FAILED ({done.returncode}): {done.stderr.strip().splitlines()[-3:]}", flush=True)
        return None
    return {**json.loads(lines[-1]), "load_average": load, "load_average_after": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        path, memory, decode, threads = argv[1:5]
        print(json.dumps(worker(path, memory, int(decode), int(threads))))
        return
    parser = argparse.ArgumentParser(prog="python -m bench.gguf_kinds", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=list(MODELS), default="0.6b")
    parser.add_argument("--runs", nargs="+", choices=list(CONFIGURATIONS), default=list(CONFIGURATIONS),
                        help="configurations (default all; bf16 first: the ratios are to it)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16, help="timed greedy decode steps")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    log = lambda text: print(text, flush=True)                                        # noqa: E731
    paths = {name: checkpoint(args.model, CONFIGURATIONS[name][0], log) for name in args.runs}
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in args.runs}
    for round_ in range(args.rounds):
        for name in args.runs:
            result = run_one(paths[name], CONFIGURATIONS[name][1], args)
            if result is not None:
                results[name].append({**result, "round": round_})
                log(f"  round {round_ + 1} {name}: {result['decode_tps']:.2f} tok/s, peak RSS "
                    f"{result['peak_rss_bytes'] / GiB:.2f} GiB, load average {result['load_average']:.2f}")
    print(f"\nQwen3-{args.model.upper()} shapes, {args.threads} threads, {args.tokens} greedy steps, "
          f"{args.rounds} rounds (medians)\n{HEADER}")
    for name in args.runs:
        if results[name]:
            print(row(name, results[name], results.get("bf16", [])))


HEADER = ("| file | --memory | file GB | plan GiB | peak RSS GiB | load s | decode tok/s | x BF16 (same round) "
          "| GB read a token | limit tok/s (copy GB/s) | x limit | load average |\n" + "|---" * 12 + "|")


def row(name: str, runs: list[dict[str, Any]], bf16: list[dict[str, Any]]) -> str:
    by_round = {r["round"]: r["decode_tps"] for r in bf16}
    ratios = [r["decode_tps"] / by_round[r["round"]] for r in runs if r["round"] in by_round]
    median = lambda key: statistics.median(r[key] for r in runs)                       # noqa: E731
    loads = [r["load_average"] for r in runs]
    ratio = f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else "-"
    return (f"| {CONFIGURATIONS[name][0]} | {CONFIGURATIONS[name][1]} | {runs[0]['file_gb']:.2f} "
            f"| {runs[0]['predicted_bytes'] / GiB:.2f} | {median('peak_rss_bytes') / GiB:.2f} | {median('load_s'):.1f} "
            f"| {median('decode_tps'):.2f} | {ratio} | {runs[0]['token_bytes'] / 1e9:.2f} "
            f"| {median('limit_tps'):.2f} ({median('bandwidth_gbs'):.0f}) | {median('decode_tps') / median('limit_tps'):.2f} "
            f"| {min(loads):.1f}-{max(loads):.1f} |")


if __name__ == "__main__":
    main()
