"""A LoRA step and a full step at Qwen3-0.6B's shapes, qwen_np against torch + peft (`python -m bench.lora_training`).

Random weights at Qwen3-0.6B's shapes (28 layers, hidden 1024, tied, 151,936-token vocabulary), one batch of
--batch x --tokens ids from the real tokenizer (a text encoded by it), each configuration in its own process on
the same --threads: qwen_np's trainer step (training.loss_and_accumulated_gradients, clipping, AdamW) with LoRA
rank 16 on all seven projections and with every weight trained, and transformers' Qwen3ForCausalLM (FP32, eager
attention) with peft's LoRA of the same rank, alpha and targets, and whole. Tokens a second: median of --steps
timed steps after one warm-up. Peak RSS above the process's own before the model is built, against
engine.step_memory.training_memory's estimate of the step (qwen_np's plan; the same figure stands beside torch's).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from qwen_np.core.config import Qwen3Config, preset
from qwen_np.engine.step_memory import training_memory, training_total
from qwen_np.engine.runtime import peak_rss_bytes

TOKENIZER = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "qwen3_tokenizer_random"
CONFIGURATIONS = ("qwen_np lora", "torch+peft lora", "qwen_np full", "torch full")
RANK, ALPHA = 16, 32
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def batch(rows: int, tokens: int) -> np.ndarray:
    """[rows, tokens + 1] ids of an English text in the real tokenizer."""
    from qwen_np.files.tokenizer import Tokenizer

    words = "the king and queen of this fair land shall speak to thee my lord what news from rome".split()
    text = " ".join(words[(i * 7) % len(words)] for i in range(4 * rows * tokens))
    ids = Tokenizer.from_folder(TOKENIZER).encode(text)[:rows * (tokens + 1)]
    return np.asarray(ids, dtype=np.int64).reshape(rows, tokens + 1)


def qwen_np_steps(name: str, ids: np.ndarray, steps: int, threads: int) -> list[float]:
    from qwen_np.training import lora, step as training
    from qwen_np.training.parameters import init_parameters, model_from_parameters

    config = preset("qwen3-0.6b")
    params = init_parameters(config, seed=0)
    model = model_from_parameters(config, params)
    if name.endswith("lora"):
        lora.add_adapters(model, RANK, ALPHA)
        params = lora.adapter_parameters(model)
    optimizer = training.adamw_for(params)
    seconds = []
    for _ in range(steps + 1):
        started = time.perf_counter()
        _, grads = training.loss_and_accumulated_gradients(model, ids, 1, threads=threads)
        training.clip_gradients(grads, 1.0)
        optimizer.update(params, grads, 1e-4)
        seconds.append(time.perf_counter() - started)
    return seconds[1:]


def hf_model(config: Qwen3Config) -> Any:
    """transformers' Qwen3ForCausalLM at `config`'s shapes: FP32, eager attention, tied, random, in train mode."""
    import transformers

    hf = transformers.Qwen3Config(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim, tie_word_embeddings=True,
        max_position_embeddings=config.max_position_embeddings, attn_implementation="eager")
    return transformers.Qwen3ForCausalLM(hf).float().train()


def torch_steps(name: str, ids: np.ndarray, steps: int, threads: int) -> list[float]:
    import torch

    torch.set_num_threads(threads)
    model: torch.nn.Module = hf_model(preset("qwen3-0.6b"))
    if name.endswith("lora"):
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                                           target_modules=list(TARGETS)))
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    tensor = torch.from_numpy(ids)
    seconds = []
    for _ in range(steps + 1):
        started = time.perf_counter()
        loss = model(input_ids=tensor[:, :-1], labels=tensor[:, :-1]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - started)
    return seconds[1:]


def one(name: str, rows: int, tokens: int, steps: int, threads: int) -> dict[str, object]:
    ids = batch(rows, tokens)
    baseline = peak_rss_bytes()
    seconds = (qwen_np_steps if name.startswith("qwen_np") else torch_steps)(name, ids, steps, threads)
    lora = name.endswith("lora")
    estimate = training_memory(preset("qwen3-0.6b"), rows, tokens, lora_rank=RANK if lora else 0,
                               lora_targets=TARGETS if lora else (), shards=math.gcd(rows, threads),
                               threads=threads)      # as loss_and_accumulated_gradients cuts the rows
    return {"name": name, "tokens_per_s": rows * tokens / statistics.median(seconds),
            "peak_above_baseline": peak_rss_bytes() - baseline, "estimate": training_total(estimate)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", choices=CONFIGURATIONS, help=argparse.SUPPRESS)    # one configuration (a worker)
    args = parser.parse_args()
    if args.only:
        print(json.dumps(one(args.only, args.batch, args.tokens, args.steps, args.threads)))
        return
    for name in CONFIGURATIONS:
        worker = subprocess.run([sys.executable, "-m", "bench.lora_training", "--only", name, "--batch", str(args.batch),
                                 "--tokens", str(args.tokens), "--steps", str(args.steps), "--threads",
                                 str(args.threads)], capture_output=True, text=True)
        if worker.returncode:
            print(f"{name:<16} failed: {worker.stderr.strip().splitlines()[-1:]}")
            continue
        result = json.loads(worker.stdout.strip().splitlines()[-1])
        print(f"{name:<16} {result['tokens_per_s']:8.1f} tokens/s   peak {result['peak_above_baseline'] / 2**30:6.2f} GiB "
              f"above the process's start   estimate {result['estimate'] / 2**30:6.2f} GiB")


if __name__ == "__main__":
    main()
