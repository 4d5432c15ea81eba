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
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import signal
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from . import chats, evaluation, lora, mixed, run_folder, step as training
from ..files.checkpoint import save_checkpoint, write_atomically
from ..files.model_files import ModelFiles, open_model
from ..files.tokenizer import Tokenizer
from ..core.config import Qwen3Config, expected_tensors, layer_tensors
from .data import END_OF_TEXT, END_OF_TEXT_ID
from ..errors import QwenNPError
from ..engine.budget import context_for
from ..engine.memory import ResidentPeak, training_memory, training_total
from ..core.ablations import model_class
from ..core.model import LayerWeights, Qwen3Model
from ..engine.runtime import steady_threads, usable_cores
from .settings import KEPT_ON_RESUME, NOT_BIT_EXACT, PRESET_CONFIGS, PRESET_SETTINGS, RunEvents, Settings, capped_warmup

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
    layers = [LayerWeights(**{key: params[spec.name.format(i=i)] for key, spec in layer_tensors(config).items()})
              for i in range(config.num_hidden_layers)]
    embed = params["model.embed_tokens.weight"]
    head = embed if config.tie_word_embeddings else params["lm_head.weight"]
    return model_class(config)(config, embed, layers, params["model.norm.weight"], head)


def hf_config(model_config: dict[str, Any]) -> dict[str, Any]:
    """A complete config.json that transformers and qwen_np both load."""
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
            "attention_dropout": 0.0, "hidden_act": "silu", "initializer_range": 0.02, "rms_norm_eps": 1e-6,
            "rope_theta": 1_000_000.0, "rope_scaling": None, "use_sliding_window": False, "sliding_window": None,
            "bos_token_id": END_OF_TEXT_ID, "eos_token_id": END_OF_TEXT_ID, "torch_dtype": "bfloat16",
            "use_cache": True, **model_config}


# --- Checkpoints ------------------------------------------------------------------------------------


# The safetensors header's metadata: the run's state (JSON), and a SHA-256 of it and of every tensor.
STATE_KEY, DIGEST_KEY = "qwen_np_training", "qwen_np_sha256"


def save_state(path: Path, params: dict[str, np.ndarray], optimizer: training.AdamW, meta: dict[str, Any]) -> None:
    """Weights, AdamW moments and the run's state (JSON in the safetensors header) in one file.

    Written atomically (checkpoint.write_atomically): a crash, a full disk or a power loss leaves the
    previous checkpoint or the new one, never half of one. The header also holds a SHA-256 of the state
    and of every tensor, so that load_state tells a damaged file (one flipped bit, in a weight or in a
    loss of the history) from the one written.
    """
    from safetensors.numpy import save_file

    tensors = {f"param/{n}": p for n, p in params.items()}
    tensors.update({f"adam_m/{n}": m for n, m in optimizer.m.items()})
    tensors.update({f"adam_v/{n}": v for n, v in optimizer.v.items()})
    state = json.dumps({**meta, "optimizer_step": optimizer.step})
    metadata = {STATE_KEY: state, DIGEST_KEY: _digest(state, tensors)}
    write_atomically(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def load_state(path: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray], dict[str, Any]]:
    """(params, adam_m, adam_v, meta) from a file written by save_state. A QwenNPError naming the file if it
    is missing, is not such a checkpoint, or is damaged: unreadable, or not byte for byte what was written
    (its SHA-256; a file written before checkpoints kept one is only checked for its format)."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise QwenNPError(f"{path}: not found")
    tensors: dict[str, np.ndarray] = {}
    try:
        with safe_open(str(path), framework="numpy") as f:
            metadata = f.metadata() or {}
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
        state = metadata[STATE_KEY]
        meta = json.loads(state)
    except KeyError:
        raise QwenNPError(f"{path}: damaged, or not a qwen_np training checkpoint (its header holds no run "
                          "state)") from None
    except (SafetensorError, ValueError, RecursionError, OSError) as bad:
        raise QwenNPError(f"{path}: damaged, not a readable checkpoint ({_first_line(bad)})") from None
    if not isinstance(meta, dict):
        raise QwenNPError(f"{path}: not a qwen_np training checkpoint (its run state is not a JSON object)")
    written = metadata.get(DIGEST_KEY)
    before_digests = written is None and "data_sha256" not in meta     # a checkpoint of an earlier qwen_np
    if not before_digests and written != _digest(state, tensors):
        raise QwenNPError(f"{path}: damaged: its bytes are not those written (their SHA-256 differs from the one "
                          "saved with them)")
    groups: dict[str, dict[str, np.ndarray]] = {"param": {}, "adam_m": {}, "adam_v": {}}
    for key, tensor in tensors.items():
        group, _, name = key.partition("/")
        if group not in groups:
            raise QwenNPError(f"{path}: not a qwen_np training checkpoint (tensor {key!r})")
        groups[group][name] = tensor
    return groups["param"], groups["adam_m"], groups["adam_v"], meta


def _digest(state: str, tensors: dict[str, np.ndarray]) -> str:
    """SHA-256 of a checkpoint's state (its JSON) and of its tensors in name order (name, dtype, shape, bytes)."""
    digest = hashlib.sha256(state.encode())
    for name in sorted(tensors):
        tensor = np.ascontiguousarray(tensors[name])
        digest.update(f"\0{name}\0{tensor.dtype.str}\0{tensor.shape}\0".encode())
        digest.update(tensor.reshape(-1).view(np.uint8).data)
    return digest.hexdigest()


