"""A training run from text to an exported Hugging Face Qwen3 folder (the `train` command is
qwen_np/commands/train.py: its flags, progress bar, figure and printing).

    text -> BPE tokenizer (trained on the training split only) -> token ids
    loop:  batch from shuffled windows -> training.loss_and_accumulated_gradients -> clip -> AdamW
           (--precision: the linear layers' operands in BF16/FP16/FP8, FP16's loss scaled, mixed.py;
            --recompute: each layer rerun in the backward; the weights and AdamW always FP32)
           every --eval-every steps: validation loss; keep the best; stop after --patience bad evals
    end:   export the best weights (BF16 safetensors + config + tokenizer + generation_config), loss.png

--out DIR holds everything: last.safetensors (resumable: weights, AdamW moments, step, data position,
RNG state, history, the text's SHA-256), best.safetensors (the same, at the best validation loss),
tokenizer files, config.json, loss.png, model/ (the exported checkpoint that `generate --model DIR/model`
runs), and train.lock while a trainer runs there (run_folder.py: one at a time).

Resuming (RunSpec.resume) continues the run bit for bit from last.safetensors; a flag given again is kept,
applied with a notice, or refused (NOT_BIT_EXACT, KEPT_ON_RESUME); a damaged checkpoint (its SHA-256) or
an edited text is one line saying what is there.

Fine-tuning (RunSpec.model, --model): the run starts from a checkpoint's weights and keeps its tokenizer
and chat template; its data may be chats (chats.ChatData: the loss on the assistant's tokens). With
RunSpec.lora (--lora) the checkpoint stays frozen (held as --memory says) and only LoRA adapters are
trained (lora.py): the checkpoints hold the adapters and their moments, and the base is reloaded on
resuming, checked by ModelFiles.weights_sha256. The same loop runs every kind of run: what differs is the data
(TextData or chats.ChatData), the trained arrays (`params`) and what _export writes (model/, and
adapter/ in peft's format).

This module is the run and its loop; beside it, one job each: run_spec.py (what to run and its settings,
over settings.py's presets), run_state.py (the run's state and its checkpoint files), resume.py (going on
from them), text_data.py (a text run's data and window order), parameters.py (the trained arrays and the
model they are).
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from . import chats, lora, mixed, objectives, preferences, rollouts, run_folder, step as training
from ..files.model_files import ModelFiles, open_model
from ..core.config import Qwen3Config
from ..errors import QwenNPError
from ..engine.budget import context_for
from ..engine.runtime import ResidentPeak
from ..engine.step_memory import training_memory, training_total
from ..core.model import Qwen3Model
from ..engine.runtime import steady_threads, usable_cores
from .parameters import hf_config, init_parameters, model_from_parameters
from .resume import resumed
from .run_spec import RunSpec, model_config, resolve_settings
from .run_state import BEST, LAST, RunState, export_model, load_state, save_state
from .text_data import TextData, WindowOrder, load_corpus
from .settings import RunEvents, Settings, capped_warmup

# What a run trains on: windows of a text, chats (SFT), preference pairs (DPO) or prompts to sample (GRPO).
RunData = TextData | chats.ChatData | preferences.PreferenceData | rollouts.PromptData


@dataclass
class RunResult:
    state: RunState                         # history, evals, best_loss, ... (what last.safetensors holds)
    stopped: str                            # why it stopped early ("" if it ran every step)
    exported: Path | None                   # the exported model, None when interrupted
    last: Path
    memory: TrainingMemory                  # the plan and the measured peak
    interrupted: bool = False               # Ctrl-C / SIGTERM: `last` holds the state to resume


@dataclass
class TrainingMemory:
    """A run's memory plan against what it used: the predicted peak RSS, the process's before the model is built
    (`baseline`, less what the estimate counts that is already held) plus a step's at its peak (the estimate,
    engine.step_memory.training_memory), and the peak RSS measured from the model's load through the last step."""

    estimate: dict[str, int]
    baseline: int
    resident: ResidentPeak
    peak: int = 0                           # measured (bytes); 0 until measure()

    @property
    def predicted(self) -> int:
        return self.baseline + training_total(self.estimate)

    def measure(self) -> None:
        self.peak = self.resident.peak


