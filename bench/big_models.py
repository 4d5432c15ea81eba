"""`python -m bench.big_models`: Qwen3-8B, 14B and 32B in Q4_0 (and 8B in Q8_0, BF16 and int8) on this
24 GiB machine: peak RSS against the memory plan's prediction, load time, decode tok/s, and decode over
the weight kind's own limit measured in the same process.

Checkpoints are random GGUF files at the real shapes, written directly in Q4_0 / Q8_0 one tensor at a
time (gguf_export.write_gguf_tensors): every code byte random (each 4-bit or 8-bit code equally likely)
and each block's FP16 scale drawn so the weights have a standard deviation near 0.02, like a trained
model's projections; norms 1.0. A decode step reads and widens every weight whatever its value, so
random weights give the speed and memory of real ones (not their text). No BF16 copy is ever made:
Qwen3-32B in BF16 is 65.5 GB, more than this disk holds. The 8B BF16 / int8 rows use the BF16
safetensors checkpoint of bench/checkpoints.py (16.4 GB).

Each configuration runs in its own process, one at a time, under `nice -n 5`, after waiting until the
memory it needs is available (other processes share this machine). The process first measures its
limit: one layer's matrices at the model's shapes, in the same weight kind (random Q4_0/Q8_0 blocks laid
out as in the file, BF16 values or int8 rows), through qwen_np.engine.fast.linear back to back; the limit is
the tok/s if every weight a token reads went through that product once (measured before loading and
again after decoding; the faster kept). In between it reads the files into the page cache, loads the
model (timed), prefills a short prompt and decodes greedily; peak RSS is taken before the second
limit measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as GGML

from qwen_np.core.config import LAYER_MATRICES, PRESETS, Qwen3Config, expected_tensors
from qwen_np.engine.memory import available_memory, weight_bytes

from .checkpoints import FORMAT_VERSION, TOKENIZER, WEIGHT_STD, cache_dir, checkpoint_folder, ensure_checkpoint
from .run import busy_cpu_seconds, children_cpu_seconds, wait_for_quiet

GiB = 1024 ** 3
SIZES = {"8b": "qwen3-8b", "14b": "qwen3-14b", "32b": "qwen3-32b"}
BLOCK_TYPES = {"q4_0": GGML.Q4_0, "q8_0": GGML.Q8_0}
STORED_MODES = ("bf16", "int8")          # modes of the BF16 safetensors checkpoint (8B only)
DEFAULT_RUNS = ("8b-bf16", "8b-int8", "8b-q8_0", "8b-q4_0", "14b-q4_0", "32b-q4_0")
# Metadata (the tokenizer: ~150k tokens and merges) and alignment padding a GGUF adds to its tensors' bytes.
GGUF_OVERHEAD_MAX = 64 * 2 ** 20
PROMPT_TOKENS = 8
MEMORY_MARGIN = int(1.5 * GiB)           # beyond the plan: Python, NumPy, the parsed GGUF metadata


@dataclass(frozen=True)
class Run:
    size: str          # "8b" | "14b" | "32b"
    weights: str       # "q4_0" | "q8_0" (a GGUF of that type) | "bf16" | "int8" (modes of the BF16 checkpoint)

    @property
    def label(self) -> str:
        return f"{self.size}-{self.weights}"

    @property
    def config(self) -> Qwen3Config:
        return PRESETS[SIZES[self.size]]


# --- random GGUF checkpoints -------------------------------------------------------------------------

def gguf_checkpoint_path(size: str, file_type: str) -> Path:
    return cache_dir() / f"{SIZES[size]}-random-{file_type}-v{FORMAT_VERSION}.gguf"


def complete(path: Path, config: Qwen3Config, file_type: str) -> bool:
    """Whether a cached GGUF holds every tensor's bytes (a file of the wrong size is written again)."""
    tensors = weight_bytes(config, file_type)         # every matrix in file_type, norms F32: the file's tensor bytes
    return path.is_file() and tensors <= path.stat().st_size <= tensors + GGUF_OVERHEAD_MAX


def ensure_random_gguf(size: str, file_type: str, log: Callable[[str], None] = print) -> Path:
    """The cached random GGUF of Qwen3-{size} in file_type, written tensor by tensor when missing."""
    from qwen_np.files.gguf_export import write_gguf_tensors
    from qwen_np.core.sampling import SamplingParams
    from qwen_np.files.tokenizer import Tokenizer

    path, config = gguf_checkpoint_path(size, file_type), PRESETS[SIZES[size]]
    if complete(path, config, file_type):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    log(f"writing {path} ({weight_bytes(config, file_type) / 1e9:.1f} GB of random {file_type} blocks) ...")
    started = time.perf_counter()
    write_gguf_tensors(path, config, Tokenizer.from_folder(TOKENIZER), SamplingParams(), random_tensor, file_type,
                       name=f"{SIZES[size]}-random")
    log(f"  written in {time.perf_counter() - started:.0f} s")
    return path