def _first_line(bad: Exception) -> str:
    text = str(bad).strip()
    return text.splitlines()[0] if text else type(bad).__name__


def export_model(folder: Path, config_json: dict[str, Any], params: dict[str, np.ndarray], tokenizer_folder: Path) -> Path:
    """A Hugging Face Qwen3 folder: config.json, BF16 model.safetensors, tokenizer, generation_config.json."""
    save_checkpoint(folder, config_json, [params], dtype="BF16")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tokenizer_folder / name).read_bytes())
    generation = {"bos_token_id": END_OF_TEXT_ID, "eos_token_id": END_OF_TEXT_ID, "pad_token_id": END_OF_TEXT_ID,
                  "do_sample": True, "temperature": 0.8, "top_k": 50, "top_p": 0.95}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return folder


# --- The run's state --------------------------------------------------------------------------------


@dataclass
class RunState:
    """Everything a run has done and needs to go on, besides its tensors: what a checkpoint's header holds
    (as JSON: to_json, from_json), so that a resumed run continues bit for bit."""

    config: dict[str, Any]                      # the model's config.json
    settings: Settings
    data: str                                   # --data: "shakespeare" or a text file
    data_sha256: str | None = None              # of the text it trains and validates on (Corpus.sha256); None in
                                                # checkpoints written before it was kept
    history: list[dict[str, Any]] = field(default_factory=list)   # one record per optimizer step (_train_step)
    evals: list[dict[str, Any]] = field(default_factory=list)     # one per validation: step and TextScore.summary()
    best_loss: float | None = None              # the lowest validation loss per token so far
    bad_evals: int = 0                          # validations since it was reached (--patience)
    epoch: int = 0                              # the data order's place (WindowOrder) at the last checkpoint:
    position: int = 0                           # its epoch and the windows of it used
    loss_scaler: mixed.LossScaler | None = None     # fp16 with loss scaling: a resumed run goes on with its scale
    model: str | None = None                    # --model: the checkpoint the run started from (None: a preset or config)
    base_sha256: str | None = None              # of its weight files (ModelFiles.weights_sha256): a resumed run checks them
    adapters: dict[str, Any] | None = None      # a LoRA run's lora.LoraSettings and "memory" (how its frozen base is held)
    val: str | None = None                      # --val: the chat file that validates (None: --data's last 5%)

    @property
    def step(self) -> int:
        """Optimizer steps taken (skipped FP16 steps included)."""
        return len(self.history)

    def evaluated(self, step: int) -> bool:
        """Whether the validation after `step` steps is recorded."""
        return bool(self.evals) and self.evals[-1]["step"] == step

    def record_evaluation(self, step: int, result: dict[str, Any]) -> bool:
        """Add a validation after `step` steps; returns whether it is the best so far."""
        self.evals.append({"step": step, **result})
        improved = self.best_loss is None or result["loss_per_token"] < self.best_loss
        self.bad_evals = 0 if improved else self.bad_evals + 1
        if improved:
            self.best_loss = result["loss_per_token"]
        return improved

    def to_json(self) -> dict[str, Any]:
        meta = {"history": self.history, "evals": self.evals, "best_loss": self.best_loss, "bad_evals": self.bad_evals,
                "order": {"epoch": self.epoch, "position": self.position}, "data": self.data,
                "data_sha256": self.data_sha256, "settings": asdict(self.settings), "config": self.config}
        if self.loss_scaler is not None:
            meta["loss_scaler"] = asdict(self.loss_scaler)
        if self.model is not None:
            meta.update(model=self.model, base_sha256=self.base_sha256, lora=self.adapters, val=self.val)
        return meta

    @classmethod
    def from_json(cls, meta: dict[str, Any]) -> "RunState":
        """The state to_json wrote (save_state's "optimizer_step", the optimizer's, is left to the caller)."""
        scaler = meta.get("loss_scaler")
        return cls(meta["config"], Settings(**meta["settings"]), meta["data"], meta.get("data_sha256"), meta["history"],
                   meta["evals"], meta["best_loss"], meta["bad_evals"], meta["order"]["epoch"], meta["order"]["position"],
                   None if scaler is None else mixed.LossScaler(**scaler), meta.get("model"), meta.get("base_sha256"),
                   meta.get("lora"), meta.get("val"))

    @property
    def lora_settings(self) -> lora.LoraSettings | None:
        """The run's adapters (None: every weight is trained)."""
        if self.adapters is None:
            return None
        saved = {key: value for key, value in self.adapters.items() if key != "memory"}
        return lora.LoraSettings(**{**saved, "targets": tuple(saved["targets"])})

    @property
    def lora_memory(self) -> str:
        """How a LoRA run holds its frozen base (engine.memory.MODES; fp32 for every other run)."""
        return "fp32" if self.adapters is None else str(self.adapters["memory"])


