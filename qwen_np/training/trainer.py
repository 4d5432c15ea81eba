"""A training run from text to an exported Hugging Face Qwen3 folder (the `train` command is
qwen_np/commands/train.py: its flags, progress bar, figure and printing).

    text -> BPE tokenizer (trained on the training split only) -> token ids
    loop:  batch from shuffled windows -> training.loss_and_accumulated_gradients -> clip -> AdamW
           (--precision: the linear layers' operands in BF16/FP16/FP8, FP16's loss scaled, mixed.py;
            --recompute: each layer rerun in the backward; the weights and AdamW always FP32)
           every --eval-every steps: validation loss; keep the best; stop after --patience bad evals
    end:   export the best weights (BF16 safetensors + config + tokenizer + generation_config), loss.png

--out DIR holds everything: last.safetensors (resumable: weights, AdamW moments, step, data position,
RNG state, history), best.safetensors (the same, at the best validation loss), tokenizer files,
log.jsonl, loss.png, and model/ (the exported checkpoint that `generate --model DIR/model` runs).
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from . import evaluation, mixed, step as training
from ..files.checkpoint import save_checkpoint, write_atomically
from ..core.config import LAYER_TENSOR_NAMES, Qwen3Config, expected_tensors
from .data import END_OF_TEXT_ID
from ..errors import QwenNPError
from ..engine.memory import training_memory
from ..core.model import LayerWeights, Qwen3Model
from ..engine.runtime import peak_rss_bytes, steady_threads, usable_cores

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

    steps: int = 1000             # optimizer steps in total (resuming continues up to this)
    decay_steps: int = 0          # the cosine schedule's length (0: = steps)
    batch_size: int = 16          # sequences per optimizer step
    context: int = 256            # tokens per sequence
    grad_accum: int = 1           # micro-batches per step (same update, 1/grad_accum of the activations)
    lr: float = 1e-3              # peak learning rate
    warmup: int = 100             # linear warmup steps
    weight_decay: float = 0.1
    clip: float = 1.0             # global gradient norm limit
    seed: int = 0
    eval_every: int = 250
    patience: int = 0             # stop after this many evaluations without improvement (0: never)
    threads: int = 0              # shards computed at once (0: one per core); the result does not depend on it
    shards: int = 0               # a micro-batch's rows cut into this many pieces, summed in order: the result
                                  # depends on it (0: as many as divide the rows and --threads, fixed at the start)
    precision: str = "fp32"       # the linear layers' operands: fp32, bf16, fp16 or fp8 (mixed.py); weights stay FP32
    loss_scaling: bool = True     # fp16 only: dynamic loss scaling (mixed.LossScaler); off shows what it prevents
    recompute: bool = False       # activation checkpointing: each layer rerun in the backward (same bits, less memory)

    @property
    def schedule_steps(self) -> int:
        return self.decay_steps or self.steps


# --- Data order -------------------------------------------------------------------------------------


@dataclass
class WindowOrder:
    """Epochs over the training tokens as shuffled windows of context + 1 tokens.

    Each epoch draws, from a generator seeded by (seed, epoch), an offset in [0, context) where the
    windows start and a permutation of them, so windows differ from epoch to epoch and the order is
    reproducible from (seed, epoch, position) alone: that triple is the data's RNG state.
    """

    n_tokens: int
    context: int
    seed: int
    epoch: int = 0
    position: int = 0             # windows of this epoch already used

    def _epoch(self) -> tuple[int, np.ndarray]:
        rng = np.random.default_rng([self.seed, self.epoch])
        offset = int(rng.integers(self.context))
        count = (self.n_tokens - 1 - offset) // self.context
        if count < 1:
            raise QwenNPError(f"{self.n_tokens} tokens are too few for one window of the context ({self.context})", "data")
        return offset, rng.permutation(count)

    def next_batch(self, tokens: np.ndarray, batch_size: int) -> np.ndarray:
        """The next batch_size windows [B, context + 1], continuing into the next epoch when one ends."""
        rows: list[np.ndarray] = []
        while len(rows) < batch_size:
            offset, order = self._epoch()
            if self.position >= len(order):
                self.epoch, self.position = self.epoch + 1, 0
                continue
            start = offset + int(order[self.position]) * self.context
            rows.append(tokens[start:start + self.context + 1])
            self.position += 1
        return np.stack(rows).astype(np.int64)


# --- Parameters ------------------------------------------------------------------------------------


def init_parameters(config: Qwen3Config, seed: int) -> dict[str, np.ndarray]:
    """Fresh weights as transformers initialises Qwen3: matrices N(0, 0.02), RMSNorm weights 1."""
    rng = np.random.default_rng(seed)
    params = {}
    for name, shape in expected_tensors(config).items():
        if len(shape) == 1:
            params[name] = np.ones(shape, dtype=np.float32)
        else:
            params[name] = (0.02 * rng.standard_normal(shape)).astype(np.float32)
    return params


def model_from_parameters(config: Qwen3Config, params: dict[str, np.ndarray]) -> Qwen3Model:
    """A Qwen3Model whose weights ARE these arrays (no copies): updating them in place trains it."""
    layers = [LayerWeights(**{key: params[template.format(i=i)] for key, template in LAYER_TENSOR_NAMES.items()})
              for i in range(config.num_hidden_layers)]
    embed = params["model.embed_tokens.weight"]
    head = embed if config.tie_word_embeddings else params["lm_head.weight"]
    return Qwen3Model(config, embed, layers, params["model.norm.weight"], head)


def hf_config(model_config: dict[str, Any]) -> dict[str, Any]:
    """A complete config.json that transformers and qwen_np both load."""
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
            "attention_dropout": 0.0, "hidden_act": "silu", "initializer_range": 0.02, "rms_norm_eps": 1e-6,
            "rope_theta": 1_000_000.0, "rope_scaling": None, "use_sliding_window": False, "sliding_window": None,
            "bos_token_id": END_OF_TEXT_ID, "eos_token_id": END_OF_TEXT_ID, "torch_dtype": "bfloat16",
            "use_cache": True, **model_config}


# --- Checkpoints ------------------------------------------------------------------------------------


def save_state(path: Path, params: dict[str, np.ndarray], optimizer: training.AdamW, meta: dict[str, Any]) -> None:
    """Weights, AdamW moments and the run's state (JSON in the safetensors header) in one file.

    Written atomically (checkpoint.write_atomically): a crash or a full disk leaves the previous
    checkpoint or the new one, never half of one.
    """
    from safetensors.numpy import save_file

    tensors = {f"param/{n}": p for n, p in params.items()}
    tensors.update({f"adam_m/{n}": m for n, m in optimizer.m.items()})
    tensors.update({f"adam_v/{n}": v for n, v in optimizer.v.items()})
    meta = {**meta, "optimizer_step": optimizer.step}
    write_atomically(path, lambda tmp: save_file(tensors, str(tmp), metadata={"qwen_np_training": json.dumps(meta)}))


def load_state(path: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray], dict[str, Any]]:
    """(params, adam_m, adam_v, meta) from a file written by save_state."""
    from safetensors import safe_open

    if not path.is_file():
        raise QwenNPError(f"{path} not found (no earlier run in this folder)", "resume")
    groups: dict[str, dict[str, np.ndarray]] = {"param": {}, "adam_m": {}, "adam_v": {}}
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = json.loads((f.metadata() or {})["qwen_np_training"])
            for key in f.keys():
                group, name = key.split("/", 1)
                groups[group][name] = f.get_tensor(key)
    except (KeyError, ValueError, RecursionError, OSError) as bad:
        raise QwenNPError(f"{path}: not a qwen_np training checkpoint ({bad})") from None
    return groups["param"], groups["adam_m"], groups["adam_v"], meta


def export_model(folder: Path, config_json: dict[str, Any], params: dict[str, np.ndarray], tokenizer_folder: Path) -> Path:
    """A Hugging Face Qwen3 folder: config.json, BF16 model.safetensors, tokenizer, generation_config.json."""
    save_checkpoint(folder, config_json, [params], dtype="BF16")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tokenizer_folder / name).read_bytes())
    generation = {"bos_token_id": END_OF_TEXT_ID, "eos_token_id": END_OF_TEXT_ID, "pad_token_id": END_OF_TEXT_ID,
                  "do_sample": True, "temperature": 0.8, "top_k": 50, "top_p": 0.95}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return folder


# --- Memory -----------------------------------------------------------------------------------------


# --- The run ----------------------------------------------------------------------------------------


@dataclass
class Corpus:
    """What a run trains and validates on."""

    train: np.ndarray                    # token ids of the training text
    validation: list[np.ndarray]         # documents, each starting with <|endoftext|>
    validation_characters: int


def load_corpus(data: str, out: Path, vocab_size: int, resume: bool) -> Corpus:
    """Train (or, resuming, reload) the tokenizer in `out`, and encode the training and validation text.

    --data shakespeare uses data.py's fixed by-play splits. A text FILE is split at a line boundary:
    the last 5% of its lines validate, the rest train.
    """
    import tokenizers

    from . import data as corpora
    from ..files.tokenizer import Tokenizer

    if data == "shakespeare":
        train_text, valid_text = corpora.shakespeare_split("train"), corpora.shakespeare_split("validation")
    else:
        lines = corpora.read_text(data).splitlines(keepends=True)
        cut = len(lines) - max(1, len(lines) // 20)
        train_text, valid_text = "".join(lines[:cut]), "".join(lines[cut:])
        if not train_text.strip() or not valid_text.strip():
            raise QwenNPError(f"{data} is too short to split into training and validation text", "data")
    if not resume:
        corpora.save_tokenizer(corpora.train_tokenizer(train_text, vocab_size), out)
    tokenizer = Tokenizer.from_folder(out)
    bpe = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))       # encode_corpus's fast batch encoder
    if tokenizer.vocab_size != vocab_size:
        raise QwenNPError(f"{out}/tokenizer.json: {tokenizer.vocab_size} tokens, but the config's vocab_size is "
                          f"{vocab_size} (the text is too small for that many BPE merges?)")
    separator = np.array([END_OF_TEXT_ID], dtype=np.int32)
    train_docs = [corpora.encode_corpus(bpe, doc) for doc in evaluation.documents(train_text)]
    train = np.concatenate([part for doc in train_docs for part in (separator, doc)])
    valid, characters = evaluation.encoded_documents(tokenizer, valid_text)
    return Corpus(train, valid, characters)


def resolve_settings(overrides: dict[str, Any], preset: str | None, saved: dict[str, Any] | None) -> Settings:
    """The given settings (the command line's) over the saved run's (resuming) or the preset's, over
    Settings' defaults. overrides: Settings field -> value, None meaning not given."""
    base = saved if saved is not None else PRESET_SETTINGS.get(preset or "", {})
    values = {f.name: overrides[f.name] if overrides.get(f.name) is not None else base.get(f.name, f.default)
              for f in fields(Settings)}
    settings = Settings(**values)
    for name in ("steps", "batch_size", "context", "grad_accum", "eval_every"):
        if getattr(settings, name) < 1:
            raise QwenNPError(f"must be at least 1, got {getattr(settings, name)}", name)
    if settings.batch_size % settings.grad_accum:
        raise QwenNPError(f"{settings.grad_accum} does not divide the batch size {settings.batch_size}", "grad_accum")
    if not settings.lr > 0:
        raise QwenNPError(f"must be positive, got {settings.lr}", "lr")
    mixed.check_precision(settings.precision)
    rows = settings.batch_size // settings.grad_accum
    if not settings.shards:      # chosen once and saved: a resumed run keeps it whatever its --threads
        settings.shards = math.gcd(rows, settings.threads or usable_cores())
    if settings.shards < 0 or rows % settings.shards:
        raise QwenNPError(f"{settings.shards} does not divide the {rows} rows of a micro-batch", "shards")
    return settings


LAST, BEST = "last.safetensors", "best.safetensors"


@dataclass
class RunSpec:
    """What to run: a new run (from a preset or a config.json) or the run in `out` resumed."""

    out: Path                               # checkpoints, tokenizer, exported model/ (created on the first write)
    resume: bool = False
    preset: str | None = None               # a key of PRESET_CONFIGS
    config: Path | None = None              # a Qwen3 config.json to train from scratch
    data: str = "shakespeare"               # "shakespeare" or a UTF-8 text file
    overrides: dict[str, Any] = field(default_factory=dict)   # Settings field -> value (None: not given)


class RunEvents:
    """What a run reports as it goes; the command draws it (a progress bar), a test may record it."""

    def started(self, settings: Settings, done: int, description: str) -> None:
        """Before the first step: `done` steps of settings.steps are behind (resuming)."""

    def stepped(self, record: dict[str, Any], epoch: int) -> None:
        """After each optimizer step (record: step, loss, lr, grad_norm, tokens_per_s; in FP16 also loss_scale,
        and loss_scale_event "overflow" (then skipped: True, grad_norm None) or "grow")."""

    def evaluated(self, step: int, train_loss: float, result: dict[str, Any], improved: bool) -> None:
        """After each validation (result: evaluation.TextScore.summary())."""


@dataclass
class RunResult:
    meta: dict[str, Any]                    # history, evals, best_loss, ... (what last.safetensors holds)
    stopped: str                            # why it stopped early ("" if it ran every step)
    exported: Path | None                   # the exported model, None when interrupted
    last: Path
    estimate: dict[str, int]                # memory.training_memory of a step
    baseline: int                           # the process's peak RSS before training (bytes)
    interrupted: bool = False               # Ctrl-C / SIGTERM: `last` holds the state to resume


def run(spec: RunSpec, events: RunEvents | None = None) -> RunResult:
    """A training run. A run that fails before its first checkpoint leaves no `out` folder behind."""
    if not spec.resume and spec.preset is None and spec.config is None:
        raise QwenNPError("say what to train, a preset or a config (preset tiny: seconds; preset shakespeare, "
                          "the bundled model: about 50 minutes on 2 cores)", "spec")
    created = not spec.out.exists()
    try:
        return _run(spec, events or RunEvents())
    except BaseException:
        if created and not (spec.out / LAST).exists():     # nothing to resume: nothing to keep
            shutil.rmtree(spec.out, ignore_errors=True)
        raise


def _run(spec: RunSpec, events: RunEvents) -> RunResult:
    out = spec.out
    last, best = out / LAST, out / BEST
    if spec.resume:
        params, adam_m, adam_v, meta = load_state(last)
        config_json = meta["config"]
        settings = resolve_settings(spec.overrides, None, meta["settings"])
        if spec.overrides.get("decay_steps") is None and not meta["settings"]["decay_steps"]:
            settings.decay_steps = 0                     # the schedule stretches to the new --steps
    else:
        if last.exists():
            raise QwenNPError(f"{out} already holds a run ({LAST}); resume it, or choose another folder", "out")
        config_json = hf_config(_model_config(spec))
        settings = resolve_settings(spec.overrides, spec.preset, None)
        meta = {"history": [], "evals": [], "best_loss": None, "bad_evals": 0,
                "order": {"epoch": 0, "position": 0}, "data": spec.data}
    config = Qwen3Config.from_dict(config_json, source=str(spec.config) if spec.config and not spec.resume else "config")
    if settings.context > config.max_position_embeddings:
        raise QwenNPError(f"{settings.context} exceeds the model's max_position_embeddings "
                          f"({config.max_position_embeddings})", "context")
    out.mkdir(parents=True, exist_ok=True)
    corpus = load_corpus(meta["data"], out, config.vocab_size, spec.resume)
    if not spec.resume:
        params = init_parameters(config, settings.seed)
        (out / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
    model = model_from_parameters(config, params)
    optimizer = training.adamw_for(params, weight_decay=settings.weight_decay)
    if spec.resume:
        optimizer.m, optimizer.v, optimizer.step = adam_m, adam_v, meta["optimizer_step"]
    order = WindowOrder(len(corpus.train), settings.context, settings.seed, **meta["order"])
    baseline = peak_rss_bytes()
    # The tape is FP32 arrays whatever the precision (NumPy keeps the rounded values as FP32).
    estimate = training_memory(config, settings.batch_size // settings.grad_accum, settings.context,
                               recompute=settings.recompute)
    scaling = settings.precision == "fp16" and settings.loss_scaling
    scaler = mixed.LossScaler(**meta.get("loss_scaler", {})) if scaling else None

    def checkpoint(path: Path) -> None:
        meta.update(settings=asdict(settings), config=config_json, order={"epoch": order.epoch, "position": order.position})
        save_state(path, params, optimizer, meta)

    events.started(settings, len(meta["history"]),
                   f"training {sum(p.size for p in params.values()):,} parameters on {len(corpus.train):,} tokens "
                   f"({settings.batch_size}x{settings.context} tokens a step) -> {out}")
    try:
        with Stops() as stops:
            stopped = _loop(model, params, optimizer, order, corpus, settings, meta, stops, events,
                            lambda kind: checkpoint(out / f"{kind}.safetensors"), scaler)
            # The loop ends on an evaluation it has saved (the last step always evaluates), so best
            # and last hold it; a stop from here on re-exports on resuming.
            exported = export_model(out / "model", config_json, load_state(best)[0], out)
    except KeyboardInterrupt:
        checkpoint(last)
        return RunResult(meta, "", None, last, estimate, baseline, interrupted=True)
    return RunResult(meta, stopped, exported, last, estimate, baseline)


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


def _model_config(spec: RunSpec) -> dict[str, Any]:
    if spec.config is not None:
        from ..core.config import read_json_object
        return read_json_object(spec.config)
    if spec.preset not in PRESET_CONFIGS:
        raise QwenNPError(f"unknown {spec.preset!r}; expected one of {', '.join(sorted(PRESET_CONFIGS))}", "preset")
    return dict(PRESET_CONFIGS[spec.preset])


def _loop(model: Qwen3Model, params: dict[str, np.ndarray], optimizer: training.AdamW, order: WindowOrder,
          corpus: Corpus, settings: Settings, meta: dict[str, Any], stops: Stops, events: RunEvents,
          save: Callable[[str], None], scaler: mixed.LossScaler | None) -> str:
    """Optimizer steps up to settings.steps, with evaluation, best-keeping and early stopping; returns
    why it stopped early ("" if it did not).

    Each round first evaluates the step just taken if that is due and not yet recorded: a run stopped
    during an evaluation saved the step without it, and runs it on resuming, as the unstopped run did.
    """
    with steady_threads():           # every step and evaluation repeats bit for bit on a resumed run
        while True:
            step = len(meta["history"])
            if step and (step % settings.eval_every == 0 or step >= settings.steps) and \
                    not (meta["evals"] and meta["evals"][-1]["step"] == step):
                result = validate(model, corpus, settings.context)
                with stops.held():
                    improved = _record_evaluation(meta, step, result)
                    if improved:
                        save("best")
                    save("last")
                events.evaluated(step, meta["history"][-1]["loss"], result, improved)
            if settings.patience and meta["bad_evals"] >= settings.patience:
                return f"early stop ({settings.patience} evaluations without improvement)"
            if step >= settings.steps:
                return ""
            with stops.held():          # half an update could not be resumed: a stop waits for the step's end
                record = _train_step(model, params, optimizer, order, corpus, settings, step, scaler)
                meta["history"].append(record)
                if scaler is not None:                      # resuming continues with the same scale
                    meta["loss_scaler"] = asdict(scaler)
            events.stepped(record, order.epoch)


def _train_step(model: Qwen3Model, params: dict[str, np.ndarray], optimizer: training.AdamW, order: WindowOrder,
                corpus: Corpus, settings: Settings, step: int, scaler: mixed.LossScaler | None) -> dict[str, Any]:
    """One optimizer step (the step-th, from 0); returns its record for the history.

    FP16 with loss scaling (scaler given): the gradients come back multiplied by the loss scale and are
    divided again before clipping; a step whose gradients overflowed is skipped (no update, its record
    says so) and the scale adapts. The record keeps the scale used and the scaler's event, if any.
    """
    started = time.perf_counter()
    lr = training.learning_rate(step, settings.lr, settings.warmup, settings.schedule_steps)
    batch = order.next_batch(corpus.train, settings.batch_size)              # [B, T+1]
    scale = scaler.scale if scaler is not None else 1.0
    loss, grads = training.loss_and_accumulated_gradients(model, batch, settings.grad_accum,
                                                          settings.threads or usable_cores(), settings.shards,
                                                          settings.recompute, settings.precision, scale)
    record: dict[str, Any] = {"step": step + 1, "loss": loss, "lr": lr}
    finite = True
    if scaler is not None:
        finite = scaler.unscale(grads)
        record["loss_scale"] = scale
        if event := scaler.update(finite):
            record["loss_scale_event"] = event
    if finite:
        record["grad_norm"] = training.clip_gradients(grads, settings.clip)
        optimizer.update(params, grads, lr)
    else:                                           # overflow: this step's gradients are unusable
        record.update(grad_norm=None, skipped=True)
    record["tokens_per_s"] = settings.batch_size * settings.context / (time.perf_counter() - started)
    return record


def _record_evaluation(meta: dict[str, Any], step: int, result: dict[str, Any]) -> bool:
    """Add an evaluation to the run's state; returns whether it is the best so far."""
    meta["evals"].append({"step": step, **result})
    improved = meta["best_loss"] is None or result["loss_per_token"] < meta["best_loss"]
    meta["bad_evals"] = 0 if improved else meta["bad_evals"] + 1
    if improved:
        meta["best_loss"] = result["loss_per_token"]
    return improved


def validate(model: Qwen3Model, corpus: Corpus, context: int) -> dict[str, Any]:
    """Loss on the validation documents, with the inference forward pass (what generation runs)."""
    return evaluation.score_text(model.forward, corpus.validation, corpus.validation_characters, context).summary()
