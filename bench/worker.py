"""One measured configuration, run in its own process; prints one JSON line of results.

Bandwidth differs from process to process on this machine (50-73 GB/s), so the limits a run is
judged against are measured in the same process, just before the model is loaded:

* read_gbs: streaming read bandwidth, as FP32 GEMV over a 1 GiB matrix (what decode does with FP32
  weights: every byte read once, two flops per four bytes).
* gemm_gflops: FP32 GEMM at the shape of the model's MLP for a 128-token prefill ([T, D] x [D, F]).
* fused_gbs: qwen_np's BF16 streaming product (upcast blocks of rows, then GEMV) over 1 GiB of BF16
  weights, in BF16 bytes per second: the ceiling for decoding with weights kept as BF16.

An int8 run also reports how far its logits are from the checkpoint's own weights (kld_against_stored),
after its peak RSS is taken.

Usage: python -m bench.worker ENGINE MODEL_DIR MODE PREFILL DECODE THREADS
(ENGINE qwen_np|qwen_np_plain|transformers|llama.cpp; MODE fp32|bf16|int8; llama.cpp reads the GGUF made
by bench.checkpoints.ensure_gguf next to MODEL_DIR).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import ml_dtypes
import numpy as np

from qwen_np.engine.runtime import peak_rss_bytes
from qwen_np.numbers.numerics import Int8Rows, StoredRows

GiB = 1024 ** 3


def best_seconds(run: Callable[[], object], repeats: int = 3) -> float:
    run()                                            # warm caches, fault pages, spin up threads
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def machine_rates(hidden: int, intermediate: int, prefill: int) -> dict[str, float]:
    """This process's read bandwidth, FP32 GEMM rate, and the fused BF16 upcast+GEMV and int8 cast+GEMV rates
    (qwen_np.engine.fast.linear over 1 GiB of stored weights, in stored bytes per second). Each test array is
    freed before the next is made, so none of them adds to the peak RSS the worker reports."""
    rng = np.random.default_rng(0)
    return {"read_gbs": _read_rate(rng),
            "gemm_gflops": _gemm_rate(rng, hidden, intermediate, prefill),
            "fused_gbs": _stream_rate(StoredRows(rng.integers(0x3C00, 0x3D00, size=(GiB // (2 * hidden), hidden),
                                                              dtype=np.uint16).view(ml_dtypes.bfloat16))),  # |w| ~ 0.01
            "int8_fused_gbs": _stream_rate(Int8Rows(rng.integers(-127, 128, size=(GiB // hidden, hidden), dtype=np.int8),
                                                    np.full(GiB // hidden, 0.01, np.float32)))}


def _stream_rate(weight: StoredRows | Int8Rows) -> float:
    """GB/s (stored bytes) of qwen_np.engine.fast.linear's streaming GEMV over `weight`, on runtime.threads() threads."""
    from qwen_np.engine import fast, runtime

    x = np.ones((1, weight.shape[1]), np.float32)
    y = np.empty((1, weight.shape[0]), np.float32)
    stored_bytes = weight.codes.nbytes if isinstance(weight, Int8Rows) else weight.nbytes
    with runtime.single_threaded_blas():
        return stored_bytes / best_seconds(lambda: fast.linear(x, weight, y)) / 1e9


