"""The walkthrough's chapter "Ablations": chapter 11's model trained again with one piece of Qwen3 taken away
each time (config.ABLATION_CHOICES, and num_key_value_heads for MHA / GQA / MQA), its validation loss measured.

RECORDED like chapter 11 (too slow for every test run): `python tools/walkthrough/walkthrough_chapter_ablations.py` trains
every variant at every seed of SEEDS, one run after another, and writes docs/figures/ablations.json after each run:
a run already in the record (same variant, settings and seed) is kept, so an interrupted recording resumes where it
stopped and `--seeds` adds seeds to a record. The page is rendered from that record. tests/core/test_ablations.py
repeats the first steps of a few variants (check_first_steps) and fails when they no longer match the record.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
from threadpoolctl import threadpool_limits

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "tools" / "walkthrough"))

from qwen_np.core.config import ABLATION_CHOICES, PRESETS, Qwen3Config, parameter_count  # noqa: E402
from qwen_np.core.ablations import AblatedModel  # noqa: E402
from qwen_np.core.model import Qwen3Model  # noqa: E402
from qwen_np.engine.memory import kv_cache_bytes_per_token  # noqa: E402
from qwen_np.training import step as training, parameters, text_data  # noqa: E402
from walkthrough_chapter_train import CONFIG, VALIDATION_TOKENS, load_data, validation_loss  # noqa: E402
from walkthrough_common import code_block, two  # noqa: E402
import walkthrough_common  # noqa: E402

RECORD = REPO_ROOT / "docs" / "figures" / "ablations.json"
# Chapter 11's model and batches, for fewer steps: each run takes about half a minute of CPU time. A run's seed draws
# both its random weights and its batches' order; every variant is trained at each of SEEDS, and a difference is
# read only where the two variants' seeds do not overlap (the chapter's rule, `apart`).
RUN = {"steps": 350, "batch_size": 16, "context": 64, "lr": 1e-2, "warmup": 40, "weight_decay": 0.1,
       "clip": 1.0, "shards": 2, "eval_every": 50}
SEEDS = (0, 1, 2)
# QK-norm keeps attention logits bounded when the weights move fast: at chapter 11's rate it makes no
# difference, so it is also measured at a rate ten times higher (100-200-step trials at 0.05, 0.1 and 0.3
# chose it: the lowest where the run without it falls clearly behind).
HIGH_LR = 0.1
# Pre-norm is there for depth: at 2 layers post-norm trains well, at 8 without warmup it stalls (a 100-step
# trial each; more steps change neither).
DEEP = {"num_hidden_layers": 8}
DEEP_RUN = {"steps": 100, "warmup": 0}
# Each variant: a key, a name, what it changes in chapter 11's config.json, and in RUN.
VARIANTS: list[dict[str, Any]] = [
    {"key": "qwen3", "name": "Qwen3 (GQA: 4 query heads, 2 KV heads)", "config": {}},
    {"key": "no_rope", "name": "no RoPE", "config": {"use_rope": False}},
    {"key": "no_qk_norm", "name": "no QK-norm", "config": {"use_qk_norm": False}},
    {"key": "post_norm", "name": "post-norm", "config": {"norm_position": "post"}},
    {"key": "no_residual", "name": "no residual", "config": {"use_residual": False}},
    # Equal parameters: SwiGLU has 3 D F weights (gate, up, down), a GELU MLP 2 D F', so F' = 1.5 F.
    {"key": "gelu", "name": "GELU MLP (F' = 1.5 F)",
     "config": {"mlp_type": "gelu", "intermediate_size": CONFIG["intermediate_size"] * 3 // 2}},
    {"key": "mha", "name": "MHA (4 KV heads)", "config": {"num_key_value_heads": CONFIG["num_attention_heads"]}},
    {"key": "mqa", "name": "MQA (1 KV head)", "config": {"num_key_value_heads": 1}},
    {"key": "qwen3_high_lr", "name": f"Qwen3, lr {HIGH_LR:g}", "config": {}, "run": {"lr": HIGH_LR}},
    {"key": "no_qk_norm_high_lr", "name": f"no QK-norm, lr {HIGH_LR:g}", "config": {"use_qk_norm": False},
     "run": {"lr": HIGH_LR}},
    {"key": "deep_pre_norm", "name": "Qwen3, 8 layers, no warmup", "config": DEEP, "run": DEEP_RUN},
    {"key": "deep_post_norm", "name": "post-norm, 8 layers, no warmup", "config": {**DEEP, "norm_position": "post"},
     "run": DEEP_RUN},
]
# The runs each comparison is against (the figure's panels and the table's last columns).
REFERENCE = {"qwen3_high_lr": "qwen3_high_lr", "no_qk_norm_high_lr": "qwen3_high_lr",
             "deep_pre_norm": "deep_pre_norm", "deep_post_norm": "deep_pre_norm"}
# The order task, where position is the whole task: each row is COPIED random distinct token ids, a separator (id 0,
# never among them) and the same ids again, the loss over the copy only (the first half is unpredictable by design).
# Copying needs, at each token of the copy, where that token stood the first time and its right neighbour there: a
# lookup by relative position, which RoPE's q·k holds for every pair of positions; without RoPE only the causal mask
# tells positions apart. Fresh rows every step (the task has no data to overfit); the evaluation's rows come from a
# generator seeded apart from every run's. T = 2 COPIED.
COPY_RUN: dict[str, Any] = {"steps": 300, "batch_size": 16, "copied": 16, "lr": 1e-2, "warmup": 30, "weight_decay": 0.1,
                            "clip": 1.0, "shards": 2, "eval_every": 25, "eval_rows": 64, "eval_seed": 1_000_000}
VARIANTS_BY_KEY = {v["key"]: v for v in VARIANTS}
COPY_VARIANTS = [VARIANTS_BY_KEY["qwen3"], VARIANTS_BY_KEY["no_rope"]]
SEPARATOR = 0
CHECKED_STEPS = 5                 # the first steps the drift test repeats
CHECKED_VARIANTS = ("no_rope", "post_norm", "gelu")


def variant_config(variant: dict[str, Any]) -> dict[str, Any]:
    """The config.json a learner writes for this variant: chapter 11's with the variant's fields."""
    return {**CONFIG, **variant["config"]}


def model_config(variant: dict[str, Any]) -> Qwen3Config:
    return Qwen3Config.from_dict(parameters.hf_config(variant_config(variant)), source=variant["key"])


@dataclass
class Trial:
    """A new random model of a variant and its optimizer, for the run settings `base` (RUN or COPY_RUN) with the
    variant's changes; step(tokens, i) and copy_step(i) take the i-th optimizer step (from 0)."""

    variant: dict[str, Any]
    seed: int
    base: dict[str, Any] = field(default_factory=lambda: RUN)
    run: dict[str, Any] = field(init=False)                  # base with the variant's changes, at this seed
    model: Qwen3Model = field(init=False)
    params: dict[str, np.ndarray] = field(init=False)
    optimizer: training.AdamW = field(init=False)
    order: text_data.WindowOrder | None = None

    def __post_init__(self) -> None:
        self.run = {**self.base, **self.variant.get("run", {}), "seed": self.seed}
        self.params = parameters.init_parameters(model_config(self.variant), self.seed)
        self.model = parameters.model_from_parameters(model_config(self.variant), self.params)
        self.optimizer = training.adamw_for(self.params, weight_decay=self.run["weight_decay"])

    def step(self, tokens: np.ndarray, i: int) -> float:
        """Chapter 11's step on its text's next batch of windows."""
        self.order = self.order or text_data.WindowOrder(len(tokens), self.run["context"], self.seed)
        return self.update(self.order.next_batch(tokens, self.run["batch_size"]), i)             # [B, T+1]

    def copy_step(self, i: int) -> float:
        """The order task's step on fresh rows, drawn from (seed, i); the loss over the copy only."""
        rows = copy_rows(np.random.default_rng([self.seed, i]), self.run["batch_size"], self.run["copied"])
        return self.update(rows, i, learned=copy_targets(rows))

    def update(self, batch: np.ndarray, i: int, learned: np.ndarray | None = None) -> float:
        """Loss and gradients of batch [B, T+1] (over its `learned` tokens), clip, AdamW at the schedule's rate."""
        run = self.run
        loss, grads = training.loss_and_accumulated_gradients(self.model, batch, 1, threads=2, shards=run["shards"],
                                                              learned=learned)
        training.clip_gradients(grads, run["clip"])
        self.optimizer.update(self.params, grads, training.learning_rate(i, run["lr"], run["warmup"], run["steps"]))
        return loss