def random_tensor(hf_name: str, gguf_name: str, shape: tuple[int, ...], kind: GGML) -> np.ndarray:
    """A tensor's data as GGUFWriter takes it: norms (1-D, F32) 1.0; a matrix in Q4_0/Q8_0 as ggml's
    blocks, [out, in/32 x block bytes], of random codes and random FP16 scales (seeded by its name)."""
    if len(shape) == 1:
        return np.ones(shape, np.float32)
    rng = np.random.default_rng(zlib.crc32(gguf_name.encode()))
    return random_blocks(rng, shape, kind).reshape(gguf.quants.quant_shape_to_byte_shape(shape, kind))


def random_blocks(rng: np.random.Generator, shape: tuple[int, ...], kind: GGML) -> np.ndarray:
    """ggml blocks of a random [out, in] matrix: uint8 [out, in/32, 2 + code bytes], each block's first two
    bytes its FP16 scale (one of 256 drawn values), the rest random code bytes."""
    block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    rows, blocks = shape[0], shape[1] // block
    data = np.frombuffer(bytearray(rng.bytes(rows * blocks * block_bytes)), np.uint8).reshape(rows, blocks, block_bytes)
    scales = data[..., :2].view(np.float16)[..., 0]                  # [out, in/32], a strided view
    scales[...] = scale_table(kind)[rng.integers(0, 256, size=scales.shape, dtype=np.uint8)]
    return data


def scale_table(kind: GGML) -> np.ndarray:
    """256 FP16 block scales: |d| = WEIGHT_STD / rms(code value) x U(0.5, 1.5), so that weights have a
    std near WEIGHT_STD. Q4_0's code values (code - 8, in -8..7: rms 4.64) take either sign, as
    llama.cpp's d = max / -8 does; Q8_0's (int8: rms 73.9) scale is amax / 127 >= 0."""
    values = np.arange(-8, 8) if kind == GGML.Q4_0 else np.arange(-128, 128)
    rng = np.random.default_rng(FORMAT_VERSION)
    d = WEIGHT_STD / np.sqrt(np.mean(values ** 2.0)) * rng.uniform(0.5, 1.5, 256)
    if kind == GGML.Q4_0:
        d *= rng.choice([-1.0, 1.0], 256)
    return d.astype(np.float16)


# --- the worker: one configuration in its own process -------------------------------------------------

def layer_matrices(config: Qwen3Config) -> list[tuple[int, int]]:
    """The [out, in] shapes of one decoder layer's matrices."""
    prefix = "model.layers.0."
    return [shape for name, shape in expected_tensors(config).items()
            if name.startswith(prefix) and name[len(prefix):].split(".")[1] in LAYER_MATRICES]


def random_weight(rng: np.random.Generator, shape: tuple[int, int], weights: str) -> Any:
    """A random [out, in] matrix in the weight kind a run holds: FormatRows over ggml blocks laid out as
    a GGUF's (strided views, as gguf_file.GGUFCheckpoint.held makes them), BF16 StoredRows or Int8Rows."""
    import ml_dtypes

    from qwen_np.numbers.formats import FormatRows
    from qwen_np.numbers.numerics import Int8Rows, StoredRows

    if weights in BLOCK_TYPES:
        blocks = random_blocks(rng, shape, BLOCK_TYPES[weights])
        codes = blocks[..., 2:].view(np.int8) if weights == "q8_0" else blocks[..., 2:]
        return FormatRows(weights, (codes, blocks[..., :2].view(np.float16)[..., 0]), shape[1])
    if weights == "bf16":                                                    # |w| ~ 0.01
        return StoredRows(rng.integers(0x3C00, 0x3D00, size=shape, dtype=np.uint16).view(ml_dtypes.bfloat16))
    return Int8Rows(rng.integers(-127, 128, size=shape, dtype=np.int8), np.full(shape[0], 1e-4, np.float32))


def layer_seconds(config: Qwen3Config, weights: str) -> float:
    """Best of 3: one layer's matrices (random, in the run's weight kind) through qwen_np.engine.fast.linear for
    one token, back to back, on runtime.threads() threads (the arrays are freed on return)."""
    from qwen_np.engine import fast, runtime

    from .worker import best_seconds

    rng = np.random.default_rng(0)
    matrices = [random_weight(rng, shape, weights) for shape in layer_matrices(config)]
    inputs = {n: np.ones((1, n), np.float32) for n in {w.shape[1] for w in matrices}}
    outputs = [np.empty((1, w.shape[0]), np.float32) for w in matrices]

    def run() -> None:
        for w, out in zip(matrices, outputs):
            fast.linear(inputs[w.shape[1]], w, out)

    with runtime.single_threaded_blas():
        return best_seconds(run)


