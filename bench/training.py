"""Training speed: qwen_np's NumPy training step against PyTorch eager CPU training of the same model.

`python -m bench.training`: for each OpenBLAS setting, one process builds the same random Qwen3 (by
default hidden 256, 6 layers, 8/4 heads, head_dim 32, F 768, vocab 4096, tied: 5.8M parameters),
hands the same weights to transformers' Qwen3ForCausalLM (FP32, eager attention), and then alternates
full training steps (forward, backward, clipping, AdamW) of the two on the same batches with the same
number of threads. NumPy runs twice: the readable step (BLAS threads the products) and the trainer's
path (the batch's rows split over the threads, BLAS single-threaded in each). It prints each median
tokens/s and the ratios to torch per process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 6,
         "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32, "tie_word_embeddings": True,
         "max_position_embeddings": 1024}
OPENBLAS_VARIABLES = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")


def worker(args: argparse.Namespace) -> dict[str, float]:
    """One process: interleaved training steps of both engines; medians of tokens per second."""
    import numpy as np
    import torch
    from transformers import Qwen3ForCausalLM

    from qwen_np.engine import runtime
    from qwen_np.training import step as training
    from qwen_np.training.parameters import hf_config, init_parameters, model_from_parameters
    from qwen_np.files.checkpoint import save_checkpoint
    from qwen_np.core.config import Qwen3Config

    runtime.set_threads(args.threads)
    torch.set_num_threads(args.threads)
    config_json = hf_config(MODEL)
    config = Qwen3Config.from_dict(config_json)
    params = init_parameters(config, seed=0)
    with tempfile.TemporaryDirectory() as folder:
        save_checkpoint(folder, config_json, [params], dtype="F32")
        reference = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    reference.train()
    model = model_from_parameters(config, params)
    ours = training.adamw_for(params)
    theirs = torch.optim.AdamW(reference.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    rng = np.random.default_rng(0)
    tokens = args.batch * args.context
    times: dict[str, list[float]] = {"numpy": [], "numpy_sliced": [], "torch": []}
    for step in range(args.steps + 1):                                  # step 0 warms both up
        batch = rng.integers(0, config.vocab_size, size=(args.batch, args.context + 1))
        started = time.perf_counter()
        _, grads = training.loss_and_gradients(model, batch)
        training.clip_gradients(grads, 1.0)
        ours.update(params, grads, 1e-3)
        numpy_seconds = time.perf_counter() - started
        started = time.perf_counter()              # the trainer's path: the batch's rows split over the threads
        _, grads = training.loss_and_accumulated_gradients(model, batch, 1, threads=args.threads)
        training.clip_gradients(grads, 1.0)
        ours.update(params, grads, 1e-3)
        sliced_seconds = time.perf_counter() - started
        ids = torch.from_numpy(batch[:, :-1])
        started = time.perf_counter()
        theirs.zero_grad(set_to_none=True)
        reference(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        theirs.step()
        torch_seconds = time.perf_counter() - started
        if step:
            times["numpy"].append(numpy_seconds)
            times["numpy_sliced"].append(sliced_seconds)
            times["torch"].append(torch_seconds)
    numpy_rate = tokens / float(np.median(times["numpy"]))
    sliced_rate = tokens / float(np.median(times["numpy_sliced"]))
    torch_rate = tokens / float(np.median(times["torch"]))
    blas = runtime.blas_info()
    return {"numpy_tokens_per_s": numpy_rate, "torch_tokens_per_s": torch_rate, "ratio": numpy_rate / torch_rate,
            "sliced_tokens_per_s": sliced_rate, "sliced_ratio": sliced_rate / torch_rate,
            "openblas_core": ", ".join(str(info.get("architecture")) for info in blas)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.training", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="timed steps per engine and process (default 6)")
    parser.add_argument("--repeats", type=int, default=2, help="processes per OpenBLAS setting (default 2)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--openblas", choices=("both", "as set", "unset"), default="both",
                        help="run with this machine's OPENBLAS_CORETYPE/L2_SIZE, without them, or both")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return
    settings = ["as set", "unset"] if args.openblas == "both" else [args.openblas]
    print(f"model {MODEL}, batch {args.batch}x{args.context}, {args.threads} threads, {args.steps} steps per engine")
    for _ in range(args.repeats):
        for setting in settings:                                       # interleaved settings
            env = dict(os.environ)
            if setting == "unset":
                for name in OPENBLAS_VARIABLES:
                    env.pop(name, None)
            command = [sys.executable, "-m", "bench.training", "--worker", "--steps", str(args.steps),
                       "--batch", str(args.batch), "--context", str(args.context), "--threads", str(args.threads)]
            done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=Path(__file__).parents[1])
            if done.returncode:
                print(f"{setting}: worker failed\n{done.stderr[-2000:]}")
                continue
            r = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"OpenBLAS {setting:<6} ({r['openblas_core']}): numpy {r['numpy_tokens_per_s']:7.0f} tok/s "
                  f"({r['ratio']:.2f}x torch), numpy with rows split over the threads (train's path) "
                  f"{r['sliced_tokens_per_s']:7.0f} tok/s ({r['sliced_ratio']:.2f}x torch), "
                  f"torch {r['torch_tokens_per_s']:7.0f} tok/s")


if __name__ == "__main__":
    main()
