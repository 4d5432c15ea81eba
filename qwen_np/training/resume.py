"""Resuming a run (RunSpec.resume): the state its last checkpoint left, with each flag given again kept,
applied with a notice or refused (settings.KEPT_ON_RESUME, NOT_BIT_EXACT); and, when there is nothing to
resume or the checkpoint is damaged, one line saying what the folder holds and whether best.safetensors
can take its place."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np

from . import lora, run_folder
from ..errors import QwenNPError
from .parameters import hf_config
from .run_spec import RunSpec, model_config, resolve_settings
from .run_state import BEST, LAST, RunState, read_checkpoint
from .settings import KEPT_ON_RESUME, NOT_BIT_EXACT


def resumed(spec: RunSpec, notes: list[str], left: str | None
             ) -> tuple[RunState, dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray], int]:
    """The run in spec.out as its last checkpoint left it, with the flags given again applied (a notice added
    to `notes` for those that end bit-exactness) or refused (NOT_BIT_EXACT, KEPT_ON_RESUME); (state, params,
    adam_m, adam_v, the optimizer's step). A missing or damaged checkpoint is one QwenNPError saying what the
    folder holds and whether best.safetensors can take its place. (--data: _run checks the text's hash.)"""
    out, last = spec.out, spec.out / LAST
    if not last.exists():
        raise QwenNPError(_nothing_to_resume(out, left), "resume")
    try:
        state, params, adam_m, adam_v, optimizer_step = read_checkpoint(last)
    except QwenNPError as bad:
        raise QwenNPError(f"{bad}; {_fallback(out)}", "resume") from None
    if spec.preset is not None or spec.config is not None:
        given = "preset" if spec.preset is not None else "config"
        wanted = hf_config(model_config(spec))
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
    if spec.dpo is not None and spec.dpo != state.dpo:
        kind = "is not a DPO run" if state.dpo is None else f"is a DPO run with beta {state.dpo:g}"
        raise QwenNPError(f"the run in {out} {kind}, which a resumed run keeps; drop `dpo` and `beta`", "dpo")
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
        if "blas_threads" not in changed:
            overrides["blas_threads"] = 0            # and the threads each shard's products run on, with them
    state.settings = resolve_settings(overrides, None, asdict(saved))
    inexact = [name for name in NOT_BIT_EXACT if getattr(state.settings, name) != getattr(saved, name)]
    if not state.settings.decay_steps:              # the cosine schedule spans --steps: it changes with them
        inexact += [name for name in ("steps", "epochs") if name in changed]
    if inexact:
        given = ", ".join(f"`{name}` {getattr(state.settings, name)} (was {getattr(saved, name)})" for name in inexact)
        notes.append(f"note: {given}: applied; the run goes on from step {state.step}, but is no longer bit for bit "
                     "the run it was")
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
        return f"there is no {BEST} to fall back on: remove {LAST} and start the run again without `resume`"
    try:
        state = read_checkpoint(best)[0]
    except QwenNPError as bad:
        return f"{BEST} cannot take its place ({bad}): remove both and start the run again without `resume`"
    return (f"{best} is intact (step {state.step}, validation loss {state.best_loss:.4f} per token): copy it over "
            f"{LAST} to resume from step {state.step}")


def _nothing_to_resume(out: Path, left: str | None) -> str:
    """`resume`'s message for a folder without last.safetensors: what the folder holds instead."""
    held = sorted(entry.name for entry in out.iterdir() if entry.name != run_folder.LOCK)
    if (out / BEST).exists():
        return f"{out} holds no {LAST}; {_fallback(out)}"
    if not held:
        return f"{out} holds no earlier run (it is empty); start one without `resume`"
    if left is not None:
        how = (f"the run there (PID {left or '?'}) was killed before its first checkpoint (its {run_folder.LOCK} was still "
               "there)")
    else:
        how = "no run there reached its first checkpoint"
    return f"{out} holds no {LAST} to resume: {how}; it holds {', '.join(held)}; start it again without `resume`"