# --- The run ----------------------------------------------------------------------------------------


@dataclass
class Corpus:
    """What a run trains and validates on."""

    train: np.ndarray                    # token ids of the training text
    validation: list[np.ndarray]         # documents, each starting with <|endoftext|>
    validation_characters: int
    sha256: str                          # of the training and validation text (corpus_sha256)


def load_corpus(data: str, out: Path, vocab_size: int, resume: bool, sha256: str | None = None,
                tokenizer: Tokenizer | None = None) -> Corpus:
    """Train (or, resuming, reload) the tokenizer in `out`, and encode the training and validation text.
    tokenizer (a run from --model): the model's own encodes the text instead, each document after its
    <|endoftext|>.

    --data shakespeare uses data.py's fixed by-play splits. A text FILE is split at a line boundary:
    the last 5% of its lines validate, the rest train. sha256 (a resumed run's): the text must be the
    one the run began on, or a QwenNPError names --data before any work is done.
    """
    from . import data as corpora

    if data == "shakespeare":
        train_text, valid_text = corpora.shakespeare_split("train"), corpora.shakespeare_split("validation")
    else:
        lines = corpora.read_text(data).splitlines(keepends=True)
        cut = len(lines) - max(1, len(lines) // 20)
        train_text, valid_text = "".join(lines[:cut]), "".join(lines[cut:])
        if not train_text.strip() or not valid_text.strip():
            raise QwenNPError(f"{data} is too short to split into training and validation text", "data")
    digest = corpus_sha256(train_text, valid_text)
    if sha256 is not None and digest != sha256:
        raise QwenNPError(f"{data} is not the text the run in {out} began on (SHA-256 {digest[:16]}..., the "
                          f"checkpoint's {sha256[:16]}...: edited or replaced since); resuming would train on other "
                          "text with the old text's tokenizer: put the original back, or start a new run", "data")
    if tokenizer is None:
        if not resume:
            corpora.save_tokenizer(corpora.train_tokenizer(train_text, vocab_size), out)
        tokenizer = Tokenizer.from_folder(out)
        if tokenizer.vocab_size != vocab_size:
            raise QwenNPError(f"{out}/tokenizer.json: {tokenizer.vocab_size} tokens, but the config's vocab_size is "
                              f"{vocab_size} (the text is too small for that many BPE merges?)")
    bpe = tokenizer.backend                                                  # encode_corpus's fast batch encoder
    separator = np.array([tokenizer.token_to_id(END_OF_TEXT)], dtype=np.int32)
    train_docs = [corpora.encode_corpus(bpe, doc) for doc in evaluation.documents(train_text)]
    train = np.concatenate([part for doc in train_docs for part in (separator, doc)])
    valid, characters = evaluation.encoded_documents(tokenizer, valid_text)
    return Corpus(train, valid, characters, digest)


def corpus_sha256(train_text: str, validation_text: str) -> str:
    """The SHA-256 of a run's text, its training and validation parts (as normalised: what is trained on)."""
    return hashlib.sha256(f"{len(train_text)}\0{train_text}{validation_text}".encode()).hexdigest()


def resolve_settings(overrides: dict[str, Any], preset: str | None, saved: dict[str, Any] | None) -> Settings:
    """The given settings (the command line's) over the saved run's (resuming) or the preset's, over
    Settings' defaults. overrides: Settings field -> value, None meaning not given."""
    given = {name for name, value in overrides.items() if value is not None}
    if {"steps", "epochs"} <= given:
        raise QwenNPError(f"{overrides['epochs']:g} and `steps` {overrides['steps']} both say how long the run is: "
                          "give one of them", "epochs")
    base = saved if saved is not None else PRESET_SETTINGS.get(preset or "", {})
    values = {f.name: overrides[f.name] if f.name in given else base.get(f.name, f.default) for f in fields(Settings)}
    if "epochs" in given:
        values["steps"] = 0          # counted from the data once it is read (epoch_steps), over a preset's or saved steps
    settings = Settings(**values)
    for name in ("batch_size", "context", "grad_accum", "eval_every", *(("steps",) if "steps" in given else ())):
        if getattr(settings, name) < 1:
            raise QwenNPError(f"must be at least 1, got {getattr(settings, name)}", name)
    if not settings.epochs > 0:
        raise QwenNPError(f"must be positive, got {settings.epochs:g}", "epochs")
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
    """What to run: a new run (from a preset, a config.json or a checkpoint) or the run in `out` resumed."""

    out: Path                               # checkpoints, tokenizer, exported model/ (created on the first write)
    resume: bool = False
    preset: str | None = None               # a key of PRESET_CONFIGS
    config: Path | None = None              # a Qwen3 config.json to train from scratch
    data: str | None = None                 # "shakespeare", a UTF-8 text file or a chat file (.jsonl) (None: the
                                            # run's own, resuming; else shakespeare)
    model: str | None = None                # a checkpoint to start from (folder, hub id or GGUF) instead of a preset
    lora: lora.LoraSettings | None = None   # train these adapters on --model, frozen (None: every weight)
    memory: str | None = None               # how a LoRA run holds its frozen base (engine.memory.MODES; default fp32)
    val: str | None = None                  # a chat file that validates (None: --data's last 5% of conversations)
    overrides: dict[str, Any] = field(default_factory=dict)   # Settings field -> value (None: not given)


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
    engine.memory.training_memory), and the peak RSS measured from the model's load through the last step."""

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
class TextData:
    """A text run's data and its place in the training windows (a chat run's: chats.ChatData)."""

    corpus: Corpus
    order: WindowOrder

    @property
    def sha256(self) -> str:
        return self.corpus.sha256

    def next_batch(self, batch_size: int) -> tuple[np.ndarray, None]:
        """The next batch_size windows [B, context + 1]; every token is learned (None: no mask)."""
        return self.order.next_batch(self.corpus.train, batch_size), None

    def validate(self, model: Qwen3Model) -> dict[str, Any]:
        """Loss on the validation documents, with the inference forward pass (what generation runs)."""
        return evaluation.score_text(model.forward, self.corpus.validation, self.corpus.validation_characters,
                                     self.order.context).summary()

    def describe(self) -> str:
        return f"{len(self.corpus.train):,} tokens"


