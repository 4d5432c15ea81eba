"""`python -m bench.constraints`: what constrained decoding adds to a decode step.

1. The mask: per generated token, the grammar's allowed tokens (Constraint.allowed: llguidance's bitmask,
   unpacked to bool [V]) and the masking step (sampling.apply_mask on [V] FP32 logits), over Qwen3's
   151,936-token vocabulary, stepping through a scripted reply token by token: a JSON answer under a
   schema, and a reply under the tool-call grammar of `tool_choice: auto` (free text, then a call).
   Medians and 90th percentiles of the steps, the first step (which builds the engine's first states)
   apart.
2. Its share of a Qwen3-0.6B decode step (random weights at the real shapes, bench/checkpoints.py; one
   token after 128 cached positions, the memory plan's default weights): the mask's median / the step's.
   The issue's goal: at most 5%.

    python -m bench.constraints                  # both parts
    python -m bench.constraints --part mask      # the mask alone (seconds; no checkpoint)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from qwen_np.core.sampling import apply_mask
from qwen_np.engine.loading import load_model
from qwen_np.files.tokenizer import Tokenizer
from qwen_np.generation import constraints
from qwen_np.generation.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

from bench.checkpoints import TOKENIZER, ensure_checkpoint
from bench.speculative import step_costs

VOCAB = 151936
EOS = (151645, 151643)
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "address", "tags"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                         "address": {"type": "object", "properties": {"street": {"type": "string"},
                                                                      "city": {"type": "string"}}},
                         "tags": {"type": "array", "items": {"type": "string"}}}}
ANSWER = {"name": "Ada Lovelace", "age": 36, "address": {"street": "12 St James's Square", "city": "London"},
          "tags": ["mathematician", "writer", "the first program"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}}, "required": ["city"]}}}]
TOOL_REPLY = ("Let me look that up for you, it will only take a moment.\n\n" + TOOL_CALL_OPEN
              + '\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n' + TOOL_CALL_CLOSE)


def mask_costs(grammar: constraints.Grammar, reply: list[int], repeats: int) -> tuple[float, list[float]]:
    """(seconds of the first step, seconds of every later step over all repeats): allowed() then apply_mask."""
    logits = np.random.default_rng(0).standard_normal(VOCAB).astype(np.float32)
    first, later = [], []
    for _ in range(repeats):
        constraint = grammar.constraint()
        for i, token in enumerate(reply):
            started = time.perf_counter()
            apply_mask(logits, constraint.allowed())
            (first if i == 0 else later).append(time.perf_counter() - started)
            constraint.consume(token)
    return statistics.median(first), later


def mask_part(repeats: int) -> tuple[float, float]:
    """The mask's seconds per token, (median, mean), of the costlier grammar of each."""
    tokenizer = Tokenizer.from_folder(TOKENIZER)
    started = time.perf_counter()
    vocab = constraints.vocabulary(tokenizer, VOCAB, EOS)
    assert vocab.engine.vocab_size == VOCAB                            # built here, once per tokenizer
    print(f"1. the mask per token, Qwen3's vocabulary (engine tokenizer built once: {time.perf_counter() - started:.2f} s)")
    cases = {"json_schema": (constraints.json_schema_grammar(SCHEMA, vocab), json.dumps(ANSWER)),
             "tool_calls auto": (constraints.tool_call_grammar(TOOLS, vocab, "auto"), TOOL_REPLY)}
    print(f"   {'grammar':<16} {'tokens':>6} {'first':>8} {'median':>8} {'p90':>8} {'mean':>8}")
    medians, means = [], []
    for name, (grammar, text) in cases.items():
        reply = tokenizer.encode(text)
        first, later = mask_costs(grammar, reply, repeats)
        medians.append(statistics.median(later))
        means.append(statistics.mean(later))
        print(f"   {name:<16} {len(reply):>6} {first * 1e3:>6.2f}ms {medians[-1] * 1e3:>6.3f}ms "
              f"{np.percentile(later, 90) * 1e3:>6.3f}ms {statistics.mean(later) * 1e3:>6.3f}ms", flush=True)
    return max(medians), max(means)


def share_part(mask: tuple[float, float], repeats: int) -> None:
    """The mask's median and mean over a Qwen3-0.6B decode step's time, measured in this run."""
    model = load_model(ensure_checkpoint("0.6b"), max_tokens=256)
    step = step_costs(model, (1,), repeats)[1]
    median, mean = mask
    print(f"2. Qwen3-0.6B decode step ({model.plan.mode if model.plan else '?'} weights, 128 cached positions): "
          f"{step * 1e3:.1f} ms; the mask adds {median * 1e3:.3f} ms at the median = {median / step:.2%}, "
          f"{mean * 1e3:.3f} ms on average = {mean / step:.2%} (the issue's goal: at most 5%)")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.constraints", description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("mask", "both"), default="both")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    mask = mask_part(args.repeats)
    if args.part == "both":
        share_part(mask, args.repeats)


if __name__ == "__main__":
    main()