def weights_per_token(config: Qwen3Config) -> tuple[int, int]:
    """(weights of one layer's matrices, weights every decode step multiplies: all layers and the LM head;
    of the embedding table only a row is gathered)."""
    layer = sum(math.prod(shape) for shape in layer_matrices(config))
    return layer, config.num_hidden_layers * layer + config.vocab_size * config.hidden_size


def major_faults() -> int:
    """Page faults of this process that had to read from disk: mapped weights the kernel reclaimed under
    memory pressure are read again on the next use (one per 4 KiB page, or per readahead window)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_majflt


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(path: str, size: str, weights: str, decode: int, threads: int) -> dict[str, Any]:
    """Measure one configuration in this process: its limit, then load, prefill and greedy decode."""
    import qwen_np
    from qwen_np.engine import runtime
    from qwen_np.engine.runtime import peak_rss_bytes

    from .worker import read_into_page_cache

    runtime.set_threads(threads)
    config = PRESETS[SIZES[size]]
    layer_s = [layer_seconds(config, weights)]
    layer, per_token = weights_per_token(config)
    files = [Path(path)] if path.endswith(".gguf") else sorted(Path(path).glob("*.safetensors"))
    read_into_page_cache(files)
    baseline = current_rss_bytes()
    started = time.perf_counter()
    model = qwen_np.load_model(path, memory="int8" if weights == "int8" else "bf16", max_tokens=PROMPT_TOKENS + decode)
    load_s = time.perf_counter() - started
    cache = model.new_cache(PROMPT_TOKENS + decode)
    prompt = (np.arange(PROMPT_TOKENS) * 7919 + 1000) % config.vocab_size
    started = time.perf_counter()
    token = int(model.forward(prompt, cache, last_only=True)[-1].argmax())
    prefill_s = time.perf_counter() - started
    steps, faults = [], major_faults()
    for _ in range(decode):
        started = time.perf_counter()
        token = int(model.forward([token], cache)[-1].argmax())
        steps.append(time.perf_counter() - started)
    faults = major_faults() - faults
    peak = peak_rss_bytes()              # before the second limit measurement's test layer adds to it
    # Measured again after decoding, the faster of the two kept: on a shared machine the cores other
    # processes leave change within seconds, so one short measurement can fall in a busier spell than the run.
    layer_s.append(layer_seconds(config, weights))
    rate, plan = layer / min(layer_s), model.plan
    return {"weights_gb": sum(f.stat().st_size for f in files) / 1e9, "mode": plan.mode,
            "limit_weights_per_s": rate, "limit_tps": rate / per_token, "limit_spread": max(layer_s) / min(layer_s),
            "load_s": load_s, "prefill_s": prefill_s, "decode_tps": len(steps) / sum(steps),
            "first_step_s": steps[0], "median_step_s": float(np.median(steps)), "decode_major_faults": faults,
            "peak_rss_bytes": peak, "baseline_rss_bytes": baseline,
            "predicted_bytes": plan.total_bytes, "predicted_weight_bytes": plan.held_weight_bytes}


# --- the runner ----------------------------------------------------------------------------------------

def checkpoint_for(run: Run, log: Callable[[str], None]) -> Path:
    if run.weights in BLOCK_TYPES:
        return ensure_random_gguf(run.size, run.weights, log)
    return ensure_checkpoint(run.size, log)


def predicted_bytes(run: Run, path: Path, decode: int) -> int:
    """The memory plan's total for this run (the preflight load_model does), before anything is loaded."""
    from qwen_np.files.model_files import open_checkpoint
    from qwen_np.engine.memory import candidate_plans

    checkpoint = open_checkpoint(path)
    plans = candidate_plans(checkpoint.config, PROMPT_TOKENS + decode, checkpoint.held_bytes_per_value())
    return plans["int8" if run.weights == "int8" else "bf16"].total_bytes


def wait_for_memory(need: int, max_wait: float, log: Callable[[str], None]) -> bool:
    """Wait (up to max_wait s) until `need` bytes are available; False if they never were."""
    deadline = time.monotonic() + max_wait
    while available_memory() < need:
        if time.monotonic() > deadline:
            return False
        log(f"  waiting for memory: {available_memory() / GiB:.1f} GiB available, {need / GiB:.1f} GiB needed")
        time.sleep(30)
    return True