@dataclass
class Run:
    """A run in memory: its state and what a step acts on. The trained weights are `params`: the model's own
    arrays (every weight, or a LoRA run's adapters alone), updated in place by the optimizer."""

    state: RunState
    params: dict[str, np.ndarray]
    model: Qwen3Model                       # model_from_parameters(params), or the frozen base with its adapters
    optimizer: training.AdamW
    data: TextData | chats.ChatData
    out: Path                               # where save() writes

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
        state, saved, adam_m, adam_v, optimizer_step = _resumed(spec, notes, left)
        read = sum(array.nbytes for group in (saved, adam_m, adam_v) for array in group.values())
    else:
        read = 0
        if last.exists():
            raise QwenNPError(f"{out} already holds a run ({LAST}); pass `resume` or another folder", "out")
        state = _new_state(spec)
    settings = state.settings
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
    if not spec.resume:
        (out / "config.json").write_text(json.dumps(state.config, indent=2) + "\n")
    optimizer = training.adamw_for(params, weight_decay=settings.weight_decay)
    if spec.resume:
        optimizer.m, optimizer.v, optimizer.step = adam_m, adam_v, optimizer_step
    scaling = settings.precision == "fp16" and settings.loss_scaling
    state.loss_scaler = (state.loss_scaler or mixed.LossScaler()) if scaling else None
    run = Run(state, params, model, optimizer, data, out)
    # The tape is FP32 arrays whatever the precision (NumPy keeps the rounded values as FP32).
    adapters = state.lora_settings
    row = longest_row(data, settings.context)
    estimate = training_memory(config, settings.batch_size // settings.grad_accum, row,
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
            f"{settings.batch_size} conversations a step, each padded to its batch's longest, at most {row} tokens")
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


