"""A training run's settings, as the command line shows them before anything runs: the presets (--preset),
the hyper-parameters (Settings: one flag each), what a resumed run does with a flag given again, the
default warmup's cap, the linear layers' precisions, and the events a run reports to its front end.
They live here, in a module that imports nothing heavy, so that `train --help` loads no NumPy; run_spec.py
resolves them for a run and trainer.py runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The model configs a run can start from (`--preset`). "shakespeare" is the bundled default model;
# "tiny" trains in seconds (CI, tests). data.END_OF_TEXT_ID is <|endoftext|> in the BPE that data.py trains.
PRESET_CONFIGS: dict[str, dict[str, Any]] = {
    "shakespeare": {"vocab_size": 2048, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 6,
                    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32,
                    "max_position_embeddings": 256, "tie_word_embeddings": True},
    "tiny": {"vocab_size": 384, "hidden_size": 32, "intermediate_size": 96, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
             "max_position_embeddings": 64, "tie_word_embeddings": True},
}
# Flags a preset sets unless the command line does.
PRESET_SETTINGS: dict[str, dict[str, Any]] = {
    "shakespeare": {"steps": 1600, "batch_size": 16, "context": 256, "lr": 2e-3, "warmup": 100, "eval_every": 200},
    "tiny": {"steps": 40, "batch_size": 8, "context": 32, "lr": 3e-3, "warmup": 5, "eval_every": 20},
}


@dataclass
class Settings:
    """A run's hyper-parameters (saved in every checkpoint; a resumed run keeps them)."""

    steps: int = 0                # optimizer steps in total (resuming continues up to this); 0: --epochs' worth,
                                  # counted once the data is read (epoch_steps) and saved so
    epochs: float = 3             # passes over the training data when neither --steps nor a preset sets the steps
    decay_steps: int = 0          # the cosine schedule's length (0: = steps)
    batch_size: int = 16          # sequences per optimizer step
    context: int = 256            # tokens per sequence
    grad_accum: int = 1           # micro-batches per step (same update, 1/grad_accum of the activations)
    lr: float = 1e-3              # peak learning rate
    warmup: int = 100             # linear warmup steps; not given, at most a tenth of the schedule (capped_warmup)
    weight_decay: float = 0.1
    clip: float = 1.0             # global gradient norm limit
    seed: int = 0
    eval_every: int = 250
    patience: int = 0             # stop after this many evaluations without improvement (0: never)
    threads: int = 0              # shards computed at once (0: one per core); the result does not depend on it
    shards: int = 0               # a micro-batch's rows cut into this many pieces, summed in order: the result
                                  # depends on it (0: as many as divide the rows and --threads, fixed at the start)
    blas_threads: int = 0         # BLAS threads within each shard (0: the threads the shards leave, --threads //
                                  # shards, fixed at the start); may change the last digits (OpenBLAS's Haswell kernel)
    precision: str = "fp32"       # the linear layers' operands: fp32, bf16, fp16 or fp8 (mixed.py); weights stay FP32
    loss_scaling: bool = True     # fp16 only: dynamic loss scaling (mixed.LossScaler); off shows what it prevents
    recompute: bool = False       # activation checkpointing: each layer rerun in the backward (same bits, less memory)

    @property
    def schedule_steps(self) -> int:
        return self.decay_steps or self.steps

# The formats a run's linear layers may read their operands in (mixed.py casts to them).
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
# FP16's dynamic loss scale doubles after this many clean steps in a row (mixed.LossScaler: torch's is 2000;
# 200 fits runs of a few thousand steps).
LOSS_SCALE_GROWTH_INTERVAL = 200


# What a resumed run does with a flag given again, with another value than the run's own (the same value
# changes nothing). Every Settings field is in one of the three. Applied, the run stays bit for bit the one
# never stopped: --steps or --epochs (with --decay-steps fixed: else the schedule, which then spans --steps,
# changes: noted), --eval-every and --patience (when it evaluates, not the weights), --threads (the speed),
# --recompute (the same bits):
BIT_EXACT = ("steps", "epochs", "eval_every", "patience", "threads", "recompute")
# Applied with a notice that it no longer is (each changes the updates from here on; the run goes on from
# its weights, moments and data position):
NOT_BIT_EXACT = ("lr", "batch_size", "grad_accum", "warmup", "decay_steps", "weight_decay", "clip", "shards",
                 "blas_threads", "precision", "loss_scaling")
# Refused (the state saved would not fit: the run would not be a continuation), and so are a --preset or
# --config of another model and a --data of another text:
KEPT_ON_RESUME = {"seed": "it orders the data: another seed would repeat some windows of this epoch and skip others",
                  "context": "the data order is over windows of `context` + 1 tokens: another length would repeat "
                             "some and skip others"}


# The default warmup's share of the schedule, at most: a run of a few epochs over small data (the default
# --epochs: a handful of steps) warms up over its first tenth, not over 100 steps it never takes.
WARMUP_FRACTION = 0.1


def capped_warmup(warmup: int, schedule_steps: int) -> int:
    """A warmup not given on the command line (the default's or a preset's), at most WARMUP_FRACTION of the schedule."""
    return min(warmup, int(WARMUP_FRACTION * schedule_steps))


class RunEvents:
    """What a run reports as it goes; the command draws it (a progress bar), a test may record it."""

    def noted(self, line: str) -> None:
        """Before the first step: a one-line notice ("note: ..."), e.g. a setting that makes a resumed run no
        longer bit-exact, or a dead trainer's lock taken over. A setting it names is in backticks ("`lr` 0.005"),
        for the front end to word as its own (errors.reworded)."""

    def started(self, settings: Settings, done: int, description: str) -> None:
        """Before the first step: `done` steps of settings.steps are behind (resuming)."""

    def stepped(self, record: dict[str, Any], epoch: int) -> None:
        """After each optimizer step (record: step, loss, lr, grad_norm, tokens_per_s; in FP16 also loss_scale,
        and loss_scale_event "overflow" (then skipped: True, grad_norm None) or "grow")."""

    def evaluated(self, step: int, train_loss: float, result: dict[str, Any], improved: bool) -> None:
        """After each validation (result: evaluation.TextScore.summary())."""
