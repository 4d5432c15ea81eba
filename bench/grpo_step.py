"""A GRPO step with LoRA at Qwen3-0.6B's shapes, qwen_np against TRL + peft on torch (`python -m bench.grpo_step`).

Random weights at Qwen3-0.6B's shapes (bench.lora_training's models: LoRA rank 16 on all seven projections), one
prompt of --prompt-tokens ids from the real tokenizer, --group completions of exactly --completion-tokens
tokens each (random weights never sample end-of-sequence; both sides are told to ignore it), temperature 1,
and a reward that tells the completions apart (their tokens' sum, odd or even), so the advantages are not all zero.
Each configuration runs in its own process on the same --threads:

- qwen_np: the step train --grpo takes (trainer._grpo_step's parts): the completions sampled by
  commands.train.sample_completions (the prompt prefilled once, each completion decoded on its own), the
  loss and every adapter's gradient by step.grpo_loss_and_gradients (TRL's defaults: dapo, beta 0), clipping,
  AdamW.
- TRL + peft: GRPOTrainer (TRL 1.16, its defaults but for the batch: one prompt, --group generations, one
  update per generation; among the defaults gradient checkpointing, as qwen_np's backward recomputes nothing
  unless told) over transformers' Qwen3ForCausalLM (FP32, eager attention) with peft's LoRA;
  its rollout is its _generate_and_score_completions (transformers' generate, one batch of --group rows
  with a KV cache, then the old and reference log-probs where its settings need them), timed inside its step.

Seconds: median of --steps timed steps after one warm-up, the rollout's share beside the whole step's. Peak RSS
above the process's own before the model is built.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

from qwen_np.core.config import preset
from qwen_np.engine.runtime import peak_rss_bytes

from .lora_training import ALPHA, RANK, TARGETS, TOKENIZER, batch, hf_model

CONFIGURATIONS = ("qwen_np lora", "trl+peft lora")
LR = 1e-6


def reward(completion_ids: list[int]) -> float:
    """Tells completions apart (half of them, on average, 1): what a real reward is, its speed aside."""
    return float(sum(completion_ids) % 2)


def qwen_np_steps(prompt: list[int], group: int, tokens: int, steps: int, threads: int) -> list[tuple[float, float]]:
    from qwen_np.commands.train import sample_completions
    from qwen_np.files.tokenizer import Tokenizer
    from qwen_np.training import chats, lora, objectives, step as training
    from qwen_np.training.parameters import init_parameters, model_from_parameters
    from threadpoolctl import threadpool_limits

    config = preset("qwen3-0.6b")
    model = model_from_parameters(config, init_parameters(config, seed=0))
    lora.add_adapters(model, RANK, ALPHA)
    params = lora.adapter_parameters(model)
    optimizer = training.adamw_for(params)
    tokenizer = Tokenizer.from_folder(TOKENIZER)
    seconds = []
    with threadpool_limits(threads):
        for step in range(steps + 1):
            started = time.perf_counter()
            completions = sample_completions(model, tokenizer, prompt, group, tokens, 1.0, seed=step)
            sampled = time.perf_counter()
            rows = [chats.Chat(np.asarray(prompt + c, dtype=np.int64),
                               np.asarray([False] * len(prompt) + [True] * len(c)), 0) for c in completions]
            ids, completion = chats.padded_rows(rows, len(prompt) + tokens, pad_id=0)
            advantages = objectives.group_advantages(np.asarray([[reward(c) for c in completions]])).reshape(-1)
            _, grads = training.grpo_loss_and_gradients(model, ids, completion, advantages,
                                                        max_completion_length=tokens)
            training.clip_gradients(grads, 1.0)
            optimizer.update(params, grads, LR)
            seconds.append((sampled - started, time.perf_counter() - started))
    return seconds[1:]


def trl_steps(prompt: list[int], group: int, tokens: int, steps: int, threads: int) -> list[tuple[float, float]]:
    import datasets
    import peft
    import torch
    import transformers
    import trl

    torch.set_num_threads(threads)
    tokenizer = transformers.AutoTokenizer.from_pretrained(TOKENIZER)
    text = tokenizer.decode(prompt)
    config = trl.GRPOConfig(output_dir="/tmp/bench-grpo-step", use_cpu=True, bf16=False, report_to=[],
                            per_device_train_batch_size=group, num_generations=group, max_completion_length=tokens,
                            max_steps=steps + 1, learning_rate=LR, temperature=1.0, logging_steps=10 ** 9,
                            save_strategy="no", generation_kwargs={"min_new_tokens": tokens})

    def trl_reward(completions: list[str], completion_ids: list[list[int]], **_: Any) -> list[float]:
        return [reward(ids) for ids in completion_ids]

    trainer = trl.GRPOTrainer(model=hf_model(preset("qwen3-0.6b")), reward_funcs=trl_reward, args=config,
                              train_dataset=datasets.Dataset.from_list([{"prompt": text}] * (steps + 1)),
                              processing_class=tokenizer,
                              peft_config=peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                                          target_modules=list(TARGETS)))
    rollouts: list[float] = []
    generate = trainer._generate_and_score_completions

    def timed_generate(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        result = generate(*args, **kwargs)
        rollouts.append(time.perf_counter() - started)
        assert result["completion_ids"].shape[1] == tokens, "every completion has --completion-tokens tokens"
        return result

    trainer._generate_and_score_completions = timed_generate      # type: ignore[method-assign]
    steps_seconds: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            self.started = time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            steps_seconds.append(time.perf_counter() - self.started)

    trainer.add_callback(Clock())
    trainer.train()
    return list(zip(rollouts, steps_seconds))[1:]


def one(name: str, prompt_tokens: int, group: int, tokens: int, steps: int, threads: int) -> dict[str, object]:
    prompt = batch(1, prompt_tokens - 1)[0].tolist()
    baseline = peak_rss_bytes()
    seconds = (qwen_np_steps if name.startswith("qwen_np") else trl_steps)(prompt, group, tokens, steps, threads)
    return {"name": name, "rollout_s": statistics.median(s for s, _ in seconds),
            "step_s": statistics.median(s for _, s in seconds), "peak_above_baseline": peak_rss_bytes() - baseline}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--completion-tokens", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", choices=CONFIGURATIONS, help=argparse.SUPPRESS)    # one configuration (a worker)
    args = parser.parse_args()
    shape = [str(args.prompt_tokens), str(args.group), str(args.completion_tokens), str(args.steps), str(args.threads)]
    if args.only:
        print(json.dumps(one(args.only, *map(int, shape))))
        return
    print(f"GRPO step, Qwen3-0.6B shapes, LoRA {RANK}: 1 prompt of {args.prompt_tokens} tokens, {args.group} completions "
          f"of {args.completion_tokens} tokens, {args.threads} threads")
    for name in CONFIGURATIONS:
        worker = subprocess.run([sys.executable, "-m", "bench.grpo_step", "--only", name, "--prompt-tokens", shape[0],
                                 "--group", shape[1], "--completion-tokens", shape[2], "--steps", shape[3],
                                 "--threads", shape[4]], capture_output=True, text=True)
        if worker.returncode:
            print(f"{name:<14} failed: {worker.stderr.strip().splitlines()[-1:]}")
            continue
        result = json.loads(worker.stdout.strip().splitlines()[-1])
        print(f"{name:<14} step {result['step_s']:7.2f} s (rollout {result['rollout_s']:6.2f} s, the rest "
              f"{result['step_s'] - result['rollout_s']:6.2f} s)   peak {result['peak_above_baseline'] / 2**30:5.2f} GiB "
              f"above the process's start")


if __name__ == "__main__":
    main()