def _schedule(spec: RunSpec, settings: Settings, data: TextData | chats.ChatData, notes: list[str]) -> str:
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
    what = "conversations" if isinstance(data, chats.ChatData) else "windows"
    epochs = settings.steps * settings.batch_size / sequences
    return (f"{settings.steps:,} steps of {settings.batch_size} ({epochs:.3g} epochs of {sequences:,} {what}), "
            f"warmup {settings.warmup}, peak lr {settings.lr:g}")


def epoch_steps(epochs: float, sequences: int, batch_size: int) -> int:
    """Optimizer steps that take `epochs` passes over `sequences` rows, `batch_size` a step (the last one whole)."""
    return max(1, math.ceil(epochs * sequences / batch_size))


def sequences_per_epoch(data: TextData | chats.ChatData) -> int:
    """The rows an epoch over the run's data has: its conversations, or windows of the text (WindowOrder's,
    counted from offset 0: an epoch's offset takes at most one away)."""
    if isinstance(data, chats.ChatData):
        return len(data.train)
    return max(1, (len(data.corpus.train) - 1) // data.order.context)


def longest_row(data: TextData | chats.ChatData, context: int) -> int:
    """The most tokens a row of the run's batches learns from: the context, or, for chats, the longest
    conversation's tokens less one (chats.padded_rows pads a batch to its longest, cut at context + 1 tokens:
    its inputs are all but the last). What the memory plan sizes the step's activations and logits by."""
    if isinstance(data, TextData):
        return context
    return max(1, min(context, max(len(chat.ids) for chat in data.train) - 1))


# --- Starting from a checkpoint (--model) and LoRA -----------------------------------------------------


def _new_state(spec: RunSpec) -> RunState:
    """A new run's state: a preset's or config's model from random weights, or --model's (every weight
    trained, or --lora's adapters on it frozen)."""
    settings = resolve_settings(spec.overrides, spec.preset, None)
    if spec.model is None:
        return RunState(hf_config(_model_config(spec)), settings, spec.data or "shakespeare")
    adapters = None
    if spec.lora is not None:
        adapters = {**asdict(spec.lora.check()), "memory": spec.memory or "fp32"}
    elif spec.memory not in (None, "fp32"):
        raise QwenNPError(f"{spec.memory}: full fine-tuning updates every weight, held in FP32; a frozen base "
                          "(`lora`) may be held as bf16, int8, q8_0 or q4_0", "memory")
    return RunState(open_model(spec.model).config_json(), settings, spec.data or "shakespeare", model=spec.model,
                    adapters=adapters, val=spec.val)


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
                          f"({state.model}); name it with --model", "model")
    if state.model is not None and source != state.model:
        notes.append(f"note: `model` {source}: the run's base, read from there (it began on {state.model})")
    state.model, state.base_sha256 = source, digest
    return base


