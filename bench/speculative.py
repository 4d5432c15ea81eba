"""`python -m bench.speculative`: what speculative decoding costs and what it gains, side by side.

1. Verify cost: one forward pass of k + 1 tokens (what a speculative step feeds the target) against one
   decode step (1 token), over the same 128 cached positions, at Qwen3-0.6B's and Qwen3-8B's shapes
   (random weights, bench/checkpoints.py), held as BF16 (upcast block by block per use) and as int8.
   0.6B runs whole (28 layers). The 8B checkpoint is 16 GB, so it runs 4 of its 36 layers at the real
   shapes, with the real embedding and LM head (which are then 46% of the weights read, not 8%: every
   matrix goes through the same product code, so the ratio moves little with the mix; extrapolating
   from 1 and 4 layers was tried and was swamped by noise on a shared machine). Round-robin repeats,
   medians: the ratio verify / decode is the price of checking k tokens.
2. End to end on the bundled model: greedy generation of --tokens tokens from a few prompts, plain,
   with the bundled draft (weights/draft) and with n-gram lookup, in one process, interleaved, median
   seconds per run, with each one's acceptance rate and tokens per target step.

    python -m bench.speculative                         # both parts
    python -m bench.speculative --part e2e              # only the bundled model (seconds)
    python -m bench.speculative --part verify --models 0.6b --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

from qwen_np import load_model
from qwen_np.core.config import PRESETS
from qwen_np.generation.generate import GenerationStats, generate
from qwen_np.files.model_files import read_tokenizer
from qwen_np.core.model import Qwen3Model
from qwen_np.core.sampling import SamplingParams
from qwen_np.generation.speculative import Speculation, draft_speculation, lookup_speculation

from bench.checkpoints import FORMAT_VERSION, MODELS, cache_dir, ensure_checkpoint, write_random_checkpoint

ROOT = Path(__file__).resolve().parents[1]
BUNDLED, BUNDLED_DRAFT = ROOT / "weights", ROOT / "weights" / "draft"
CACHED = 128                      # positions in the KV cache when a step runs
KS = (1, 2, 4, 8)
FEW_LAYERS = 4                    # the 8B checkpoint's layers that are generated and run
PROMPTS = ["ROMEO:\n", "KING HENRY:\nNow, lords, ", "First Citizen:\nBefore we proceed any further, hear me speak.\n",
           "HAMLET:\nTo be, or not to be, that is the question:\n"]


def few_layer_checkpoint(model: str, layers: int) -> Path:
    """A cached random checkpoint of `model`'s shapes with only `layers` decoder layers (the same tensors as
    the whole one's first layers: each is generated from its name)."""
    folder = cache_dir() / f"{MODELS[model]}-{layers}layers-random-v{FORMAT_VERSION}"
    if not (folder / "config.json").exists():
        partial = folder.with_name(folder.name + ".partial")
        partial.mkdir(parents=True, exist_ok=True)
        print(f"generating {folder} ...", flush=True)
        write_random_checkpoint(partial, replace(PRESETS[MODELS[model]], num_hidden_layers=layers))
        partial.rename(folder)
    return folder


def step_costs(model: Qwen3Model, counts: tuple[int, ...], repeats: int) -> dict[int, float]:
    """Median seconds of one forward pass of each token count after CACHED cached positions, measured
    round-robin (one pass of each count per round), so a neighbour's load shifts every count alike."""
    cache = model.new_cache(CACHED + max(counts))
    model.forward(list(range(CACHED)), cache, last_only=True)
    times: dict[int, list[float]] = {tokens: [] for tokens in counts}
    for lap in range(repeats + 1):                                   # lap 0 warms the buffers
        for tokens in counts:
            started = time.perf_counter()
            model.forward(list(range(1, tokens + 1)), cache)
            if lap:
                times[tokens].append(time.perf_counter() - started)
            cache.truncate(CACHED)
    return {tokens: statistics.median(seconds) for tokens, seconds in times.items()}


