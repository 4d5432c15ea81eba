"""The commands of `python -m qwen_np`: each module here owns one command's flags, printing and figures,
and calls the library with plain arguments; qwen_np/cli.py assembles the parser and runs them. Each
module's PARSERS maps its commands to the functions that build their parsers (description, flags, run).

Also what every command ends with: the exit codes (besides 0), and an error line (error_line). Kept
light: cli.py imports this module before it knows the command, so `--help` pays for no NumPy.

May import: everything below it (serving/, exercises/, inspection/, precision/, training/, generation/, engine/, files/,
core/, numbers/, qwen_np.errors). Nothing but cli.py imports the commands.
"""

from __future__ import annotations

from ..errors import QwenNPError

EXIT_BAD_INPUT, EXIT_INTERRUPTED = 2, 130   # every bad input; Ctrl-C (128 + SIGINT, as shells report it)

# The command line's name for each library parameter an error is about (QwenNPError.param): the library says
# "kv_dtype: ...", the user reads "--kv-dtype: ..." (cli.main's error funnel words every error with it, and train
# its notices, errors.reworded). A caller that passes a library function a value of its own names it with its
# own parameter, as commands do with their flags' (eval's `compare` formats: "--compare").
FLAGS = {
    "adapters": "--lora", "alpha": "--lora-alpha", "batch_size": "--batch-size", "best_of": "--best-of",
    "beta": "--beta",
    "blas_threads": "--blas-threads", "clip": "--clip", "completion_tokens": "--completion-tokens",
    "compare": "--compare", "config": "--config", "context": "--ctx-size", "data": "--data",
    "decay_steps": "--decay-steps", "dpo": "--dpo", "default_max_tokens": "--default-max-tokens", "draft": "--draft",
    "draft_tokens": "--draft-tokens", "dropout": "--lora-dropout", "epochs": "--epochs", "eval_every": "--eval-every",
    "extract": "--extract",
    "file": "FILE", "file_type": "--type", "folder": "--model",
    "formats": "--formats", "grad_accum": "--grad-accum", "group": "--group", "grpo": "--grpo", "kv_dtype": "--kv-dtype",
    "kv_dtypes": "--kv-dtypes", "kv_memory": "--kv-memory", "lora": "--lora", "loss": "--loss",
    "loss_scaling": "--loss-scaling", "lr": "--lr",
    "max_batch": "--max-batch", "max_new_tokens": "--max-new-tokens", "max_ngram": "--lookup", "memory": "--memory",
    "micro_batches": "--grad-accum", "min_p": "--min-p", "model": "--model", "num_blocks": "--kv-memory", "number": "N",
    "out": "--out", "precision": "--precision", "presence_penalty": "--presence-penalty", "preset": "--preset",
    "rank": "--lora", "recompute": "--recompute", "repetition_penalty": "--repetition-penalty", "resume": "--resume",
    "reward": "--reward", "seed": "--seed",
    "shards": "--shards", "spec": "--preset, --config or --model", "steps": "--steps", "system": "--system",
    "targets": "--lora-targets", "temperature": "--temperature", "text": "--text",
    "thinking_budget": "--thinking-budget", "tokens": "--tokens",
    "top_k": "--top-k", "top_p": "--top-p", "val": "--val", "warmup": "--warmup", "weight_decay": "--weight-decay",
}


def error_line(problem: QwenNPError) -> str:
    """A library error as the command line words it: its parameter as the flag that sets it (FLAGS)."""
    return problem.worded(FLAGS)