def _data(spec: RunSpec, state: RunState, config: Qwen3Config, base: ModelFiles | None,
          notes: list[str]) -> TextData | chats.ChatData:
    """The run's text or chat file, read, checked to be the one it began on (resuming), and placed in its order."""
    settings = state.settings
    data = spec.data or state.data
    if spec.resume and spec.data is None and data != "shakespeare" and not Path(data).exists():
        raise QwenNPError(f"{data}, the run's text, is not there (moved? name its new place with `data`)", "data")
    val = spec.val or state.val
    result: TextData | chats.ChatData
    if chats.is_chat_file(Path(data)):
        if base is None:
            raise QwenNPError(f"{data}: a chat file trains a model from `model` (its tokenizer and chat template)",
                              "data")
        tokenizer = base.tokenizer
        train, validation, digest = chats.held_out(tokenizer, Path(data), None if val is None else Path(val))
        if state.data_sha256 is not None and digest != state.data_sha256:
            raise QwenNPError(f"{data}{' or ' + val if val else ''} is not the chat data the run in {spec.out} began on "
                              f"(SHA-256 {digest[:16]}..., the checkpoint's {state.data_sha256[:16]}...: edited or "
                              "replaced since): put the original back, or start a new run", "data")
        order = chats.ConversationOrder(len(train), settings.seed, state.epoch, state.position)
        pad = tokenizer.pad_token_id
        result = chats.ChatData(train, validation, digest, order, settings.context,
                                tokenizer.eos_token_id if pad is None else pad)
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


# --- Resuming ---------------------------------------------------------------------------------------


def _resumed(spec: RunSpec, notes: list[str], left: str | None
             ) -> tuple[RunState, dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray], int]:
    """The run in spec.out as its last checkpoint left it, with the flags given again applied (a notice added
    to `notes` for those that end bit-exactness) or refused (NOT_BIT_EXACT, KEPT_ON_RESUME); (state, params,
    adam_m, adam_v, the optimizer's step). A missing or damaged checkpoint is one QwenNPError saying what the
    folder holds and whether best.safetensors can take its place. (--data: _run checks the text's hash.)"""
    out, last = spec.out, spec.out / LAST
    if not last.exists():
        raise QwenNPError(_nothing_to_resume(out, left))
    try:
        state, params, adam_m, adam_v, optimizer_step = read_checkpoint(last)
    except QwenNPError as bad:
        raise QwenNPError(f"{bad}; {_fallback(out)}", "resume") from None
    if spec.preset is not None or spec.config is not None:
        given = "preset" if spec.preset is not None else "config"
        wanted = hf_config(_model_config(spec))
        differs = sorted(key for key in wanted.keys() | state.config.keys() if wanted.get(key) != state.config.get(key))
        if differs:
            raise QwenNPError(f"not the model of the run in {out} ({differs[0]} {wanted.get(differs[0])}, the run's "
                              f"{state.config.get(differs[0])}); a resumed run keeps its model: drop `{given}`", given)
    if spec.model is not None and state.model is None:
        raise QwenNPError(f"the run in {out} trains a model from random weights (its `preset` or `config`); drop `model`",
                          "model")
    if spec.lora is not None and spec.lora.check() != state.lora_settings:
        raise QwenNPError(f"the run in {out} trains {_adapters(state.lora_settings)}, which a resumed run keeps (its "
                          "checkpoints hold those); drop `lora` and its settings, or start a new run", "lora")
    if spec.memory is not None and spec.memory != state.lora_memory:
        raise QwenNPError(f"the run in {out} holds its frozen base as {state.lora_memory}, which a resumed run keeps (its "
                          "products, so its updates, depend on it); drop `memory`", "memory")
    saved = state.settings
    changed = {name: value for name, value in spec.overrides.items()
               if value is not None and value != getattr(saved, name)}
    for name, why in KEPT_ON_RESUME.items():
        if name in changed:
            raise QwenNPError(f"the run in {out} has `{name}` {getattr(saved, name)}, which a resumed run keeps "
                              f"({why}); drop `{name}`, or start a new run", name)
    overrides = dict(spec.overrides)
    if changed.keys() & {"batch_size", "grad_accum"} and "shards" not in changed:
        overrides["shards"] = 0                      # rows of another size: cut into shards chosen again
    state.settings = resolve_settings(overrides, None, asdict(saved))
    inexact = [name for name in NOT_BIT_EXACT if getattr(state.settings, name) != getattr(saved, name)]
    if not state.settings.decay_steps:              # the cosine schedule spans --steps: it changes with them
        inexact += [name for name in ("steps", "epochs") if name in changed]
    if inexact:
        given = ", ".join(f"`{name}` {getattr(state.settings, name)} (was {getattr(saved, name)})" for name in inexact)
        notes.append(f"note: {given}: applied; the run goes on from step {state.step}, but is no longer bit for bit "
                     "the run it was")
    return state, params, adam_m, adam_v, optimizer_step


