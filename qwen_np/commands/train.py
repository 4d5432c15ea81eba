"""`python -m qwen_np train`: the flags, progress bar, loss figure and report of a training run
(the run itself is qwen_np/training/trainer.py)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.config import LAYER_MATRICES
from ..errors import QwenNPError, reworded
from ..training import run_folder
from ..training.settings import (BIT_EXACT, KEPT_ON_RESUME, LOSS_SCALE_GROWTH_INTERVAL, NOT_BIT_EXACT, PRECISIONS,
                                 PRESET_CONFIGS, WARMUP_FRACTION, RunEvents, Settings)
from . import FLAGS

DPO_BETA = 0.1                     # objectives.DPO_BETA (TRL's DPOConfig.beta), here without importing NumPy
GRPO_LOSSES = ("grpo", "dr_grpo", "dapo")      # objectives.LOSS_TYPES

if TYPE_CHECKING:                  # the parser needs none of these: `train --help` loads no NumPy
    from ..training.lora import LoraSettings
    from ..training.run_state import RunState
    from ..training.trainer import TrainingMemory


# The help of Settings' on/off fields (their flags come with a --no- form).
SWITCHES = {"loss_scaling": "with --precision fp16: dynamic loss scaling (skip the step and halve the scale on "
                            f"overflow, double it after {LOSS_SCALE_GROWTH_INTERVAL} clean steps); --no-loss-scaling shows "
                            "what it prevents",
            "recompute": "activation checkpointing: keep each layer's input only and run the layer again in the "
                         "backward: less memory, about one more forward pass per step, the same weights bit for bit"}
# Settings' fields whose default is not one number (their help says what it is instead).
DEFAULTS = {"steps": "the preset's, else --epochs over the training data",
            "epochs": f"{Settings.epochs:g}, used when neither --steps nor a --preset sets the steps",
            "warmup": f"the preset's, else {Settings.warmup}; a new run's, at most "
                      f"{WARMUP_FRACTION:g} of its steps",
            "threads": "every core; the shards computed at once", "shards": "as many as divide the rows and --threads",
            "blas_threads": "the threads the shards leave, --threads // --shards: a batch of one row uses every core "
                            "in its products"}


def train_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Train a Qwen3 (a preset or a config.json from random weights, or a checkpoint: every weight "
                          "or LoRA adapters) on Shakespeare, a text file or chats; checkpoints resume bit-exactly; the "
                          "best model is exported to DIR/model (and a LoRA run's adapter, in peft's format, to "
                          "DIR/adapter).")
    parser.epilog = RESUME_HELP
    parser.add_argument("--out", required=True, type=Path, metavar="DIR",
                        help="folder for checkpoints, the tokenizer, logs and the exported model (DIR/model)")
    parser.add_argument("--data", metavar="shakespeare|FILE",
                        help="Shakespeare's plays (fixed by-play splits), a UTF-8 text file (last 5%% of lines "
                             "validate) or, with --model, a chat file FILE.jsonl of {\"messages\": [...]} lines, "
                             "rendered by the model's chat template, the loss on the assistant's tokens only "
                             "(default: shakespeare; resuming, the run's own data)")
    dpo = parser.add_argument_group("DPO (with --model)")
    dpo.add_argument("--dpo", action="store_true",
                     help="preference tuning: --data is TRL's preference format, a JSONL line {\"prompt\", \"chosen\", "
                          "\"rejected\"} of strings or (conversational) a prompt of messages and replies of assistant "
                          "messages; the loss is TRL's sigmoid DPO against the starting weights (with --lora: the base, "
                          "adapters off); --batch-size counts pairs")
    dpo.add_argument("--beta", type=float, metavar="B",
                     help=f"DPO's beta, how far the tuned replies may move from the reference's (default: {DPO_BETA:g}); "
                          "with --grpo, the KL term's weight (default: 0, TRL's)")
    grpo = parser.add_argument_group("GRPO (with --model)")
    grpo.add_argument("--grpo", action="store_true",
                      help="reinforcement learning from a reward function: --group completions of each of --batch-size "
                           "prompts a step, sampled by the model, rewarded, advantages per group, TRL's clipped loss")
    grpo.add_argument("--prompts", metavar="FILE.jsonl",
                      help="GRPO's prompts: {\"messages\": [...]} or {\"prompt\": \"...\"} a line, any other fields "
                           "passed to the reward function")
    grpo.add_argument("--reward", metavar="FILE.py:FUNCTION", help="fn(prompt, completion, **row) -> float")
    grpo.add_argument("--group", type=int, metavar="G", help="completions a prompt (default: 4)")
    grpo.add_argument("--loss", choices=GRPO_LOSSES, help="the loss's average (TRL's loss_type; default: dapo)")
    grpo.add_argument("--completion-tokens", type=int, metavar="N", help="at most N tokens a completion (default: 64)")
    parser.add_argument("--val", metavar="FILE.jsonl",
                        help="a chat file that validates (default: the last 5%% of --data's conversations)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", choices=sorted(PRESET_CONFIGS),
                        help="model and run defaults: tiny trains in seconds, shakespeare (the bundled model) takes "
                             "about 50 minutes on 2 cores (a new run needs --preset or --config)")
    source.add_argument("--config", type=Path, metavar="JSON", help="a Qwen3 config.json to train from scratch")
    source.add_argument("-m", "--model", metavar="MODEL",
                        help="a checkpoint to fine-tune (folder, hub id or GGUF), with its tokenizer and chat template: "
                             "every weight, or --lora's adapters")
    lora = parser.add_argument_group("LoRA (with --model)")
    lora.add_argument("--lora", type=int, metavar="RANK",
                      help="train rank-RANK adapters beside the frozen projections (A random, B zero; scaled "
                           "alpha/rank); checkpoints hold the adapters and their AdamW moments only")
    lora.add_argument("--lora-alpha", type=float, metavar="ALPHA", help="the adapters' alpha (default: 2 x RANK)")
    lora.add_argument("--lora-targets", metavar="NAMES",
                      help=f"comma-separated projections to adapt (default: all seven, {','.join(LAYER_MATRICES)})")
    lora.add_argument("--lora-dropout", type=float, metavar="P",
                      help="dropout on each adapter's input while training, as peft's lora_dropout (default: 0)")
    lora.add_argument("--memory", metavar="MODE",
                      help="how the frozen base is held: fp32 (default, fastest), bf16 (as stored, 2 bytes a weight), "
                           "int8, q8_0 or q4_0 (QLoRA's idea: a quarter of FP32 or less; the adapters stay FP32 and "
                           "learn on the quantized base's outputs)")
    for flag in fields(Settings):
        name = "--" + flag.name.replace("_", "-")
        fallback = f"the preset's, else {flag.default}"
        default = f"(default: {DEFAULTS.get(flag.name, fallback)})"
        if flag.type == "bool":            # --recompute / --no-recompute: a resumed run keeps its saved choice
            parser.add_argument(name, action=argparse.BooleanOptionalAction, default=None,
                                help=f"{SWITCHES[flag.name]} {default}")
        elif flag.name == "precision":
            parser.add_argument(name, choices=PRECISIONS, default=None,
                                help="the format of every linear layer's operands, forward and backward; master "
                                     "weights, AdamW, norms, attention and the loss stay FP32. fp16 scales the "
                                     "loss dynamically, fp8 is E4M3 with 1x128 / 128x128 scales (DeepSeek-V3) "
                                     f"{default}")
        else:
            # -t/--threads, -c/--ctx-size (--context) and -s/--seed, as every other command spells them
            names = {"threads": ["-t", name], "context": ["-c", "--ctx-size", name],
                     "seed": ["-s", name]}.get(flag.name, [name])
            parser.add_argument(*names, dest=flag.name, type=float if flag.type == "float" else int, default=None,
                                metavar="N", help=default)
    parser.add_argument("--resume", action="store_true",
                        help="continue from DIR/last.safetensors up to --steps (flags given again: see below)")
    parser.set_defaults(run=run)


def _flags(names: tuple[str, ...] | list[str]) -> str:
    return ", ".join("--" + name.replace("_", "-") for name in names)


# train --help's last paragraph: what --resume does with each flag given again (NOT_BIT_EXACT, KEPT_ON_RESUME).
RESUME_HELP = (
    "--resume continues the run in DIR bit for bit as if it had never stopped. Flags given again with another "
    f"value than the run's: {_flags(BIT_EXACT)} apply and keep it so "
    "(--steps changes the learning-rate schedule when the run has no --decay-steps: noted); "
    f"{_flags(NOT_BIT_EXACT)} apply, with a one-line note that the run is no longer bit-exact; "
    f"{_flags(list(KEPT_ON_RESUME))}, a --preset or --config of another model and a --data of another text "
    "are refused (the text is checked by its SHA-256, so an edited file is noticed, a moved one may be named), and "
    "so are other --lora flags or --memory; a run from --model reloads it and checks its weights' SHA-256. "
    f"One train at a time uses DIR (it holds DIR/{run_folder.LOCK}; a second is refused, a dead one's lock taken over).")


PARSERS = {"train": train_parser}      # cli.py builds the command's parser with it


class ProgressBar(RunEvents):
    """The run drawn on stderr: a bar of steps with the loss and tokens/s, a line per evaluation."""

    def __init__(self) -> None:
        self.bar: Any = None

    def noted(self, line: str) -> None:
        print(reworded(line, FLAGS), file=sys.stderr)

    def started(self, settings: Settings, done: int, description: str) -> None:
        from tqdm import tqdm

        print(description, file=sys.stderr)
        if done >= settings.steps:
            print(f"note: the run is already at step {done} of --steps {settings.steps}: nothing to train; its best "
                  "model is exported again (raise --steps to train on)", file=sys.stderr)
        self.bar = tqdm(total=settings.steps, initial=done, unit="step", file=sys.stderr, dynamic_ncols=True)

    def stepped(self, record: dict[str, Any], epoch: int) -> None:
        if "loss_scale_event" in record:
            what = {"overflow": "FP16 overflow: step skipped, loss scale halved",
                    "grow": "loss scale doubled"}[record["loss_scale_event"]]
            self.bar.write(f"step {record['step']}: {what} (was {record['loss_scale']:g})")
        if "reward_mean" in record:                    # GRPO: the rollouts' rewards, length and the KL
            self.bar.set_postfix(reward=f"{record['reward_mean']:.3f}±{record['reward_std']:.3f}",
                                 length=f"{record['completion_length']:.1f}", kl=f"{record['kl']:.4f}", epoch=epoch,
                                 refresh=False)
        else:
            self.bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}", epoch=epoch,
                                 refresh=False)
        self.bar.update(1)

    def evaluated(self, step: int, train_loss: float, result: dict[str, Any], improved: bool) -> None:
        if "preference_accuracy" in result:
            self.bar.write(f"step {step}: train DPO loss {train_loss:.4f}, validation {result['dpo_loss']:.4f}; "
                           f"held-out preference accuracy {result['preference_accuracy']:.1%}, margin "
                           f"{result['margin']:.3f} nats{' (best)' if improved else ''}")
            return
        if "reward_mean" in result:
            self.bar.write(f"step {step}: held-out mean reward {result['reward_mean']:.4f} (std {result['reward_std']:.4f}), "
                           f"completions of {result['completion_length']:.1f} tokens{' (best)' if improved else ''}")
            return
        self.bar.write(f"step {step}: train {train_loss:.4f}, validation {result['loss_per_token']:.4f} per token, "
                       f"{result['nats_per_character']:.4f} nats/char{' (best)' if improved else ''}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def lora_settings(args: argparse.Namespace) -> LoraSettings | None:
    """--lora and its companions as LoraSettings (checked by the trainer); None without --lora."""
    from ..training.lora import LoraSettings

    if args.lora is None:
        given = [flag for flag, value in (("--lora-alpha", args.lora_alpha), ("--lora-targets", args.lora_targets),
                                          ("--lora-dropout", args.lora_dropout)) if value is not None]
        if given:
            raise QwenNPError(f"{given[0]}: sets LoRA's adapters: give --lora RANK too")
        return None
    targets = LAYER_MATRICES if args.lora_targets is None else tuple(
        name.strip() for name in args.lora_targets.split(",") if name.strip())
    return LoraSettings(args.lora, args.lora_alpha, targets, args.lora_dropout or 0.0)


def dpo_beta(args: argparse.Namespace) -> float | None:
    """--dpo's beta (None without --dpo); a --beta alone is refused."""
    if not args.dpo:
        if args.beta is not None and not args.grpo:
            raise QwenNPError("--beta: sets DPO's beta: give --dpo too")
        return None
    beta = DPO_BETA if args.beta is None else args.beta
    if not beta > 0:
        raise QwenNPError(f"--beta: must be positive, got {beta:g}")
    return float(beta)