def copy_rows(rng: np.random.Generator, rows: int, copied: int) -> np.ndarray:
    """[rows, 2 copied + 1]: `copied` distinct random ids (never SEPARATOR), SEPARATOR, the same ids again."""
    ids = np.stack([rng.choice(np.arange(1, CONFIG["vocab_size"]), copied, replace=False) for _ in range(rows)])
    return np.concatenate([ids, np.full((rows, 1), SEPARATOR), ids], axis=1)


def copy_targets(rows: np.ndarray) -> np.ndarray:
    """[B, T+1] bool: the copy's tokens, the ones after the separator (each is predictable from the first half)."""
    copied = (rows.shape[1] - 1) // 2
    return np.arange(rows.shape[1])[None, :].repeat(len(rows), 0) > copied


def copy_scores(model: Qwen3Model, rows: np.ndarray) -> dict[str, float]:
    """The copy's mean cross-entropy (nats per token) and the share of its tokens the greedy guess gets right."""
    B, T = rows.shape[0], rows.shape[1] - 1
    logits = model.forward_batch(list(rows[:, :-1]), [None] * B).reshape(B, T, -1)[:, T // 2:]    # [B, T/2, V]
    targets = rows[:, T // 2 + 1:]                                                                 # [B, T/2]
    # log-softmax with the max subtracted first: exp of a raw logit overflows FP32 once a model is confident
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_p = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    return {"loss": float(-np.take_along_axis(log_p, targets[..., None], -1).mean()),
            "accuracy": float((logits.argmax(axis=-1) == targets).mean())}


def train_copy(variant: dict[str, Any], seed: int, progress: Callable[[str], None]) -> dict[str, Any]:
    """One run of the order task: COPY_RUN's steps, the copy scored on the evaluation rows every eval_every steps."""
    started, cpu_started = time.perf_counter(), cpu_seconds()
    trial, run = Trial(variant, seed, COPY_RUN), COPY_RUN
    rows = copy_rows(np.random.default_rng(run["eval_seed"]), run["eval_rows"], run["copied"])
    losses, evals = [], []
    for i in range(run["steps"] + 1):
        if i % run["eval_every"] == 0:
            evals.append({"step": i, **copy_scores(trial.model, rows)})
        if i < run["steps"]:
            losses.append(trial.copy_step(i))
    progress(f"copy, {variant['key']}, seed {seed}: copy loss {evals[-1]['loss']:.3f}, accuracy "
             f"{evals[-1]['accuracy']:.2f} ({time.perf_counter() - started:.0f} s)")
    return {"key": variant["key"], "seed": seed, "name": variant["name"], "config": variant_config(variant),
            "run": variant.get("run", {}), "first_losses": losses[:CHECKED_STEPS], "evals": evals,
            "final_loss": evals[-1]["loss"], "final_accuracy": evals[-1]["accuracy"], **timing(started, cpu_started)}


def largest_attention_logit(model: Qwen3Model, tokens: np.ndarray) -> float:
    """The largest score q.k / sqrt(Dh) of any head and layer on one validation window: what QK-norm bounds."""
    scores: list[np.ndarray] = []
    model.forward(tokens, trace=lambda name, value: scores.append(value) if name.endswith("self_attn.scores") else None)
    return max(float(np.max(np.where(np.isfinite(s), s, -np.inf))) for s in scores)


def train_variant(variant: dict[str, Any], seed: int, tokens: np.ndarray, validation: list[np.ndarray],
                  progress: Callable[[str], None]) -> dict[str, Any]:
    """One run: RUN's steps, validation every eval_every steps, and what the chapter shows of it."""
    started, cpu_started = time.perf_counter(), cpu_seconds()
    trial = Trial(variant, seed)
    run = trial.run
    losses, evals = [], []
    for i in range(run["steps"] + 1):
        if i % run["eval_every"] == 0:
            evals.append({"step": i, "loss": validation_loss(trial.model, validation)})
        if i < run["steps"]:
            losses.append(trial.step(tokens, i))
    model, config = trial.model, trial.model.config
    progress(f"{variant['key']}, seed {seed}: validation {evals[-1]['loss']:.3f} "
             f"({time.perf_counter() - started:.0f} s)")
    return {"key": variant["key"], "seed": seed, "name": variant["name"], "config": variant_config(variant),
            "run": variant.get("run", {}), "lr": run["lr"], "steps": run["steps"],
            "parameters": parameter_count(config), "kv_bytes_per_token": kv_cache_bytes_per_token(config),
            "first_losses": losses[:CHECKED_STEPS], "final_train_loss": float(np.mean(losses[-run["eval_every"]:])),
            "evals": evals, "final_loss": evals[-1]["loss"],
            "largest_attention_logit": largest_attention_logit(model, validation[0][:run["context"]]),
            **timing(started, cpu_started)}


def cpu_seconds() -> float:
    """This process's CPU time, user and system (its threads included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timing(started: float, cpu_started: float) -> dict[str, Any]:
    """A run's wall and CPU seconds and the load average at its end: on a shared machine the wall time is the
    machine's, the CPU time the run's."""
    return {"seconds": round(time.perf_counter() - started), "cpu_seconds": round(cpu_seconds() - cpu_started),
            "load_average": round(os.getloadavg()[0], 1)}


def unigram_loss(tokens: np.ndarray, validation: list[np.ndarray]) -> float:
    """The validation sample's loss under the training tokens' frequencies alone: a model that ignores the context."""
    counts = np.bincount(tokens, minlength=CONFIG["vocab_size"]) + 1.0                   # +1: no token has p = 0
    log_p = np.log(counts / counts.sum())
    targets = np.concatenate([doc[1:] for doc in validation])
    return float(-log_p[targets].mean())


Runs = dict[tuple[str, int], dict[str, Any]]        # a task's runs by (variant key, seed)


def kept_runs(recorded: list[dict[str, Any]], variants: list[dict[str, Any]]) -> Runs:
    """The recorded runs that today's variants would train the same way (same config and run changes)."""
    by_key = {v["key"]: v for v in variants}
    return {(r["key"], r["seed"]): r for r in recorded if r["key"] in by_key
            and r["config"] == variant_config(by_key[r["key"]]) and r["run"] == by_key[r["key"]].get("run", {})}


def record(out: Path, seeds: tuple[int, ...] = SEEDS, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Every variant at every seed, then the order task's, one run after another (about half a minute of CPU time
    each), `out` rewritten after each run; the runs `out` already holds are kept."""
    previous = json.loads(out.read_text(encoding="utf-8")) if out.is_file() else {}
    runs = kept_runs(previous.get("runs", []), VARIANTS)
    copies = kept_runs(previous.get("copy_task", {}).get("runs", []), COPY_VARIANTS)
    with tempfile.TemporaryDirectory() as name, threadpool_limits(limits=1):
        corpus, validation, _ = load_data(Path(name))
        rec = {"run": RUN, "seeds": list(seeds), "unigram_loss": unigram_loss(corpus.train, validation),
               "cores": os.cpu_count()}

        def save() -> dict[str, Any]:
            return write_record(out, rec, ordered(runs, VARIANTS, seeds), ordered(copies, COPY_VARIANTS, seeds))

        for variant in VARIANTS:
            for seed in (s for s in seeds if (variant["key"], s) not in runs):
                runs[variant["key"], seed] = train_variant(variant, seed, corpus.train, validation, progress)
                save()
        for variant in COPY_VARIANTS:
            for seed in (s for s in seeds if (variant["key"], s) not in copies):
                copies[variant["key"], seed] = train_copy(variant, seed, progress)
                save()
        # the page's `train` command, timed once (kept like a run; delete it from the record to time it again)
        rec["train_command"] = previous.get("train_command") or time_train_command(
            rec, sum(len(doc) - 1 for doc in corpus.validation))
        return save()


def ordered(runs: Runs, variants: list[dict[str, Any]], seeds: tuple[int, ...]) -> list[dict[str, Any]]:
    """The runs in the variants' order, each variant's in the seeds' order."""
    return [runs[v["key"], seed] for v in variants for seed in seeds if (v["key"], seed) in runs]


def write_record(out: Path, rec: dict[str, Any], runs: list[dict[str, Any]],
                 copies: list[dict[str, Any]]) -> dict[str, Any]:
    """The record with its runs so far, written to `out` through a temporary file (an interrupted write leaves the
    last one); its seconds are the sum of its runs' wall seconds."""
    full = walkthrough_common.rounded({**rec, "runs": runs, "copy_task": {"run": COPY_RUN, "runs": copies},
                                       "seconds": sum(r["seconds"] for r in runs + copies)})
    partial = out.with_suffix(".partial")
    partial.write_text(json.dumps(full, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    partial.replace(out)
    return full


def check_first_steps(recorded: dict[str, Any], keys: tuple[str, ...] = CHECKED_VARIANTS) -> None:
    """Repeat the first CHECKED_STEPS steps of these variants, each at another of the record's seeds, and of the
    order task's variants at its first seed; raise naming the first loss that differs beyond rounding."""
    seeds = recorded["seeds"]
    runs = {(r["key"], r["seed"]): r for r in recorded["runs"]}
    copies = {(r["key"], r["seed"]): r for r in recorded["copy_task"]["runs"]}
    with tempfile.TemporaryDirectory() as name, threadpool_limits(limits=1):
        corpus, _, _ = load_data(Path(name))
        for n, variant in enumerate(v for v in VARIANTS if v["key"] in keys):
            seed = seeds[n % len(seeds)]
            trial = Trial(variant, seed)
            same_losses(f"{variant['key']}, seed {seed}", [trial.step(corpus.train, i) for i in range(CHECKED_STEPS)],
                        runs[variant["key"], seed]["first_losses"])
        for variant in COPY_VARIANTS:
            trial = Trial(variant, seeds[0], COPY_RUN)
            same_losses(f"the order task's {variant['key']}, seed {seeds[0]}",
                        [trial.copy_step(i) for i in range(CHECKED_STEPS)], copies[variant["key"], seeds[0]]["first_losses"])


def same_losses(run: str, got: list[float], recorded: list[float]) -> None:
    """Raise naming the first step whose loss differs from the record's beyond its 4 digits and the BLAS kernel's."""
    for i, (now, want) in enumerate(zip(got, recorded, strict=True)):
        if not np.isclose(now, want, rtol=1e-3):
            raise AssertionError(f"{run}: the loss of step {i + 1} is {now:.6g} now, {want:.6g} in {RECORD.name}: "
                                 "re-record with `python tools/walkthrough/walkthrough_chapter_ablations.py`")


def notebook_code(keys: tuple[str, ...] = CHECKED_VARIANTS[:2]) -> str:
    """The chapter's notebook cell: two variants' first CHECKED_STEPS steps, as a reader types them over section 11's
    cell (its CONFIG and corpus), each a config.json with a field changed."""
    changes = {v["key"]: v["config"] for v in VARIANTS if v["key"] in keys}
    return f'''ablation_losses = {{}}           # the chapter's runs: python tools/walkthrough/walkthrough_chapter_ablations.py
for name, changes in {changes!r}.items():
    variant = Qwen3Config.from_dict(parameters.hf_config({{**CONFIG, **changes}}))
    variant_params = parameters.init_parameters(variant, seed={SEEDS[0]})
    ablated = parameters.model_from_parameters(variant, variant_params)    # the ablated layer (core/ablations.py)
    variant_optimizer = training.adamw_for(variant_params, weight_decay={RUN['weight_decay']})
    variant_order = text_data.WindowOrder(len(corpus.train), {RUN['context']}, seed={SEEDS[0]})
    variant_losses = []
    for step in range({CHECKED_STEPS}):
        windows = variant_order.next_batch(corpus.train, {RUN['batch_size']})              # [B, T+1]
        step_loss, step_grads = training.loss_and_accumulated_gradients(ablated, windows, 1, threads=2, shards={RUN['shards']})
        training.clip_gradients(step_grads, {RUN['clip']})
        rate = training.learning_rate(step, {RUN['lr']}, {RUN['warmup']}, {RUN['steps']})
        variant_optimizer.update(variant_params, step_grads, rate)
        variant_losses.append(step_loss)
    ablation_losses[name] = variant_losses
    print(name, "first losses:", [round(loss, 2) for loss in variant_losses])'''


def notebook_checks(keys: tuple[str, ...] = CHECKED_VARIANTS[:2]) -> dict[str, Any]:
    """Expressions over the notebook's variables after that cell, and what the record says they are."""
    runs = {run["key"]: run for run in load_record()["runs"] if run["seed"] == SEEDS[0]}
    return {f"bool(np.allclose(ablation_losses[{key!r}], {runs[key]['first_losses']!r}, rtol=1e-3))": True for key in keys}


def train_command(rec: dict[str, Any], out: str) -> list[str]:
    """The `train` command line of chapter 11's run without RoPE, evaluated once, at its last step."""
    run = rec["run"]
    return ["python", "-m", "qwen_np", "train", "--config", "no_rope.json", "--steps", str(run["steps"]),
            "--batch-size", str(run["batch_size"]), "--context", str(run["context"]), "--lr", f"{run['lr']:g}",
            "--warmup", str(run["warmup"]), "--eval-every", str(run["steps"]), "--shards", str(run["shards"]),
            "--out", out]


def time_train_command(rec: dict[str, Any], validation_tokens: int) -> dict[str, Any]:
    """Run the page's `train` command once, in a temporary folder: its wall and CPU seconds (the child's)."""
    import subprocess

    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        (folder / "no_rope.json").write_text(json.dumps(variant_config(VARIANTS_BY_KEY["no_rope"])), encoding="utf-8")
        started, children = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
        command = [sys.executable, *train_command(rec, str(folder / "no_rope"))[1:]]
        subprocess.run(command, cwd=folder, check=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                       stdout=subprocess.DEVNULL)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime
    return {"seconds": round(time.perf_counter() - started), "cpu_seconds": round(cpu),
            "load_average": round(os.getloadavg()[0], 1), "validation_tokens": validation_tokens}


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Train the walkthrough's ablations, every variant at every seed "
                                     "(about half a minute of CPU time a run), and record what the chapter shows; "
                                     "the runs --out already holds are kept.")
    parser.add_argument("--out", type=Path, default=RECORD,
                        help=f"the record (default: {RECORD.relative_to(REPO_ROOT)}, the page's source)")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS), help=f"(default: {list(SEEDS)})")
    args = parser.parse_args(argv)
    record(args.out, tuple(args.seeds))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()


# --- The page ---------------------------------------------------------------------------------------

def load_record() -> dict[str, Any]:
    return walkthrough_common.read_record(RECORD, "python tools/walkthrough/walkthrough_chapter_ablations.py",
                                          "about 20 minutes of CPU time")


def claim(holds: bool, what: str) -> None:
    walkthrough_common.claim(holds, what, "ablation chapter")


def figure(data_: dict[str, Any]) -> Any:
    """Every variant's validation loss against the step, the mean of its seeds and their range (min to max) as a
    band: one piece away at chapter 11's settings, QK-norm at a high learning rate, post-norm in depth; below, the
    order task's copy accuracy and loss with and without RoPE."""
    import matplotlib.pyplot as plt

    runs = by_key(data_["runs"])
    fig, axes = plt.subplot_mosaic([["pieces", "qk", "deep"], ["copy_accuracy", "copy_loss", "."]], figsize=(14, 9),
                                   dpi=100, width_ratios=[1.7, 1, 1])
    # Each panel: its variants, and what tells its first two (the faint pair, at chapter 11's settings) from the rest.
    panels = {"pieces": ("one piece taken away", [k for k in runs if k not in REFERENCE], ""),
              "qk": ("QK-norm at a high learning rate", ["qwen3", "no_qk_norm", "qwen3_high_lr", "no_qk_norm_high_lr"],
                     f", lr {data_['run']['lr']:g}"),
              "deep": ("post-norm in depth", ["qwen3", "post_norm", "deep_pre_norm", "deep_post_norm"],
                       f", {CONFIG['num_hidden_layers']} layers")}
    for name, (title, keys, pair) in panels.items():
        axis = axes[name]
        for index, key in enumerate(keys):
            faint = bool(pair) and index < 2
            black = key in ("qwen3", *REFERENCE.values())
            band(axis, runs[key], "loss", "o--" if faint else "o-", lw=2.2 if black and not faint else 1.3,
                 alpha=0.45 if faint else 1.0, color="black" if black else None,
                 label=runs[key][0]["name"] + (pair if faint else ""))
        axis.set(title=title, xlabel="step")
        axis.legend(fontsize=7.5)
        axis.axhline(data_["unigram_loss"], color="#999999", lw=0.8, ls=":")
        axis.set_ylim(top=max(e["loss"] for run in data_["runs"] for e in run["evals"][1:]) + 0.1)
    axes["pieces"].set_ylabel(f"validation loss (nats per token), mean of {len(data_['seeds'])} seeds")
    axes["pieces"].annotate("each token's frequency alone", (data_["run"]["steps"], data_["unigram_loss"]),
                            xytext=(-4, -11), ha="right", textcoords="offset points", fontsize=7.5, color="#666666")
    copies = by_key(data_["copy_task"]["runs"])
    copied = data_["copy_task"]["run"]["copied"]
    for field_, title, label in (("accuracy", f"the order task: copy {copied} random tokens",
                                  "share of the copy's tokens right (greedy)"),
                                 ("loss", "the order task: the copy's loss", "copy loss (nats per token)")):
        axis = axes[f"copy_{field_}"]
        for key, seeds in copies.items():
            band(axis, seeds, field_, "o-", lw=1.8, alpha=1.0, color="black" if key == "qwen3" else None,
                 label=seeds[0]["name"])
        axis.set(title=title, xlabel="step", ylabel=label)
        axis.legend(fontsize=7.5)
    fig.tight_layout()
    return fig


def band(axis: Any, seeds: list[dict[str, Any]], field_: str, style: str, **line: Any) -> None:
    """One variant: the mean over its seeds of each evaluation's `field_`, and the seeds' min to max shaded."""
    steps = [e["step"] for e in seeds[0]["evals"]]
    values = np.array([[e[field_] for e in run["evals"]] for run in seeds])                  # [seeds, evaluations]
    (drawn,) = axis.plot(steps, values.mean(axis=0), style, ms=2.5, **line)
    axis.fill_between(steps, values.min(axis=0), values.max(axis=0), color=drawn.get_color(),
                      alpha=0.18 * line["alpha"], lw=0)


def by_key(runs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """A task's runs grouped by variant, in the record's order: each variant's runs at its seeds."""
    grouped: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        grouped.setdefault(run["key"], []).append(run)
    return grouped


def finals(seeds: list[dict[str, Any]], field_: str = "final_loss") -> list[float]:
    return [run[field_] for run in seeds]


def mean(values: list[float]) -> float:
    return float(np.mean(values))


def spread(values: list[float], digits: int = 2) -> str:
    """The mean and the range of a variant's seeds, as the table prints them: "3.91 (3.86–3.96)"."""
    return f"{mean(values):.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def margin(a: list[float], b: list[float]) -> float:
    """How far apart the two variants' closest seeds are (negative where their ranges overlap)."""
    return max(min(a) - max(b), min(b) - max(a))


def signed(x: float) -> str:
    """A difference to 2 decimals with its sign, "0.00" where it rounds to nothing (never "-0.00")."""
    text = f"{x:+.2f}"
    return "0.00" if float(text) == 0 else text


def apart(a: list[float], b: list[float]) -> bool:
    """The chapter's rule for reading a difference: every seed of one variant ends below every seed of the other.
    (With three seeds a standard deviation is itself a noisy guess; the range shows every run.)"""
    return max(a) < min(b) or max(b) < min(a)


def chapter_section(number: int) -> str:
    """The chapter's markdown, from the recorded runs."""
    import inspect

    rec = load_record()
    run, runs, seeds = rec["run"], by_key(rec["runs"]), rec["seeds"]
    base = runs["qwen3"][0]
    text_cpu = [r["cpu_seconds"] for r in rec["runs"] if "cpu_seconds" in r and r["key"] not in REFERENCE]
    untimed = sum("cpu_seconds" not in r for r in rec["runs"])                   # a first recording kept its wall time only
    loads = [r["load_average"] for r in rec["runs"] + rec["copy_task"]["runs"] if "load_average" in r]
    return f"""## {number}. Ablations: why each piece is there, measured

Sections 3 and 4 gave a reason for each piece of a Qwen3 layer. Here each is taken away in turn and
chapter 11's model ({base['parameters']:,} parameters) is trained again from random weights:
{run['steps']} steps of B × T = {run['batch_size']} × {run['context']} tokens, peak learning rate
{run['lr']:g} ({run['warmup']} warmup steps, then cosine decay), its validation loss measured every
{run['eval_every']} steps on chapter 11's validation sample. One change per run, so a difference is that
piece's doing, or chance: every variant is trained at {len(seeds)} seeds ({', '.join(map(str, seeds))}; a seed
draws the random weights and the order of the batches, the same for every variant at that seed), and the
page reads a difference only where the seeds do not overlap. The {len(rec['runs']) + len(rec['copy_task']['runs'])}
runs are recordings of `python tools/walkthrough/walkthrough_chapter_ablations.py`, kept in
`docs/figures/ablations.json` ({rec['seconds']:,} s of wall time in all: {untimed}
runs of a first recording, one seed each and Qwen3 at two, on an idle machine of {rec['cores']} cores, the
others on the same machine shared with other work, load average
{min(loads):.0f}–{max(loads):.0f}, where one 2-layer run at chapter 11's settings took
{min(text_cpu)}–{max(text_cpu)} s of CPU time); it writes the record after each run and keeps the runs the record
holds, so an interrupted recording resumes, and `--seeds` adds seeds. The page is written from the record, and
`tests/core/test_ablations.py` repeats the first {CHECKED_STEPS} steps of
{', '.join(f'`{k}`' for k in CHECKED_VARIANTS)} (each at another seed) and of the order task's runs to check
the record still comes out of the code.

{options_part()}

{code_block(inspect.getsource(AblatedModel.decoder_layer))}

{results_part(rec)}

{pieces_part(rec)}

{copy_part(rec)}

{heads_part(rec)}

{run_it_part(rec)}"""


def options_part() -> str:
    rows = "\n".join(f"| `{name}` | `{json.dumps(choices[0])}` | `{json.dumps(choices[1])}` | {ABLATION_MEANING[name]} |"
                     for name, choices in ABLATION_CHOICES.items())
    return f"""**The options.** Each is a field of `config.json` (`Qwen3Config`, `qwen_np/core/config.py`), Qwen3's
value by default, so a released checkpoint is unchanged; MHA, GQA and MQA need no field of their own:
they are `num_key_value_heads`.

| field | Qwen3 | ablation | what the ablation does |
|---|---|---|---|
{rows}

The hand-written backward (`training/gradients.py`) reverses each: a skipped RoPE or QK-norm passes its
gradient through, `residual_block_backward` is one block in each placement (with or without the residual),
`gelu_mlp_backward` the GELU MLP; `tests/training/test_gradients.py` checks every weight's gradient of each against
central differences. The fast path (`engine/fast.py`) is Qwen3's alone and refuses an ablation; `load_model`
gives an ablated checkpoint the readable path, so `generate` runs it. The decoder layer reads the fields as
one-line choices beside the Qwen3 steps they change (`if pre`, `if c.use_rope`, `if c.use_residual`, and
the weights an ablated layer lacks):"""


ABLATION_MEANING = {
    "use_rope": "no rotary position embedding: q and k are not rotated, only the causal mask tells positions apart",
    "use_qk_norm": "no RMSNorm of each query and key head (and no `q_norm` / `k_norm` weights)",
    "norm_position": "each block's norm after its residual sum, `x = norm(x + f(x))`, as the 2017 Transformer, "
                     "instead of before its branch, `x = x + f(norm(x))`",
    "use_residual": "no `x +`: each block's output replaces the stream instead of adding to it",
    "mlp_type": "`down(gelu(up(x)))`, GPT-2's MLP, no `gate_proj`; give it `intermediate_size` 1.5 F for "
                "SwiGLU's parameters (3 D F = 2 D F')",
}




def results_part(rec: dict[str, Any]) -> str:
    runs = by_key(rec["runs"])
    qwen3 = finals(runs["qwen3"])

    def versus(key: str) -> tuple[str, str]:
        """The difference of the means from the Qwen3 run with the same settings, and whether the seeds tell it."""
        reference = REFERENCE.get(key, "qwen3")
        if key == reference:
            return "—", "—"
        mine, theirs = finals(runs[key]), finals(runs[reference])
        return signed(mean(mine) - mean(theirs)), "yes" if apart(mine, theirs) else "no"

    def changed(r: dict[str, Any]) -> str:
        fields = {**{k: v for k, v in r["config"].items() if CONFIG.get(k) != v}, **r["run"]}
        return ", ".join(f"`{k}: {json.dumps(v)}`" for k, v in fields.items()) or "—"

    rows = "\n".join(f"| {seeds[0]['name']} | {changed(seeds[0])} | {seeds[0]['parameters']:,} | "
                     f"{seeds[0]['kv_bytes_per_token']:,} | {len(seeds)} | {spread(finals(seeds, 'final_train_loss'))} | "
                     f"**{spread(finals(seeds))}** | {' | '.join(versus(key))} | "
                     f"{mean(finals(seeds, 'largest_attention_logit')):.1f} |" for key, seeds in runs.items())
    claim(all(len(seeds) >= 3 for seeds in runs.values()), "every variant has at least three seeds")
    last = rec["run"]["eval_every"]
    return f"""**The results.** Validation loss every {last} steps, each variant against Qwen3's (black): the line
is the mean of the seeds, the band their range (lowest to highest):

![validation loss of each ablation](figures/ablations.png)

| run | changed | parameters | KV cache, bytes per token (FP32) | seeds | training loss (last {last} steps) | \
final validation loss | vs its Qwen3 | beyond the seeds' spread? | largest attention logit |
|---|---|---:|---:|---:|---:|---:|---:|:---:|---:|
{rows}

Each loss is the mean over the seeds and, in brackets, the lowest and highest seed. "vs its Qwen3" is
the difference of the means from the Qwen3 variant with the same settings (its rate, its depth). How much
of a difference is chance: Qwen3 itself, from {len(qwen3)} random starts, ends anywhere in
{min(qwen3):.2f}–{max(qwen3):.2f}, {max(qwen3) - min(qwen3):.2f} apart. So the page reads a difference only
where the seeds do not overlap, every seed of one variant ending below every seed of the other
("beyond the seeds' spread?"); a "no" says only that these runs cannot tell, not that the piece does
nothing. The rule can mislead too: two variants that differ in nothing pass it with {len(qwen3)} seeds each
once in {math.comb(2 * len(qwen3), len(qwen3)) // 2} (2 of the {math.comb(2 * len(qwen3), len(qwen3))} equally likely
orders of their {2 * len(qwen3)} final losses), so a "yes" by a hair is weak evidence on its own.
The last column is the largest score q·k/√Dh of any head after training (mean of the seeds), on
one validation window: the number QK-norm bounds. For scale: a model that ignores the context and
predicts each token by its frequency in the training text scores {two(rec['unigram_loss'])} on the same
sample."""


def pieces_part(rec: dict[str, Any]) -> str:
    runs = by_key(rec["runs"])

    def gap(key: str) -> float:
        return mean(finals(runs[key])) - mean(finals(runs[REFERENCE.get(key, "qwen3")]))

    def read(key: str) -> bool:
        return apart(finals(runs[key]), finals(runs[REFERENCE.get(key, "qwen3")]))

    def loss(key: str) -> str:
        return two(mean(finals(runs[key])))

    def logit(key: str) -> float:
        return mean(finals(runs[key], "largest_attention_logit"))

    unigram, high, deep = rec["unigram_loss"], runs["qwen3_high_lr"][0], runs["deep_pre_norm"][0]
    near_unigram = all(abs(x - unigram) < 0.1 for x in finals(runs["no_residual"]) + finals(runs["deep_post_norm"]))
    claim(read("no_residual") and gap("no_residual") > 0.5 and near_unigram,
          "without residuals, and post-norm at 8 layers, every seed ends near the unigram loss")
    claim(read("no_rope") and 0 < gap("no_rope") < 0.2, "no RoPE ends a little behind, beyond the seeds' spread")
    claim(not read("no_qk_norm"), "QK-norm makes no difference the seeds can tell at chapter 11's rate")
    claim(read("no_qk_norm_high_lr") and gap("no_qk_norm_high_lr") > 0.2, "without QK-norm the high-rate run falls behind")
    claim(min(finals(runs["no_qk_norm_high_lr"], "largest_attention_logit"))
          > 2 * max(finals(runs["qwen3_high_lr"], "largest_attention_logit")),
          "without QK-norm every seed's attention logits grow larger than twice any seed's with it")
    claim(read("post_norm") and gap("post_norm") < 0, "post-norm trains better than pre-norm at 2 layers")
    claim(read("deep_post_norm") and gap("deep_post_norm") > 0.5, "post-norm at 8 layers without warmup falls far behind")
    claim(read("gelu") and gap("gelu") < 0, "the GELU MLP ends ahead of SwiGLU, beyond the seeds' spread")
    return f"""**What each piece is for, piece by piece.**

- **The residual connection** matters most. Without it the model ends at {loss('no_residual')}
  ({signed(gap('no_residual'))}), the context-free frequency model's loss ({two(unigram)}), at every seed: it
  learned which tokens are common and nothing else. Each block's output *replaces* the stream, so a token's
  own identity has to survive two attention blocks that average it with other tokens, and the gradient
  reaches the embedding only through every block's Jacobian. With `x + f(x)` the identity is a path around
  every block, forwards and backwards (`residual_block_backward` passes `d_out` straight through): each
  block adds to what the stream holds instead of overwriting it.
- **RoPE**, taken away, costs {signed(gap('no_rope'))}: beyond the seeds' spread (its best seed ends
  {margin(finals(runs['no_rope']), finals(runs['qwen3'])):.2f} behind Qwen3's worst), so real, but small next to
  the other pieces, and not because position does not matter: a causal model finds position without any
  position embedding. The mask lets a query at position p average over p + 1 keys, so how spread its
  attention is depends on p, and the next layer can read that (`tests/core/test_ablations.py` shows the
  other half: one layer without RoPE cannot tell the order of the tokens before the last). What RoPE adds
  is *relative* position inside every score, q·k depending on how far apart two tokens are; on this text,
  where "a few tokens back" is most of what a 2-layer model uses, the mask's weak signal almost does. The
  order task below is one where it does not.
- **QK-norm** makes no difference the seeds can tell at chapter 11's rate ({signed(gap('no_qk_norm'))}). It is
  there for stability: at lr {high['lr']:g} the run without it ends {signed(gap('no_qk_norm_high_lr'))} behind,
  and its largest attention logit is {logit('no_qk_norm_high_lr'):.0f} against {logit('qwen3_high_lr'):.0f} with
  it (means of the seeds). Without the norm, fast-moving q and k weights grow the scores q·k/√Dh without
  bound; softmax then puts all weight on one key, its gradient vanishes, and those heads stop learning.
  RMSNorm of each head (with its learned gain) bounds |q| and |k|, so the scores stay where softmax still
  learns: what lets a large model take a higher learning rate.
- **Pre-norm** is the surprise: at 2 layers post-norm *wins*, by {-gap('post_norm'):.2f}. With a norm after every
  block the stream stays at unit scale and every block's output counts fully; post-norm models that train
  are known to end a little better (Liu et al., 2020). What pre-norm buys is trainability in depth: at
  {deep['config']['num_hidden_layers']} layers and no warmup, post-norm ends at {loss('deep_post_norm')}
  after {deep['steps']} steps, against pre-norm's {loss('deep_pre_norm')}: stuck at the frequency model, every
  seed. Every post-norm sits on the residual path itself, so the gradient to the early layers passes
  through all of them, and at the start the updates near the output are large (Xiong et al., 2020): the
  2017 Transformer needed its warmup for this. Pre-norm leaves the residual path a plain sum, which is why
  large models since GPT-2 use it.
- **SwiGLU**, against a plain GELU MLP with the same parameters, ends *behind* by {-gap('gelu'):.2f}, beyond
  the seeds' spread. A likely reason it starts slower: SwiGLU's output `silu(gate(x)) * up(x)` is a product
  of two projections, each starting at about 0.02·√D = {0.02 * CONFIG['hidden_size'] ** 0.5:.2f} per feature,
  so at initialisation it is roughly that factor times GELU's `gelu(up(x))` (about half of one such
  projection), and its gradient is second order in the weights: the gated MLP switches on late. Its
  published gain (Shazeer, 2020) is a few percent of perplexity after long training at scale; a
  {rec['run']['steps']}-step run of a 2-layer model measures the start, not that."""


def copy_part(rec: dict[str, Any]) -> str:
    task, copies = rec["copy_task"]["run"], by_key(rec["copy_task"]["runs"])
    rope, no_rope = copies["qwen3"], copies["no_rope"]
    n = task["copied"]

    def first_step(run: dict[str, Any], share: float = 0.9) -> str:
        return next((str(e["step"]) for e in run["evals"] if e["accuracy"] >= share), "never")

    rows = "\n".join(f"| {seeds[0]['name']} | {len(seeds)} | **{spread(finals(seeds))}** | "
                     f"{spread(finals(seeds, 'final_accuracy'))} | {', '.join(first_step(r) for r in seeds)} |"
                     for seeds in copies.values())
    claim(all(len(seeds) >= 3 for seeds in copies.values()), "the order task has at least three seeds per variant")
    claim(min(finals(rope, "final_accuracy")) > 0.95 and max(finals(no_rope, "final_accuracy")) < 0.2,
          "with RoPE every seed copies almost every token, without it none copies a fifth")
    claim(apart(finals(rope), finals(no_rope)) and min(finals(no_rope)) > math.log(n),
          "without RoPE the copy loss stays above a uniform guess among the first half's tokens")
    return f"""**Where position is the task: copying.** Each row is {n} random distinct token ids, a separator and the
same {n} ids again, T = {2 * n}; the loss is over the copy only (the first half is random by design, so no
model can predict it), fresh rows every step, {task['steps']} steps of B = {task['batch_size']} at peak rate
{task['lr']:g}, the same model otherwise, at the same {len(rope)} seeds; scored every {task['eval_every']} steps on
{task['eval_rows']} rows drawn apart from every run's. The lower panels of the figure above:

| run | seeds | copy loss (nats per token) | share of the copy's tokens right (greedy) | step each seed first got 90% right |
|---|---:|---:|---:|---|
{rows}

With RoPE every seed learns to copy; without it none does, and its loss stays above ln {n} =
{math.log(n):.2f}, a uniform guess among the tokens it has already seen: it has not even learned that the
answer is one of them. Copying the token after the one just read means finding where that token stood the
first time and reading its right neighbour: one head attends one position back and writes each token's
predecessor into its stream (a *previous-token head*), a head of the next layer looks for the current
token among those predecessors (an *induction head*, Olsson et al., 2022). With RoPE "one position back"
is a fixed rotation between q and k at every position, which a head learns directly. Without it, a
layer's attention is a weighted average over a set of keys that cannot single out position p - 1; all
that tells positions apart is how many keys the mask lets each see, a signal {task['steps']} steps here do not
turn into an address. That is what the small gap on Shakespeare hides: there the text's own statistics do
most of the work, here position is all of it."""


def heads_part(rec: dict[str, Any]) -> str:
    runs, seeds = by_key(rec["runs"]), rec["seeds"]
    mha, gqa, mqa = (finals(runs[key]) for key in ("mha", "qwen3", "mqa"))
    sizes = {key: runs[key][0]["kv_bytes_per_token"] for key in ("mha", "qwen3", "mqa")}
    real = PRESETS["qwen3-8b"]
    kv_heads = {"MHA": real.num_attention_heads, "GQA": real.num_key_value_heads, "MQA": 1}
    per_token = {name: kv_cache_bytes_per_token(replace(real, num_key_value_heads=n), 2) for name, n in kv_heads.items()}
    context = real.max_position_embeddings
    first = {key: runs[key][0]["final_loss"] for key in ("qwen3", "mqa")}                   # the first seed alone
    claim(not apart(mqa, gqa) and first["mqa"] - first["qwen3"] < -0.2,
          "MQA is within GQA's seeds, though the first seed alone put it far ahead")
    claim(apart(mha, gqa) and 0 < margin(mha, gqa) < 0.02 and mean(mha) < mean(gqa), "MHA ends below GQA by a hair")
    return f"""**MHA, GQA, MQA** trade the KV cache against quality. Here 4 query heads read 4, 2 (Qwen3's
grouping) or 1 KV head and end at {two(mean(mha))}, {two(mean(gqa))} and {two(mean(mqa))} (means of the seeds),
while the cache per token halves each time ({sizes['mha']:,}, {sizes['qwen3']:,} and {sizes['mqa']:,} bytes;
k_proj and v_proj shrink with the KV heads, so the parameters fall too). MQA's seeds end anywhere in
{min(mqa):.2f}–{max(mqa):.2f}, across GQA's: these runs cannot tell one KV head from two. Seed {seeds[0]} alone
would have said otherwise: it puts MQA {signed(first['mqa'] - first['qwen3'])} from GQA;
seed by seed the gap is {', '.join(signed(a['final_loss'] - b['final_loss']) for a, b in zip(runs['mqa'], runs['qwen3']))}.
MHA's seeds all end below GQA's, but by a hair (its highest and GQA's
lowest are {margin(mha, gqa):.3f} apart): the kind of "yes" the rule gives once in ten by chance, so not a
finding either. The order found at scale (MHA a little better than GQA, GQA than MQA: Ainslie et al., 2023)
is a small difference after long training of large models, far below what {len(seeds)} seeds of
{rec['run']['steps']} steps resolve.
What the KV heads decide for certain is the cache. At Qwen3-8B's size, in BF16, the same choice is
{per_token['MHA']:,} bytes per token (MHA, {kv_heads['MHA']} KV heads), {per_token['GQA']:,} (GQA, its {kv_heads['GQA']})
or {per_token['MQA']:,} (MQA): at its {context:,}-token context,
{per_token['MHA'] * context / 2 ** 30:.1f}, {per_token['GQA'] * context / 2 ** 30:.1f} or
{per_token['MQA'] * context / 2 ** 30:.2f} GiB for one sequence (section 6). GQA keeps nearly all of MHA's
quality for a quarter of its cache, which is why Qwen3 uses it."""


def run_it_part(rec: dict[str, Any]) -> str:
    import shlex

    example, timed = by_key(rec["runs"])["no_rope"][0], rec["train_command"]
    commands = "\n".join([f"echo '{json.dumps(example['config'])}' > no_rope.json",
                          shlex.join(train_command(rec, "/tmp/no_rope")),
                          "python -m qwen_np generate --model /tmp/no_rope/model --no-chat --temperature 0 -n 30 'ROMEO:'"])
    return f"""**Run any of them yourself.** Write chapter 11's `config.json` with the fields of the table's "changed"
column, and train it with the `train` command (the same model, steps and settings, at seed 0):

{code_block(commands, "bash")}

`--eval-every {rec['run']['steps']}` scores the validation text once, after the last step: `train` scores all of
the validation plays ({timed['validation_tokens']:,} tokens, where this chapter scores the first
{VALIDATION_TOKENS:,} of each), so its number differs a little from the table's; with the chapter's
`--eval-every {rec['run']['eval_every']}` it would score them {rec['run']['steps'] // rec['run']['eval_every']} times.
Recorded: the command took {timed['cpu_seconds']} s of CPU time ({timed['seconds']} s of wall time on a shared
machine, load average {timed['load_average']:.0f}). The exported `config.json` keeps the fields, and qwen_np loads and runs the
checkpoint (on the readable path). transformers knows none of them: it would ignore `use_rope: false` and
fill in missing weights at random, so an ablated checkpoint is for qwen_np only. To repeat this chapter's
runs, all of them: `python tools/walkthrough/walkthrough_chapter_ablations.py --out my_ablations.json`
(`--out` keeps the committed record; the file resumes an interrupted recording)."""