def _read_rate(rng: np.random.Generator) -> float:
    """FP32 GEMV over a 1 GiB matrix with all BLAS threads, in GB/s (the matrix is freed on return)."""
    matrix = rng.standard_normal((GiB // (4 * 4096), 4096), dtype=np.float32)
    vector = np.ones(4096, np.float32)
    out = np.empty(matrix.shape[0], np.float32)
    return matrix.nbytes / best_seconds(lambda: np.matmul(matrix, vector, out=out)) / 1e9


def _gemm_rate(rng: np.random.Generator, hidden: int, intermediate: int, prefill: int) -> float:
    """FP32 GEMM [prefill, D] x [D, F] in GFLOP/s."""
    a = rng.standard_normal((prefill, hidden), dtype=np.float32)
    b = rng.standard_normal((intermediate, hidden), dtype=np.float32)
    c = np.empty((prefill, intermediate), np.float32)
    return 2 * a.shape[0] * a.shape[1] * b.shape[0] / best_seconds(lambda: np.matmul(a, b.T, out=c)) / 1e9


def read_into_page_cache(paths: list[Path]) -> None:
    """Read every checkpoint file once, so the timed load measures loading from the page cache."""
    chunk = bytearray(16 * 1024 ** 2)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(chunk):
                pass


def run_qwen_np(folder: str, mode: str, prefill: int, decode: int, fast: bool) -> dict[str, Any]:
    import qwen_np

    start = time.perf_counter()
    model = qwen_np.load_model(folder, memory=mode, max_tokens=prefill + decode, fast=fast)
    load_s = time.perf_counter() - start
    prompt = (np.arange(prefill) * 7919 + 1000) % model.config.vocab_size
    # Prefill as generation runs it: logits of the last position only (transformers: logits_to_keep=1).
    model.forward(prompt, model.new_cache(prefill + decode), last_only=True)   # warm-up: page faults, buffers
    cache = model.new_cache(prefill + decode)
    start = time.perf_counter()
    logits = model.forward(prompt, cache, last_only=True)
    prefill_s = time.perf_counter() - start
    token = int(logits[-1].argmax())
    start = time.perf_counter()
    for _ in range(decode):
        token = int(model.forward([token], cache)[-1].argmax())
    decode_s = time.perf_counter() - start
    result = {"load_s": load_s, "prefill_s": prefill_s, "decode_s": decode_s, "mode": model.plan.mode,
              "stream_s": weight_stream_seconds(model)}
    if mode == "int8":
        logits = model.forward(prompt)                                        # [prefill, V]
        result["peak_rss_bytes"] = peak_rss_bytes()                          # before the reference loads
        del model, cache
        result.update(kld_against_stored(folder, prompt, logits))
    return result


def kld_against_stored(folder: str, prompt: np.ndarray, logits: np.ndarray) -> dict[str, float]:
    """KL(stored || int8) of the next token over the prompt's positions, and the same-top share.

    The reference is the checkpoint's own weights kept as stored ("bf16" mode: upcast exactly, so
    the FP32 model's logits) - an FP32 copy of Qwen3-8B would not fit in RAM.
    """
    import qwen_np
    from qwen_np.precision.divergence import Comparison

    reference = qwen_np.load_model(folder, memory="bf16", max_tokens=len(prompt))
    comparison = Comparison()
    comparison.add(reference.forward(prompt)[:-1], logits[:-1], prompt[1:])
    stats = comparison.summary()
    return {key: stats[key] for key in ("kld_mean", "kld_p99", "same_top_percent", "delta_p_rms_percent")}


def weight_stream_seconds(model: Any) -> float:
    """One token's products alone: every weight matrix through qwen_np.engine.fast.linear, back to back.

    Bandwidth depends on where in physical memory an array lands (it varies from allocation to
    allocation in this VM, 48-73 GB/s), so the 1 GiB test matrix can read slower or faster than the
    model's own weights; this measures the weights where they actually are.
    """
    from qwen_np.engine import fast, runtime

    matrices = [w for layer in model.layers for w in vars(layer).values() if w.ndim == 2] + [model.lm_head]
    inputs = {n: np.ones((1, n), np.float32) for n in {w.shape[1] for w in matrices}}
    outputs = [np.empty((1, w.shape[0]), np.float32) for w in matrices]

    def run() -> None:
        for w, out in zip(matrices, outputs):
            fast.linear(inputs[w.shape[1]], w, out)

    with runtime.blas_threads_for(model.lm_head):
        return best_seconds(run)


def run_transformers(folder: str, mode: str, prefill: int, decode: int, threads: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    dtype = torch.float32 if mode == "fp32" else torch.bfloat16
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    load_s = time.perf_counter() - start
    prompt = torch.tensor([(np.arange(prefill) * 7919 + 1000) % model.config.vocab_size])
    with torch.inference_mode():
        model(prompt, use_cache=True, logits_to_keep=1)                   # warm-up
        start = time.perf_counter()
        out = model(prompt, use_cache=True, logits_to_keep=1)
        prefill_s = time.perf_counter() - start
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(decode):
            out = model(token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        decode_s = time.perf_counter() - start
    return {"load_s": load_s, "prefill_s": prefill_s, "decode_s": decode_s, "mode": mode}


def run_llama_cpp(gguf: Path, prefill: int, decode: int, threads: int) -> dict[str, Any]:
    """llama.cpp through llama-cpp-python, the same prompt and greedy steps; logits of the last token only."""
    from llama_cpp import Llama

    start = time.perf_counter()
    llm = Llama(model_path=str(gguf), n_ctx=prefill + decode, n_batch=prefill, n_threads=threads,
                n_threads_batch=threads, verbose=False)
    load_s = time.perf_counter() - start
    vocab = llm.n_vocab()
    prompt = ((np.arange(prefill) * 7919 + 1000) % vocab).tolist()

    def next_token() -> int:      # argmax of the last evaluated token's logits, read where llama.cpp left them
        return int(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,)).argmax())

    llm.eval(prompt)                                                         # warm-up
    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt)
    prefill_s = time.perf_counter() - start
    token = next_token()
    start = time.perf_counter()
    for _ in range(decode):
        llm.eval([token])
        token = next_token()
    decode_s = time.perf_counter() - start
    return {"load_s": load_s, "prefill_s": prefill_s, "decode_s": decode_s, "gguf": gguf.name}


def main(argv: list[str]) -> None:
    engine, folder, mode, prefill, decode, threads = argv[0], argv[1], argv[2], int(argv[3]), int(argv[4]), int(argv[5])
    from qwen_np.engine import runtime
    from qwen_np.core.config import load_config

    from .checkpoints import gguf_path

    runtime.set_threads(threads)
    config = load_config(folder)
    result: dict[str, Any] = machine_rates(config.hidden_size, config.intermediate_size, prefill)
    gguf = gguf_path(Path(folder), mode)
    read_into_page_cache([gguf] if engine == "llama.cpp" else sorted(Path(folder).glob("*.safetensors")))
    if engine.startswith("qwen_np") and mode == "fp32":
        from qwen_np.files.checkpoint import Checkpoint
        from qwen_np.engine.weight_cache import load_fp32

        load_fp32(Checkpoint(folder, config))      # builds the FP32 weight cache if missing, and leaves it in the page cache
    result["blas"] = [{key: info.get(key) for key in ("internal_api", "architecture", "num_threads", "version")}
                      for info in runtime.blas_info()]
    if engine == "transformers":
        result.update(run_transformers(folder, mode, prefill, decode, threads))
    elif engine == "llama.cpp":
        result.update(run_llama_cpp(gguf, prefill, decode, threads))
    else:
        result.update(run_qwen_np(folder, mode, prefill, decode, fast=engine == "qwen_np"))
    result.setdefault("peak_rss_bytes", peak_rss_bytes())
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