def run(spec: RunSpec, events: RunEvents | None = None) -> RunResult:
    """A training run, holding the --out folder's lock (run_folder.py) throughout: a second trainer there
    is refused. A run that fails before its first checkpoint leaves no `out` folder behind."""
    events = events or RunEvents()
    out = spec.out
    if not spec.resume and spec.preset is None and spec.config is None and spec.model is None:
        raise QwenNPError("say what to train (`preset` tiny: seconds; `preset` shakespeare, the bundled model: about "
                          "50 minutes on 2 cores; `model` MODEL to fine-tune a checkpoint)", "spec")
    if spec.model is not None and (spec.preset is not None or spec.config is not None):
        raise QwenNPError("starts from a checkpoint's weights; a `preset` or `config` starts from random ones: "
                          "give one of them", "model")
    if spec.lora is not None and spec.model is None and not spec.resume:
        raise QwenNPError("adapters train on a checkpoint's frozen weights: name it with `model` (a `preset` or "
                          "`config` model starts from random weights: train it whole)", "lora")
    if spec.grpo is not None and spec.model is None and not spec.resume:
        raise QwenNPError("GRPO tunes a checkpoint's replies: name it with `model`", "grpo")
    if spec.dpo is not None and spec.model is None and not spec.resume:
        raise QwenNPError("DPO tunes a checkpoint's replies: name it with `model` (its starting weights are the "
                          "reference)", "dpo")
    if spec.resume and not out.exists():
        raise QwenNPError(f"{out} does not exist: there is no earlier run to continue (start one without "
                          "`resume`)", "resume")
    if out.exists() and not out.is_dir():
        raise QwenNPError(f"{out} is a file, not a folder", "out")
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as bad:
        raise QwenNPError(f"cannot create {out} ({bad.strerror})", "out") from None
    with run_folder.locked(out) as left:
        try:
            return _run(spec, events, left)
        except BaseException:
            # Nothing to resume, nothing to keep; only while holding the lock (a trainer refused by it must
            # not remove the folder of the one running there, even if both found no folder).
            if created and not (out / LAST).exists():
                shutil.rmtree(out, ignore_errors=True)
            raise


@dataclass
class Run:
    """A run in memory: its state and what a step acts on. The trained weights are `params`: the model's own
    arrays (every weight, or a LoRA run's adapters alone), updated in place by the optimizer."""

    state: RunState
    params: dict[str, np.ndarray]
    model: Qwen3Model                       # model_from_parameters(params), or the frozen base with its adapters
    optimizer: training.AdamW
    data: RunData
    out: Path                               # where save() writes
    reference: Qwen3Model | None = None     # a GRPO run's KL reference (beta > 0): its starting weights

    def save(self, name: str) -> Path:
        """The run as it stands (weights, AdamW, state, the data order's place) into out/name."""
        self.state.epoch, self.state.position = self.data.order.epoch, self.data.order.position
        save_state(self.out / name, self.params, self.optimizer, self.state.to_json())
        return self.out / name

    def dropout(self, step: int) -> lora.Dropout | None:
        """LoRA dropout for optimizer step `step` (None: not a LoRA run, or --lora-dropout 0)."""
        settings = self.state.lora_settings
        if settings is None or not settings.dropout:
            return None
        return lora.Dropout.of(self.model, settings.dropout, (self.state.settings.seed, step))