def verify_costs(models: list[str], memories: list[str], repeats: int) -> None:
    print(f"1. verify cost: a forward of k+1 tokens / one decode step, {CACHED} cached positions (medians of {repeats})")
    print(f"   {'shape':<26} {'weights':<7} {'decode step':>11} " + " ".join(f"{f'k={k}':>7}" for k in KS))
    counts = (1, *(k + 1 for k in KS))
    for name in models:
        whole = name == "0.6b"
        folder = ensure_checkpoint(name) if whole else few_layer_checkpoint(name, FEW_LAYERS)
        for memory in memories:
            model = load_model(folder, memory=memory, max_tokens=CACHED + max(counts))
            costs = step_costs(model, counts, repeats)
            label = f"Qwen3-{name.upper()}" + ("" if whole else f" ({FEW_LAYERS} of 36 layers)")
            print(f"   {label:<26} {memory:<7} {costs[1] * 1e3:>9.1f}ms "
                  + " ".join(f"{costs[k + 1] / costs[1]:>6.2f}x" for k in KS), flush=True)
            del model


def end_to_end(tokens: int, repeats: int, draft_tokens: int, lookup: int) -> None:
    model, tokenizer = load_model(BUNDLED), read_tokenizer(BUNDLED)
    draft = load_model(BUNDLED_DRAFT)
    ways: dict[str, Callable[[], Speculation | None]] = {
        "plain": lambda: None,
        f"--draft weights/draft (k={draft_tokens})": lambda: draft_speculation(draft, draft_tokens),
        f"--lookup {lookup} (k={draft_tokens})": lambda: lookup_speculation(lookup, draft_tokens)}
    params = SamplingParams(temperature=0.0)
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    counts: dict[str, GenerationStats] = {}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(repeats):                                           # interleaved: each way once per repeat
        for way, speculation in ways.items():
            started, stats, outs = time.perf_counter(), [], []
            for prompt in prompts:
                stats.append(GenerationStats())
                outs.append([e.token_id for e in generate(model, tokenizer, prompt, params, tokens,
                                                          stats=stats[-1], speculation=speculation())])
            seconds[way].append(time.perf_counter() - started)
            counts[way] = _totals(stats)
            outputs[way] = outs
    plain = statistics.median(seconds["plain"])
    print(f"2. end to end, bundled model, greedy, {len(prompts)} prompts x {tokens} tokens (medians of {repeats})")
    print(f"   {'':<30} {'seconds':>8} {'tok/s':>7} {'speedup':>8} {'accepted':>9} {'tokens/step':>12} {'same text':>10}")
    for way in ways:
        median, totals = statistics.median(seconds[way]), counts[way]
        rate = totals.counts.acceptance_rate
        print(f"   {way:<30} {median:>8.3f} {len(prompts) * tokens / median:>7.0f} {plain / median:>7.2f}x "
              f"{'-' if rate is None else f'{rate:.0%}':>9} {totals.counts.tokens_per_step(totals.new_tokens) or 0:>12.2f} "
              f"{str(outputs[way] == outputs['plain']):>10}", flush=True)


def _totals(stats: list[GenerationStats]) -> GenerationStats:
    total = GenerationStats()
    for one in stats:
        total.new_tokens += one.new_tokens
        total.counts += one.counts
    return total


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.speculative", description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("verify", "e2e", "both"), default="both")
    parser.add_argument("--models", nargs="+", choices=tuple(MODELS), default=list(MODELS))
    parser.add_argument("--memory", nargs="+", choices=("bf16", "int8"), default=["bf16", "int8"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=200, help="tokens generated per prompt, end to end")
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--lookup", type=int, default=3)
    args = parser.parse_args()
    if args.part in ("e2e", "both"):
        end_to_end(args.tokens, args.repeats, args.draft_tokens, args.lookup)
    if args.part in ("verify", "both"):
        verify_costs(args.models, args.memory, args.repeats)


if __name__ == "__main__":
    main()