def read_checkpoint(path: Path) -> tuple[RunState, dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray], int]:
    """A training checkpoint read and checked (load_state, and a state and weights that fit together):
    (state, params, adam_m, adam_v, the optimizer's step); a QwenNPError naming the file."""
    params, adam_m, adam_v, meta = load_state(path)
    try:
        state, optimizer_step = RunState.from_json(meta), int(meta["optimizer_step"])
        config = Qwen3Config.from_dict(state.config, source=str(path))
        adapters = state.lora_settings
    except (KeyError, TypeError, ValueError, AttributeError) as bad:
        raise QwenNPError(f"{path}: not a qwen_np training checkpoint (its run state: {_first_line(bad)})") from None
    trained = (expected_tensors(config) if adapters is None else
               lora.adapter_shapes(config, adapters.rank, adapters.targets))     # a LoRA run's: its adapters alone
    shapes = {name: tuple(shape) for name, shape in trained.items()}
    for group in (params, adam_m, adam_v):
        if {name: tensor.shape for name, tensor in group.items()} != shapes:
            raise QwenNPError(f"{path}: not a qwen_np training checkpoint (its tensors are not those of its config)")
    return state, params, adam_m, adam_v, optimizer_step


def _adapters(settings: lora.LoraSettings | None) -> str:
    """A run's LoRA settings, each named in backticks for the front end to word ("every weight" for a full run)."""
    if settings is None:
        return "every weight (no `lora`)"
    return (f"`rank` {settings.rank} `alpha` {settings.alpha:g} `targets` {','.join(settings.targets)} "
            f"`dropout` {settings.dropout:g}")


def _fallback(out: Path) -> str:
    """What best.safetensors offers when last.safetensors is missing or damaged (a clause of one line)."""
    best = out / BEST
    if not best.exists():
        return f"there is no {BEST} to fall back on: remove {LAST} and start the run again without --resume"
    try:
        state = read_checkpoint(best)[0]
    except QwenNPError as bad:
        return f"{BEST} cannot take its place ({bad}): remove both and start the run again without --resume"
    return (f"{best} is intact (step {state.step}, validation loss {state.best_loss:.4f} per token): copy it over "
            f"{LAST} to resume from step {state.step}")


def _nothing_to_resume(out: Path, left: str | None) -> str:
    """--resume's message for a folder without last.safetensors: what the folder holds instead."""
    held = sorted(entry.name for entry in out.iterdir() if entry.name != run_folder.LOCK)
    if (out / BEST).exists():
        return f"--resume: {out} holds no {LAST}; {_fallback(out)}"
    if not held:
        return f"--resume: {out} holds no earlier run (it is empty); start one without --resume"
    if left is not None:
        how = (f"the run there (PID {left or '?'}) was killed before its first checkpoint (its {run_folder.LOCK} was still "
               "there)")
    else:
        how = "no run there reached its first checkpoint"
    return f"--resume: {out} holds no {LAST} to resume: {how}; it holds {', '.join(held)}; start it again without --resume"


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
    batch, learned = run.data.next_batch(settings.batch_size)                       # [B, T+1] each
    scale = scaler.scale if scaler is not None else 1.0
    loss, grads = training.loss_and_accumulated_gradients(run.model, batch, settings.grad_accum,
                                                          settings.threads or usable_cores(), settings.shards,
                                                          settings.recompute, settings.precision, scale, learned,
                                                          run.dropout(step))
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