def _run(spec: RunSpec, events: RunEvents, left: str | None) -> RunResult:
    """The run, in `out` (locked; `left`: what a dead trainer's lock there held, run_folder.locked). Every check
    comes before the notices (events.noted) and the first step: a refused run prints one line."""
    out = spec.out
    last, best = out / LAST, out / BEST
    notes = [] if left is None else [f"note: {out / run_folder.LOCK} was left by a train run that no longer runs "
                                     f"(PID {left or '?'}: killed, or its machine stopped); taken over"]
    saved: dict[str, np.ndarray] | None = None
    if spec.resume:
        state, saved, adam_m, adam_v, optimizer_step = resumed(spec, notes, left)
        read = sum(array.nbytes for group in (saved, adam_m, adam_v) for array in group.values())
    else:
        read = 0
        if last.exists():
            raise QwenNPError(f"{out} already holds a run ({LAST}); pass `resume` or another folder", "out")
        state = _new_state(spec)
    settings = state.settings
    if state.dpo is not None or state.grpo is not None:
        _check_policy_settings(settings)
    config = Qwen3Config.from_dict(state.config, source=state.model or "--config")
    context_for(config, settings.context, param="context")       # more than the model's context: an error
    base = _base(spec, state, notes)
    data = _data(spec, state, config, base, notes)
    schedule = _schedule(spec, settings, data, notes)
    # The plan's baseline: what the process holds before the model is built (its RSS), less the checkpoint's
    # tensors already read, which the estimate counts (the trained weights, AdamW's moments); the peak is
    # measured from here (the model's load included) through the last step, not the export after it.
    resident = ResidentPeak.begin()
    model, params = _model(state, config, base, saved)
    saved = None                                    # a resumed LoRA run's copies are in its adapters now
    if isinstance(data, preferences.PreferenceData):
        data.with_reference(_reference(spec, state, model, base))
    reference = None
    if isinstance(data, rollouts.PromptData) and data.settings.beta:
        # Full fine-tuning keeps a second copy of the starting weights, as TRL's ref_model; LoRA needs none.
        reference = _reference(spec, state, model if state.lora_settings is not None else None, base)
    if not spec.resume:
        (out / "config.json").write_text(json.dumps(state.config, indent=2) + "\n")
    optimizer = training.adamw_for(params, weight_decay=settings.weight_decay)
    if spec.resume:
        optimizer.m, optimizer.v, optimizer.step = adam_m, adam_v, optimizer_step
    scaling = settings.precision == "fp16" and settings.loss_scaling
    state.loss_scaler = (state.loss_scaler or mixed.LossScaler()) if scaling else None
    run = Run(state, params, model, optimizer, data, out, reference)
    # The tape is FP32 arrays whatever the precision (NumPy keeps the rounded values as FP32).
    adapters = state.lora_settings
    row = longest_row(data, settings.context)
    estimate = training_memory(config, rows_per_step(data, settings.batch_size) // settings.grad_accum, row,
                               recompute=settings.recompute, lora_rank=0 if adapters is None else adapters.rank,
                               lora_targets=() if adapters is None else adapters.targets, frozen=state.lora_memory,
                               micro_batches=settings.grad_accum, shards=settings.shards,
                               threads=settings.threads or usable_cores(), precision=settings.precision,
                               loss_scaling=scaling)
    for note in notes:
        events.noted(note)
    what = f"{sum(p.size for p in params.values()):,} parameters"
    if adapters is not None:
        what += f" (LoRA rank {adapters.rank} on {', '.join(adapters.targets)}; {state.model} frozen)"
    elif state.model is not None:
        what += f" (every weight of {state.model})"
    memory = TrainingMemory(estimate, resident.start - read, resident)
    step = (f"{settings.batch_size}x{row} tokens a step" if isinstance(data, TextData) else
            f"{settings.batch_size} {unit(data)} a step, each padded to its batch's longest, at most {row} tokens")
    events.started(settings, state.step, f"training {what} on {data.describe()} ({step}) -> {out}\n"
                                         f"plan: {schedule}; memory at its peak: {memory.predicted / 2**20:,.0f} MiB "
                                         "(predicted)")
    try:
        with Stops() as stops:
            stopped = _loop(run, stops, events)
            memory.measure()
            # The loop ends on an evaluation it has saved (the last step always evaluates), so best
            # and last hold it; a stop from here on re-exports on resuming.
            exported = _export(run, base, load_state(best)[0])
    except KeyboardInterrupt:
        memory.measure()
        run.save(LAST)
        return RunResult(state, "", None, last, memory, interrupted=True)
    return RunResult(state, stopped, exported, last, memory)