def grpo_run(args: argparse.Namespace) -> tuple[Any, Any]:
    """(--grpo's settings or None, the sampler a GRPO run draws completions with: given to every run, as a resumed
    GRPO run reads its settings from its checkpoint); GRPO's flags without --grpo are refused."""
    from ..training.rollouts import GrpoSettings

    given = [flag for flag, value in (("--prompts", args.prompts), ("--reward", args.reward), ("--group", args.group),
                                      ("--loss", args.loss), ("--completion-tokens", args.completion_tokens))
             if value is not None]
    if not args.grpo:
        if given:
            raise QwenNPError(f"{given[0]}: sets GRPO's rollouts: give --grpo too")
        return None, sample_completions
    if args.dpo:
        raise QwenNPError("--grpo: a run is DPO or GRPO, not both")
    if args.resume:
        return None, sample_completions
    if args.prompts is None or args.reward is None:
        raise QwenNPError(f"--grpo: needs {'--prompts FILE.jsonl' if args.prompts is None else '--reward FILE.py:FUNCTION'}")
    settings = GrpoSettings(args.prompts, args.reward, args.group or 4, args.beta or 0.0, args.loss or "dapo",
                            args.completion_tokens or 64)
    return settings.check(), sample_completions


def sample_completions(model: Any, tokenizer: Any, prompt: list[int], count: int, tokens: int, temperature: float,
                       seed: int) -> list[list[int]]:
    """`count` completions of `prompt` (generation.generate, sample i seeded seed + i), the prompt prefilled once
    into a cache each copies; each completion's ids, its end-of-sequence token included where it ended so."""
    import copy

    from ..core.sampling import SamplingParams
    from ..generation.generate import generate

    cache = model.new_cache(len(prompt) + tokens)
    if len(prompt) > 1:
        model.forward(prompt[:-1], cache)
    eos = model.config.eos_token_ids
    return [[event.token_id for event in generate(model, tokenizer, prompt, SamplingParams(temperature=temperature,
                                                                                         seed=seed + i),
                                                  tokens, eos_token_ids=eos, cache=copy.deepcopy(cache))]
            for i in range(count)]