def measure(run: Run, path: Path, args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any] | None:
    """One worker process (nice -n 5), after the memory it needs is free; its result, or None (said why)."""
    decode = args.tokens or {"8b": 16, "14b": 12, "32b": 8}[run.size]
    need = predicted_bytes(run, path, decode) + MEMORY_MARGIN
    if not wait_for_memory(need, args.wait_memory, log):
        log(f"  skip {run.label}: {need / GiB:.1f} GiB needed, {available_memory() / GiB:.1f} GiB available")
        return None
    wait_for_quiet(args.wait_quiet)
    command = ["nice", "-n", "5", sys.executable, "-m", "bench.big_models", "--worker", str(path), run.size,
               run.weights, str(decode), str(args.threads)]
    busy, ours, started = busy_cpu_seconds(), children_cpu_seconds(), time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    others = (busy_cpu_seconds() - busy - (children_cpu_seconds() - ours)) / (time.monotonic() - started)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        why = "killed (SIGKILL: out of memory?)" if done.returncode in (-9, 137) else f"exit {done.returncode}"
        log(f"  FAILED {run.label} ({why}): {done.stderr.strip().splitlines()[-1:]}")
        return None
    result = {**json.loads(lines[-1]), "others_cores": max(others, 0.0), "decode_tokens": decode}
    log(f"  {run.label}: {row(run, result)}\n  {json.dumps(result)}")
    return result


def row(run: Run, r: dict[str, Any]) -> str:
    return (f"| Qwen3-{run.size.upper()} | {run.weights} | {r['weights_gb']:.1f} | {r['predicted_bytes'] / GiB:.2f} "
            f"| {r['peak_rss_bytes'] / GiB:.2f} | {r['load_s']:.1f} | {r['decode_tps']:.3f} ({r['decode_tokens']}) "
            f"| {r['limit_tps']:.3f} | {r['decode_tps'] / r['limit_tps']:.2f} | {r['limit_weights_per_s'] / 1e9:.2f} "
            f"({r['limit_spread']:.2f}) | {r['others_cores']:.2f} |")


HEADER = ("| model | weights | files GB | plan predicts GiB | peak RSS GiB | load s | decode tok/s (tokens) "
          "| limit tok/s | x limit | limit G weights/s (the other measurement: x slower) | other processes, cores |\n"
          + "|---" * 11 + "|")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.big_models", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="+", default=list(DEFAULT_RUNS), metavar="SIZE-WEIGHTS",
                        help=f"configurations, SIZE in {', '.join(SIZES)} and WEIGHTS in q4_0, q8_0 (a random GGUF) "
                             f"or bf16, int8 (8b only: the BF16 safetensors checkpoint); default {' '.join(DEFAULT_RUNS)}")
    parser.add_argument("--tokens", type=int, help="greedy decode steps (default 16 for 8B, 12 for 14B, 8 for 32B)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--remove-after", action="store_true",
                        help="delete each generated checkpoint once its runs are done (disk: the largest one at a time)")
    parser.add_argument("--wait-memory", type=float, default=900, help="seconds to wait for enough free memory")
    parser.add_argument("--wait-quiet", type=float, default=60, help="seconds to wait for other processes to go idle")
    args = parser.parse_args(argv)
    for label in args.runs:
        size, _, weights = label.partition("-")
        if size not in SIZES or weights not in (*BLOCK_TYPES, *STORED_MODES) or weights in STORED_MODES and size != "8b":
            parser.error(f"--runs: unknown configuration {label!r}")
    return args


def main(argv: list[str] | None = None) -> None:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--worker"]:
        path, size, weights, decode, threads = argv[1:6]
        print(json.dumps(worker(path, size, weights, int(decode), int(threads))))
        return
    args = parse_args(argv)
    runs = [Run(*label.partition("-")[::2]) for label in args.runs]
    log = lambda text: print(text, flush=True)                               # noqa: E731
    results = []
    for i, run in enumerate(runs):
        path = checkpoint_for(run, log)
        result = measure(run, path, args, log)
        if result is not None:
            results.append((run, result))
        later = [checkpoint_for_path(other) for other in runs[i + 1:]]
        if args.remove_after and checkpoint_for_path(run) not in later:
            remove(path, log)
    print(f"\n{args.threads} threads, prompt {PROMPT_TOKENS} tokens, greedy decode\n{HEADER}")
    for run, result in results:
        print(row(run, result))


def checkpoint_for_path(run: Run) -> Path:
    """Where a run's checkpoint lives (without generating it)."""
    if run.weights in BLOCK_TYPES:
        return gguf_checkpoint_path(run.size, run.weights)
    return checkpoint_folder(run.size)


def remove(path: Path, log: Callable[[str], None]) -> None:
    if path.is_dir():
        for file in path.iterdir():
            file.unlink()
        path.rmdir()
    else:
        path.unlink(missing_ok=True)
    log(f"  removed {path}")


if __name__ == "__main__":
    main()