def _schedule(spec: RunSpec, settings: Settings, data: RunData,
              notes: list[str]) -> str:
    """The run's length and warmup settled once its data is read (in `settings`, saved with the run), and the
    plan printed before its first step: --epochs' steps (epoch_steps) when no --steps or preset sets them; a new
    run's warmup not given capped to a tenth of its schedule (capped_warmup); a note where a warmup longer
    than the run leaves the learning rate below --lr throughout."""
    sequences = sequences_per_epoch(data)
    if not settings.steps:
        settings.steps = epoch_steps(settings.epochs, sequences, settings.batch_size)
    if not spec.resume and spec.overrides.get("warmup") is None:
        settings.warmup = capped_warmup(settings.warmup, settings.schedule_steps)
    if settings.warmup > settings.steps:
        notes.append(f"note: `warmup` {settings.warmup} is longer than the run's `steps` {settings.steps}: the "
                     f"learning rate rises to {settings.steps / settings.warmup:.0%} of `lr` {settings.lr:g} and never "
                     f"reaches it (a `warmup` of at most {settings.steps} does)")
    what = unit(data)
    epochs = settings.steps * settings.batch_size / sequences
    return (f"{settings.steps:,} steps of {settings.batch_size} ({epochs:.3g} epochs of {sequences:,} {what}), "
            f"warmup {settings.warmup}, peak lr {settings.lr:g}")


def rows_per_step(data: RunData, batch_size: int) -> int:
    """The rows a step's forward holds: --batch-size, two a pair for DPO, --group a prompt for GRPO."""
    if isinstance(data, preferences.PreferenceData):
        return 2 * batch_size
    if isinstance(data, rollouts.PromptData):
        return data.settings.group * batch_size
    return batch_size


def unit(data: RunData) -> str:
    """What a run's rows are, for its plan."""
    return ("windows" if isinstance(data, TextData) else "conversations" if isinstance(data, chats.ChatData) else
            "pairs" if isinstance(data, preferences.PreferenceData) else "prompts")


def epoch_steps(epochs: float, sequences: int, batch_size: int) -> int:
    """Optimizer steps that take `epochs` passes over `sequences` rows, `batch_size` a step (the last one whole)."""
    return max(1, math.ceil(epochs * sequences / batch_size))