def run(args: argparse.Namespace) -> int:
    from ..training import trainer, run_spec

    spec = run_spec.RunSpec(args.out, args.resume, args.preset, args.config, args.data,
                           args.model, lora_settings(args), args.memory, args.val,
                           {f.name: getattr(args, f.name) for f in fields(Settings)}, dpo_beta(args), *grpo_run(args))
    events = ProgressBar()
    try:
        result = trainer.run(spec, events)
    finally:
        events.close()
    state = result.state
    if result.interrupted:
        print(f"\ninterrupted at step {state.step}: saved {result.last}; continue with --resume", file=sys.stderr)
        return 130
    plot_losses(state, args.out / "loss.png")
    last = state.evals[-1]
    figures = (f"best validation DPO loss {state.best_loss:.4f} (held-out preference accuracy "
               f"{last['preference_accuracy']:.1%} last)" if state.dpo is not None else
               f"best held-out mean reward {-(state.best_loss or 0.0):.4f}" if state.grpo is not None else
               f"best validation loss {state.best_loss:.4f} per token ({last['nats_per_character']:.4f} nats/char last)")
    print(f"{result.stopped or 'done'} at step {state.step}; {figures}; exported {result.exported}", file=sys.stderr)
    print("memory:\n" + memory_report(result.memory), file=sys.stderr)
    return 0


