"""What to run (RunSpec: a new run from a preset, a config.json or a checkpoint, or the run in a folder
resumed) and the settings it runs with: the command line's over the saved run's or the preset's
(resolve_settings), and the model config a preset or config.json names (model_config)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from . import lora, mixed, rollouts
from ..engine.runtime import usable_cores
from ..errors import QwenNPError
from .settings import PRESET_CONFIGS, PRESET_SETTINGS, Settings


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
    if not settings.blas_threads:    # the cores the shards leave (a batch of one row: every core in its products)
        settings.blas_threads = max(1, (settings.threads or usable_cores()) // settings.shards)
    if settings.shards < 0 or rows % settings.shards:
        raise QwenNPError(f"{settings.shards} does not divide the {rows} rows of a micro-batch", "shards")
    return settings


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
    dpo: float | None = None                # DPO's beta: `data` is preference pairs (preferences.py; None: not DPO)
    grpo: rollouts.GrpoSettings | None = None   # a GRPO run's prompts, reward and loss (None: not GRPO)
    sampler: rollouts.Sampler | None = None     # how a GRPO run samples (the command's, on qwen_np/generation)


def model_config(spec: RunSpec) -> dict[str, Any]:
    if spec.config is not None:
        from ..core.config import read_json_object
        return read_json_object(spec.config)
    if spec.preset not in PRESET_CONFIGS:
        raise QwenNPError(f"unknown {spec.preset!r}; expected one of {', '.join(sorted(PRESET_CONFIGS))}", "preset")
    return dict(PRESET_CONFIGS[spec.preset])