def sequences_per_epoch(data: RunData) -> int:
    """The rows an epoch over the run's data has: its conversations, or windows of the text (WindowOrder's,
    counted from offset 0: an epoch's offset takes at most one away)."""
    if not isinstance(data, TextData):
        return len(data.train)
    return max(1, (len(data.corpus.train) - 1) // data.order.context)


def longest_row(data: RunData, context: int) -> int:
    """The most tokens a row of the run's batches learns from: the context, or, for chats, the longest
    conversation's tokens less one (chats.padded_rows pads a batch to its longest, cut at context + 1 tokens:
    its inputs are all but the last). What the memory plan sizes the step's activations and logits by."""
    if isinstance(data, TextData):
        return context
    if isinstance(data, preferences.PreferenceData):
        return max(1, min(context, max(pair.longest for pair in data.train) - 1))
    if isinstance(data, rollouts.PromptData):
        longest = max(len(prompt.ids(data.tokenizer)) for prompt in data.train)
        return max(1, min(context, longest + data.settings.completion_tokens - 1))
    return max(1, min(context, max(len(chat.ids) for chat in data.train) - 1))


# --- Starting from a checkpoint (--model) and LoRA -----------------------------------------------------


def _new_state(spec: RunSpec) -> RunState:
    """A new run's state: a preset's or config's model from random weights, or --model's (every weight
    trained, or --lora's adapters on it frozen)."""
    settings = resolve_settings(spec.overrides, spec.preset, None)
    if spec.model is None:
        return RunState(hf_config(model_config(spec)), settings, spec.data or "shakespeare")
    adapters = None
    if spec.lora is not None:
        adapters = {**asdict(spec.lora.check()), "memory": spec.memory or "fp32"}
    elif spec.memory not in (None, "fp32"):
        raise QwenNPError(f"{spec.memory}: full fine-tuning updates every weight, held in FP32; a frozen base "
                          "(`lora`) may be held as bf16, int8, q8_0 or q4_0", "memory")
    grpo = None if spec.grpo is None else asdict(spec.grpo.check())
    return RunState(open_model(spec.model).config_json(), settings, spec.data or (spec.grpo.prompts if spec.grpo else
                    "shakespeare"), model=spec.model, adapters=adapters, val=spec.val, dpo=spec.dpo, grpo=grpo)


def _base(spec: RunSpec, state: RunState, notes: list[str]) -> ModelFiles | None:
    """The files of the run's --model (None: a preset's or config's run), checked to be the ones it began on."""
    source = spec.model or state.model
    if source is None:
        return None
    base = open_model(source)
    digest = base.weights_sha256()
    if state.base_sha256 is not None and digest != state.base_sha256:
        raise QwenNPError(f"{source} is not the model the run in {spec.out} began on (SHA-256 of its weights "
                          f"{digest[:16]}..., the run's {state.base_sha256[:16]}...): a resumed run reloads its base "
                          f"({state.model}); name it with `model`", "model")
    if state.model is not None and source != state.model:
        notes.append(f"note: `model` {source}: the run's base, read from there (it began on {state.model})")
    state.model, state.base_sha256 = source, digest
    return base


def _data(spec: RunSpec, state: RunState, config: Qwen3Config, base: ModelFiles | None,
          notes: list[str]) -> RunData:
    """The run's text or chat file, read, checked to be the one it began on (resuming), and placed in its order."""
    settings = state.settings
    data = spec.data or state.data
    if spec.resume and spec.data is None and data != "shakespeare" and not Path(data).exists():
        raise QwenNPError(f"{data}, the run's text, is not there (moved? name its new place with `data`)", "data")
    val = spec.val or state.val
    result: RunData
    if state.grpo is not None:
        if base is None or spec.sampler is None:
            raise QwenNPError("GRPO samples from a checkpoint: name it with `model` (and give the run a `sampler`)",
                              "grpo")
        order = chats.ConversationOrder(0, settings.seed, state.epoch, state.position)
        result = rollouts.prompt_data(base.tokenizer, rollouts.GrpoSettings(**state.grpo), None if val is None else
                                      Path(val), order, settings.context, _pad_id(base), spec.sampler, settings.seed)
        _check_data_digest(spec, state, data, val, result.sha256)
    elif state.dpo is not None:
        if base is None:
            raise QwenNPError("DPO tunes a checkpoint: name it with `model`", "dpo")      # (run() checks it first)
        train_pairs, validation_pairs, digest = preferences.held_out(base.tokenizer, Path(data),
                                                                     None if val is None else Path(val))
        _check_data_digest(spec, state, data, val, digest)
        order = chats.ConversationOrder(len(train_pairs), settings.seed, state.epoch, state.position)
        result = preferences.PreferenceData(train_pairs, validation_pairs, digest, order, settings.context,
                                            _pad_id(base), state.dpo)
    elif chats.is_chat_file(Path(data)):
        if base is None:
            raise QwenNPError(f"{data}: a chat file trains a model from `model` (its tokenizer and chat template)",
                              "data")
        tokenizer = base.tokenizer
        train, validation, digest = chats.held_out(tokenizer, Path(data), None if val is None else Path(val))
        _check_data_digest(spec, state, data, val, digest)
        order = chats.ConversationOrder(len(train), settings.seed, state.epoch, state.position)
        result = chats.ChatData(train, validation, digest, order, settings.context, _pad_id(base))
    else:
        if val is not None:
            raise QwenNPError("validates a chat file's run (.jsonl); a text's last 5% of lines validate it", "val")
        corpus = load_corpus(data, spec.out, config.vocab_size, spec.resume, state.data_sha256,
                             None if base is None else base.tokenizer)   # a resumed run's: its own text
        if spec.resume and state.data_sha256 is None:
            notes.append(f"note: {spec.out / LAST} keeps no hash of its text (written before checkpoints did): {data} "
                         "is taken as the run's text unchecked, and its hash kept from now on")
        result = TextData(corpus, WindowOrder(len(corpus.train), settings.context, settings.seed, state.epoch,
                                              state.position))
    if data != state.data:
        notes.append(f"note: `data` {data}: the run's text, read from there (it began on {state.data})")
    state.data, state.data_sha256, state.val = data, result.sha256, val
    return result


def _check_policy_settings(settings: Settings) -> None:
    """A DPO or GRPO step (step.policy_gradients) runs in FP32 in one piece: the settings that would change that
    are refused rather than ignored."""
    if settings.precision != "fp32":
        raise QwenNPError(f"{settings.precision}: a DPO or GRPO step runs in FP32 (SFT's steps take mixed precision)",
                          "precision")
    if settings.grad_accum != 1:
        raise QwenNPError(f"{settings.grad_accum}: a DPO or GRPO step is one piece (no micro-batches)", "grad_accum")
    if settings.recompute:
        raise QwenNPError("a DPO or GRPO step keeps its tape (no recomputation)", "recompute")


def _check_data_digest(spec: RunSpec, state: RunState, data: str, val: str | None, digest: str) -> None:
    """A resumed chat or DPO run's files are the ones it began on (their SHA-256)."""
    if state.data_sha256 is not None and digest != state.data_sha256:
        raise QwenNPError(f"{data}{' or ' + val if val else ''} is not the data the run in {spec.out} began on "
                          f"(SHA-256 {digest[:16]}..., the checkpoint's {state.data_sha256[:16]}...: edited or "
                          "replaced since): put the original back, or start a new run", "data")


def _pad_id(base: ModelFiles) -> int:
    """What pads a chat or pair batch's rows: the tokenizer's pad token, else its end of text (never learned)."""
    pad = base.tokenizer.pad_token_id
    return base.tokenizer.eos_token_id if pad is None else pad


def _reference(spec: RunSpec, state: RunState, model: Qwen3Model | None, base: ModelFiles | None) -> Qwen3Model:
    """A DPO run's reference, its starting weights: a LoRA run's base with the adapters off (the same arrays:
    lora.without_adapters), a new full run's model before its first step, a resumed full run's checkpoint
    reloaded from `model` (its trained weights are not the start any more)."""
    from ..engine.loading import load_model

    if state.lora_settings is not None and model is not None:
        return lora.without_adapters(model)
    if model is not None and (not spec.resume or base is None):
        return model
    if base is None:
        raise QwenNPError("a reference needs the run's starting checkpoint", "model")
    return load_model(base, memory="fp32", fast=False)


def _model(state: RunState, config: Qwen3Config, base: ModelFiles | None,
           saved: dict[str, np.ndarray] | None) -> tuple[Qwen3Model, dict[str, np.ndarray]]:
    """The model a run trains and its trained arrays: a preset's or config's random weights, --model's weights
    (every one trained), or --model's frozen base (held as the run's "memory" says) with LoRA adapters
    (A random, B zero); a resumed run's trained arrays are the checkpoint's (`saved`)."""
    from ..engine.loading import load_model

    adapters = state.lora_settings
    if adapters is None or base is None:             # (a LoRA run always has its --model: _new_state)
        if saved is not None:
            params = saved
        elif base is not None:
            params = training.named_parameters(load_model(base, memory="fp32", fast=False))
        else:
            params = init_parameters(config, state.settings.seed)
        return model_from_parameters(config, params), params
    model = load_model(base, memory=state.lora_memory)
    lora.add_adapters(model, adapters.rank, adapters.alpha, adapters.targets, seed=state.settings.seed)
    params = lora.adapter_parameters(model)
    if saved is not None:
        for name, array in params.items():
            array[...] = saved[name]
    return model, params


def _export(run: Run, base: ModelFiles | None, best: dict[str, np.ndarray]) -> Path:
    """The best weights written out: a preset's or config's model as export_model; a --model run's as OUT/model
    (the merged checkpoint in FP32, lora.save_merged, with the base's tokenizer files) and, for LoRA, OUT/adapter
    in peft's format. Returns OUT/model."""
    out, state = run.out, run.state
    if base is None:
        return export_model(out / "model", state.config, best, out)
    adapters = state.lora_settings
    if adapters is None:
        tuned = model_from_parameters(run.model.config, best)
    else:
        tuned = lora.with_adapters(run.model, best)
        name = str(base.path.resolve()) if Path(state.model or "").exists() else str(state.model)
        lora.save_adapter(out / "adapter", tuned, base=name, dropout=adapters.dropout)
    folder = lora.save_merged(out / "model", tuned, state.config)
    base.save_tokenizer_files(folder)
    return folder


class Stops:
    """Ctrl-C (SIGINT) and `kill` (SIGTERM) stop a run as KeyboardInterrupt, except inside `held()`: there
    a stop waits for the block's end, so the state a checkpoint saves never holds half an optimizer step
    or half an evaluation's record. (A background job started by a script never sees SIGINT: the shell
    ignores it there; hence SIGTERM too.) Leaving puts the previous handlers back."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.holding = self.pending = False
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> "Stops":
        self.previous = {number: signal.signal(number, self._stop) for number in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, handler)

    def _stop(self, signum: int, frame: object) -> None:
        if not self.holding:
            raise KeyboardInterrupt
        self.pending = True

    @contextmanager
    def held(self) -> Iterator[None]:
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
        if self.pending:
            raise KeyboardInterrupt


def _loop(run: Run, stops: Stops, events: RunEvents) -> str:
    """Optimizer steps up to settings.steps, with evaluation, best-keeping and early stopping; returns
    why it stopped early ("" if it did not).

    Each round first evaluates the step just taken if that is due and not yet recorded: a run stopped
    during an evaluation saved the step without it, and runs it on resuming, as the unstopped run did.
    """
    state, settings = run.state, run.state.settings
    with steady_threads():           # every step and evaluation repeats bit for bit on a resumed run
        while True:
            step = state.step
            if step and (step % settings.eval_every == 0 or step >= settings.steps) and not state.evaluated(step):
                result = run.data.validate(run.model)
                with stops.held():
                    improved = state.record_evaluation(step, result)
                    if improved:
                        run.save(BEST)
                    run.save(LAST)
                events.evaluated(step, state.history[-1]["loss"], result, improved)
            if settings.patience and state.bad_evals >= settings.patience:
                return f"early stop ({settings.patience} evaluations without improvement)"
            if step >= settings.steps:
                return ""
            with stops.held():          # half an update could not be resumed: a stop waits for the step's end
                state.history.append(_train_step(run))
            events.stepped(state.history[-1], run.data.order.epoch)


def _train_step(run: Run) -> dict[str, Any]:
    """The run's next optimizer step; returns its record for the history.

    FP16 with loss scaling (the state's loss_scaler): the gradients come back multiplied by the loss scale
    and are divided again before clipping; a step whose gradients overflowed is skipped (no update, its
    record says so) and the scale adapts. The record keeps the scale used and the scaler's event, if any.
    """
    started = time.perf_counter()
    settings, scaler, step = run.state.settings, run.state.loss_scaler, run.state.step
    lr = training.learning_rate(step, settings.lr, settings.warmup, settings.schedule_steps)
    if isinstance(run.data, preferences.PreferenceData):
        return _dpo_step(run, lr, started)
    if isinstance(run.data, rollouts.PromptData):
        return _grpo_step(run, lr, started)
    batch, learned = run.data.next_batch(settings.batch_size)                       # [B, T+1] each
    scale = scaler.scale if scaler is not None else 1.0
    loss, grads = training.loss_and_accumulated_gradients(run.model, batch, settings.grad_accum,
                                                          settings.threads or usable_cores(), settings.shards,
                                                          settings.recompute, settings.precision, scale, learned,
                                                          run.dropout(step), settings.blas_threads)
    record: dict[str, Any] = {"step": step + 1, "loss": loss, "lr": lr}
    finite = True
    if scaler is not None:
        finite = scaler.unscale(grads)
        record["loss_scale"] = scale
        if event := scaler.update(finite):
            record["loss_scale_event"] = event
    if finite:
        record["grad_norm"] = training.clip_gradients(grads, settings.clip)
        run.optimizer.update(run.params, grads, lr)
    else:                                           # overflow: this step's gradients are unusable
        record.update(grad_norm=None, skipped=True)
    record["tokens_per_s"] = batch[:, 1:].size / (time.perf_counter() - started)     # a chat batch's padding too
    return record


def _dpo_step(run: Run, lr: float, started: float) -> dict[str, Any]:
    """A DPO run's next optimizer step (step.dpo_loss_and_gradients on the next pairs, their reference log-probs
    computed once, PreferenceData.with_reference): its record, with TRL's reward accuracy and margin."""
    assert isinstance(run.data, preferences.PreferenceData)
    settings = run.state.settings
    ids, completion, reference = run.data.next_batch(settings.batch_size)              # [2P, W] each, [2P]
    result, grads = training.dpo_loss_and_gradients(run.model, ids, completion, reference, run.data.beta,
                                                    run.dropout(run.state.step))
    record: dict[str, Any] = {"step": run.state.step + 1, "loss": result.loss, "lr": lr,
                              "reward_accuracy": result.accuracy, "reward_margin": result.margin,
                              "grad_norm": training.clip_gradients(grads, settings.clip)}
    run.optimizer.update(run.params, grads, lr)
    record["tokens_per_s"] = ids[:, 1:].size / (time.perf_counter() - started)
    return record


def _grpo_step(run: Run, lr: float, started: float) -> dict[str, Any]:
    """A GRPO run's next optimizer step: --batch-size prompts, --group completions of each sampled by the model as
    it stands, rewarded, their advantages per group (Dr. GRPO's unscaled), the KL's reference log-probs when beta > 0,
    then step.grpo_loss_and_gradients (one update per generation: the ratio 1 with its gradient), clip, AdamW."""
    data = run.data
    assert isinstance(data, rollouts.PromptData)
    settings, grpo, step = run.state.settings, data.settings, run.state.step
    rollout = data.rollout(run.model, data.next_batch(settings.batch_size), step)
    advantages = objectives.group_advantages(rollout.rewards, scale=grpo.loss != "dr_grpo").reshape(-1)
    reference = (training.completion_log_probs(run.reference, rollout.ids, rollout.completion)
                 if grpo.beta and run.reference is not None else None)
    result, grads = training.grpo_loss_and_gradients(run.model, rollout.ids, rollout.completion, advantages, grpo.loss,
                                                     grpo.beta, reference, None, grpo.completion_tokens,
                                                     run.dropout(step))
    record: dict[str, Any] = {"step": step + 1, "loss": result.loss, "lr": lr, **rollout.summary(), "kl": result.kl,
                              "grad_norm": training.clip_gradients(grads, settings.clip)}
    run.optimizer.update(run.params, grads, lr)
    record["tokens_per_s"] = rollout.ids[:, 1:].size / (time.perf_counter() - started)
    return record