def memory_report(memory: TrainingMemory) -> str:
    """The estimate as one table (MiB), with the measured peak RSS next to the prediction (its parts are alive
    at different moments of a step: the prediction is the peak moment's, training_peak)."""
    from ..engine.step_memory import training_peak

    estimate = memory.estimate
    lines = [f"  {key:<26} {value / 2**20:9.1f} MiB" for key, value in estimate.items() if key != "activations_per_token"]
    lines.append(f"  {'activations per token':<26} {estimate['activations_per_token'] / 1024:9.1f} KiB")
    lines.append(f"  predicted peak RSS {memory.predicted / 2**20:.0f} MiB at the step's "
                 f"{training_peak(estimate).replace('_', ' ')} (the process before the model: {memory.baseline / 2**20:.0f} "
                 f"MiB); measured peak RSS {memory.peak / 2**20:.0f} MiB "
                 f"({memory.peak / memory.predicted:.2f}x the prediction; the model's load through the last step)")
    return "\n".join(lines)


def plot_losses(state: RunState, path: Path) -> None:
    """loss.png: training loss per step (and its running mean) and validation loss per evaluation."""
    import numpy as np

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: no loss.png (pip install 'qwen_np[plot]' for matplotlib)", file=sys.stderr)
        return
    steps = [h["step"] for h in state.history]
    losses = np.array([h["loss"] for h in state.history])
    smooth = np.convolve(losses, np.ones(25) / 25, mode="valid") if len(losses) >= 25 else losses
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(steps, losses, color="tab:blue", alpha=0.25, linewidth=0.8, label="train (each step)")
    ax.plot(steps[len(steps) - len(smooth):], smooth, color="tab:blue", label="train (mean of 25 steps)")
    if state.evals:
        ax.plot([e["step"] for e in state.evals], [e["loss_per_token"] for e in state.evals], "o-",
                color="tab:orange", label="validation")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats per token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
