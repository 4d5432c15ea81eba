"""A run's state and its checkpoint files: RunState (everything a run has done and needs to go on, its
records of every step and validation), the checkpoint that holds it with the weights and AdamW's moments
(save_state, load_state, read_checkpoint: LAST and BEST in the run's folder, each with a SHA-256 of its
bytes), and the Hugging Face folder a preset's or config's run exports (export_model)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import lora, mixed, step as training
from ..core.config import Qwen3Config, expected_tensors
from ..errors import QwenNPError
from ..files.checkpoint import save_checkpoint, write_atomically
from .data import END_OF_TEXT_ID
from .settings import Settings


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
    dpo: float | None = None                    # --dpo's beta: a DPO run on preference pairs (None: not one)
    grpo: dict[str, Any] | None = None          # a GRPO run's rollouts.GrpoSettings (None: not one)

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
        if self.dpo is not None:
            meta["dpo"] = self.dpo
        if self.grpo is not None:
            meta["grpo"] = self.grpo
        return meta

    @classmethod
    def from_json(cls, meta: dict[str, Any]) -> "RunState":
        """The state to_json wrote (save_state's "optimizer_step", the optimizer's, is left to the caller)."""
        scaler = meta.get("loss_scaler")
        settings = Settings(**{"blas_threads": 1, **meta["settings"]})     # runs saved before it: BLAS on one thread
        return cls(meta["config"], settings, meta["data"], meta.get("data_sha256"), meta["history"],
                   meta["evals"], meta["best_loss"], meta["bad_evals"], meta["order"]["epoch"], meta["order"]["position"],
                   None if scaler is None else mixed.LossScaler(**scaler), meta.get("model"), meta.get("base_sha256"),
                   meta.get("lora"), meta.get("val"), meta.get("dpo"),
                   meta.get("grpo"))

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


LAST, BEST = "last.safetensors", "best.safetensors"


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
