"""The walkthrough's chapter "Train one yourself": a small Qwen3 trained from random weights on the
Shakespeare train split, in a few minutes on 2 cores (the record keeps its seconds), with all a learner should watch.

The run is too slow to repeat in every test (the suite runs twice, under two BLAS kernels), so it is
RECORDED: `python tools/walkthrough/walkthrough_chapter_train.py` runs it and writes docs/figures/training_run.json,
and the page is rendered from that record. tests/product/test_walkthrough.py repeats the record's first steps
(check_first_steps) and fails when they no longer match: the record cannot drift from the code
unnoticed. Its later digits are the BLAS kernel's (a long run amplifies rounding), so the page prints
losses to 2 decimals.
"""

from __future__ import annotations

import json
import os
import sys
from pprint import pformat
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import tokenizers
from threadpoolctl import threadpool_limits

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "tools" / "walkthrough"))

from qwen_np.training import data, evaluation, trainer, step as training, parameters, run_spec, run_state, text_data  # noqa: E402
from qwen_np.training.settings import PRESET_CONFIGS, PRESET_SETTINGS  # noqa: E402
from qwen_np.engine import step_memory  # noqa: E402
from qwen_np.core.config import Qwen3Config, parameter_count  # noqa: E402
from qwen_np.generation.generate import generate  # noqa: E402
from qwen_np.core.model import Qwen3Model  # noqa: E402
from qwen_np.core.sampling import SamplingParams  # noqa: E402
from qwen_np.files.tokenizer import Tokenizer  # noqa: E402
from walkthrough_training import below, mib  # noqa: E402
import walkthrough_common  # noqa: E402
from walkthrough_common import rounded, two  # noqa: E402

RECORD = REPO_ROOT / "docs" / "figures" / "training_run.json"
# Where the early-stopping run's best and stop steps land over seeds and BLAS kernels (--spread adds to it).
SPREAD_RECORD = REPO_ROOT / "docs" / "figures" / "early_stopping_spread.json"
SPREAD_SEEDS = (0, 1, 2, 3)
# The chapter's model: the bundled model's shape, shrunk until 1,000 steps take minutes, not hours, on 2 cores.
CONFIG = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "max_position_embeddings": 128, "tie_word_embeddings": True}
# The run. shards=2 fixes how a batch's rows are summed, so the record repeats on a machine with more cores.
RUN = {"steps": 1000, "batch_size": 16, "context": 64, "lr": 1e-2, "warmup": 50, "weight_decay": 0.1,
       "clip": 1.0, "seed": 0, "shards": 2, "eval_every": 50, "sample_every": 100}
BUNDLED_VOCAB = PRESET_CONFIGS["shakespeare"]["vocab_size"]
VALIDATION_TOKENS = 4096          # per validation play: the start of each, so an evaluation takes a second
PROMPT = "ROMEO:\n"
SAMPLE_TOKENS = 24
NOISE_BATCHES = (1, 4, 16, 64)    # batch sizes whose gradient is compared with a large batch's
NOISE_REFERENCE = 256             # rows of the "large batch" (the best estimate of the true gradient)
NOISE_DRAWS = 4                   # independent batches per size, cosines averaged
MICRO_BATCHES = 4
OVERFIT_LR = 3e-3                 # the one step that overfits: about the rate a third of the way through the run
CHECKED_STEPS = 8                 # the steps the drift test repeats
NOTEBOOK_STEPS = 100              # the steps the notebook's cell trains and draws (its first CHECKED_STEPS are checked)
# The early-stopping run: the same model on a small text (the first lines of Hamlet), which it can learn by heart.
SMALL_TEXT_LINES = 400
SMALL_RUN = {"steps": 3000, "batch_size": 16, "context": 64, "lr": 1e-2, "warmup": 20, "eval_every": 25,
             "patience": 3, "seed": 0, "shards": 2, "threads": 2}
RESUME_RUN = {"steps": 40, "decay_steps": 40, "batch_size": 8, "context": 32, "lr": 1e-2, "warmup": 5,
              "eval_every": 20, "seed": 0, "shards": 2, "threads": 2}
RESUME_STOP = 20                  # the first half stops here; --resume runs the rest


def model_config() -> Qwen3Config:
    return Qwen3Config.from_dict(parameters.hf_config(CONFIG), source="CONFIG")


# --- The pieces of the run ---------------------------------------------------------------------------

def load_data(folder: Path) -> tuple[text_data.Corpus, list[np.ndarray], Tokenizer]:
    """The train split's tokens, the validation sample, and the tokenizer (BPE trained on train only)."""
    corpus = text_data.load_corpus("shakespeare", folder, CONFIG["vocab_size"], resume=False)
    validation = [doc[:VALIDATION_TOKENS + 1] for doc in corpus.validation]
    return corpus, validation, Tokenizer.from_folder(folder)


def validation_loss(model: Qwen3Model, docs: list[np.ndarray]) -> float:
    return evaluation.score_text(model.forward, docs, 0, RUN["context"]).summary()["loss_per_token"]


def sample(model: Qwen3Model, tokenizer: Tokenizer) -> str:
    """Greedy continuation of PROMPT: what the model would write now."""
    ids = tokenizer.encode(PROMPT)
    events = generate(model, tokenizer, ids, SamplingParams(temperature=0), SAMPLE_TOKENS)
    return PROMPT + "".join(event.text for event in events)


def train_step(model: Qwen3Model, params: dict[str, np.ndarray], optimizer: training.AdamW,
               order: text_data.WindowOrder, tokens: np.ndarray, step: int) -> float:
    """One optimizer step of the chapter's run (the step-th, from 0): batch, loss, gradients, clip, AdamW."""
    lr = training.learning_rate(step, RUN["lr"], RUN["warmup"], RUN["steps"])
    batch = order.next_batch(tokens, RUN["batch_size"])                                  # [B, T+1]
    loss, grads = training.loss_and_accumulated_gradients(model, batch, 1, threads=2, shards=RUN["shards"])
    training.clip_gradients(grads, RUN["clip"])
    optimizer.update(params, grads, lr)
    return loss


def fresh_model() -> tuple[Qwen3Model, dict[str, np.ndarray], training.AdamW]:
    config = model_config()
    params = parameters.init_parameters(config, RUN["seed"])
    model = parameters.model_from_parameters(config, params)
    return model, params, training.adamw_for(params, weight_decay=RUN["weight_decay"])


def data_facts(corpus: text_data.Corpus, tokenizer: Tokenizer) -> dict[str, Any]:
    """Plays, characters and tokens per split; windows, batches per epoch, and the reshuffle."""
    splits = {}
    for name in data.SPLITS:
        text = data.shakespeare_split(name)
        tokens = len(corpus.train) if name == "train" else sum(len(d) for d in evaluation.encoded_documents(tokenizer, text)[0])
        splits[name] = {"plays": list(data.SPLITS[name]), "characters": data.characters(text), "tokens": tokens}
    T, B = RUN["context"], RUN["batch_size"]
    epochs = []
    for epoch in (0, 1):
        order = text_data.WindowOrder(len(corpus.train), T, RUN["seed"], epoch=epoch)
        first = order.next_batch(corpus.train, 3)                                       # [3, T+1]
        epochs.append([tokenizer.decode(row[:12].tolist()) for row in first])
    windows = (len(corpus.train) - 1) // T        # at offset 0; an epoch's random offset may drop one
    return {"splits": splits, "windows": windows, "batches_per_epoch": windows // B, "first_windows": epochs,
            "bundled": bundled_epoch()}


def bundled_epoch() -> dict[str, Any]:
    """The same count for the run that trained the bundled model: its tokenizer, its preset's B and T."""
    settings = PRESET_SETTINGS["shakespeare"]
    bpe = tokenizers.Tokenizer.from_file(str(REPO_ROOT / "weights" / "tokenizer.json"))
    tokens = sum(1 + len(data.encode_corpus(bpe, doc))            # each play after an <|endoftext|>, as load_corpus
                 for doc in evaluation.documents(data.shakespeare_split("train")))
    windows = (tokens - 1) // settings["context"]
    return {"tokens": tokens, "windows": windows, "batches_per_epoch": windows // settings["batch_size"],
            "steps": settings["steps"], "batch_size": settings["batch_size"], "context": settings["context"]}


def gradient_noise(corpus: text_data.Corpus) -> dict[str, Any]:
    """At init: cosine between the gradient of B rows and of NOISE_REFERENCE other rows, and the memory of B."""
    model, _, _ = fresh_model()
    T = RUN["context"]
    order = text_data.WindowOrder(len(corpus.train), T, seed=1)
    reference = training.loss_and_accumulated_gradients(model, order.next_batch(corpus.train, NOISE_REFERENCE),
                                                        NOISE_REFERENCE // 64, threads=2, shards=2)[1]
    ref = np.concatenate([g.ravel() for g in reference.values()])
    rows = []
    for B in NOISE_BATCHES:
        cosines = []
        for _ in range(NOISE_DRAWS):
            grads = training.loss_and_accumulated_gradients(model, order.next_batch(corpus.train, B), 1, threads=2,
                                                            shards=2 if B > 1 else 1)[1]
            g = np.concatenate([grads[n].ravel() for n in reference])
            cosines.append(float(np.dot(g, ref) / (np.linalg.norm(g) * np.linalg.norm(ref))))
        estimate = step_memory.training_memory(model.config, B, T)
        rows.append({"batch": B, "cosine": float(np.mean(cosines)),
                     "memory": step_memory.training_total(estimate),
                     "activations": estimate["activations"]})
    return {"reference_rows": NOISE_REFERENCE, "draws": NOISE_DRAWS, "rows": rows}


def accumulation(corpus: text_data.Corpus) -> dict[str, Any]:
    """One batch of B rows against MICRO_BATCHES micro-batches of B / MICRO_BATCHES: gradients and updates."""
    B, T = RUN["batch_size"], RUN["context"]
    batch = text_data.WindowOrder(len(corpus.train), T, seed=2).next_batch(corpus.train, B)       # [B, T+1]
    results = []
    for micro in (1, MICRO_BATCHES):
        model, params, optimizer = fresh_model()
        loss, grads = training.loss_and_accumulated_gradients(model, batch, micro, threads=1, shards=1)
        optimizer.update(params, {n: g.copy() for n, g in grads.items()}, RUN["lr"])
        results.append((loss, grads, params))
    (loss1, g1, p1), (loss4, g4, p4) = results
    scale = max(float(np.abs(g).max()) for g in g1.values())
    config = model_config()
    return {"micro_batches": MICRO_BATCHES, "loss": [loss1, loss4],
            "gradient_difference": max(float(np.abs(g1[n] - g4[n]).max()) for n in g1) / scale,
            "weight_difference": max(float(np.abs(p1[n] - p4[n]).max()) for n in p1),
            "activations": [step_memory.training_memory(config, B // micro, T)["activations"] for micro in (1, MICRO_BATCHES)]}


def one_step_overfit(model: Qwen3Model, corpus: text_data.Corpus, held_out: np.ndarray) -> dict[str, Any]:
    """One fresh-AdamW step at the peak rate on one batch of the trained model: its batch's loss and a held-out one's."""
    params = {n: p.copy() for n, p in training.named_parameters(model).items()}
    model = parameters.model_from_parameters(model.config, params)
    batch = text_data.WindowOrder(len(corpus.train), RUN["context"], seed=3).next_batch(corpus.train, 4)   # [4, T+1]
    held = held_out[None, :RUN["context"] + 1]                                                           # [1, T+1]
    before = (training.loss_and_gradients(model, batch)[0], training.loss_and_gradients(model, held)[0])
    loss, grads = training.loss_and_gradients(model, batch)
    training.clip_gradients(grads, RUN["clip"])
    training.adamw_for(params, weight_decay=RUN["weight_decay"]).update(params, grads, OVERFIT_LR)
    after = (training.loss_and_gradients(model, batch)[0], training.loss_and_gradients(model, held)[0])
    return {"batch": [before[0], after[0]], "held_out": [before[1], after[1]], "rows": 4, "lr": OVERFIT_LR}


def main_run(corpus: text_data.Corpus, validation: list[np.ndarray], tokenizer: Tokenizer,
             steps: int, progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """The chapter's loop: train, validate every eval_every steps (keeping the best weights), sample."""
    model, params, optimizer = fresh_model()
    order = text_data.WindowOrder(len(corpus.train), RUN["context"], RUN["seed"])
    history: dict[str, Any] = {"loss": [], "lr": [], "evals": [], "samples": []}
    best: dict[str, Any] = {"loss": float("inf")}
    for step in range(steps + 1):
        if step % RUN["eval_every"] == 0 or step == steps:
            loss = validation_loss(model, validation)
            history["evals"].append({"step": step, "loss": loss})
            if loss < best["loss"]:
                best = {"loss": loss, "step": step, "params": {n: p.copy() for n, p in params.items()}}
            progress(f"step {step}: validation {loss:.3f}")
        if step % RUN["sample_every"] == 0 or step == steps:
            history["samples"].append({"step": step, "text": sample(model, tokenizer)})
        if step == steps:
            break
        history["lr"].append(training.learning_rate(step, RUN["lr"], RUN["warmup"], RUN["steps"]))
        history["loss"].append(train_step(model, params, optimizer, order, corpus.train, step))
    history["best_step"], history["best_loss"] = best["step"], best["loss"]
    history["best_model"] = parameters.model_from_parameters(model.config, best["params"])
    return history


def early_stopping_run(folder: Path, seed: int = SMALL_RUN["seed"]) -> dict[str, Any]:
    """trainer.run (the `train` command) on a small text with --patience: validation turns up, the run stops."""
    text = "".join(data.shakespeare_plays()["hamlet"].splitlines(keepends=True)[:SMALL_TEXT_LINES])
    (folder / "small.txt").write_text(text, encoding="utf-8")
    (folder / "config.json").write_text(json.dumps(CONFIG), encoding="utf-8")
    result = trainer.run(run_spec.RunSpec(out=folder / "small", config=folder / "config.json",
                                         data=str(folder / "small.txt"), overrides={**SMALL_RUN, "seed": seed}))
    state = result.state
    return {"characters": data.characters(text), "lines": SMALL_TEXT_LINES,
            "loss": [record["loss"] for record in state.history],
            "evals": [{"step": e["step"], "loss": e["loss_per_token"]} for e in state.evals],
            "stopped": result.stopped, "steps_run": state.step, "best_loss": state.best_loss}


def resume_run(folder: Path) -> dict[str, Any]:
    """The same run twice: straight through, and stopped at RESUME_STOP then resumed. Same bits?"""
    text = folder / "small.txt"
    config = folder / "config.json"
    straight = trainer.run(run_spec.RunSpec(out=folder / "straight", config=config, data=str(text), overrides=dict(RESUME_RUN)))
    trainer.run(run_spec.RunSpec(out=folder / "halves", config=config, data=str(text),
                                overrides={**RESUME_RUN, "steps": RESUME_STOP}))
    resumed = trainer.run(run_spec.RunSpec(out=folder / "halves", resume=True, overrides={"steps": RESUME_RUN["steps"]}))
    a, b = run_state.load_state(straight.last)[0], run_state.load_state(resumed.last)[0]
    params, m, v, meta = run_state.load_state(straight.last)
    n = sum(p.size for p in params.values())
    exported = straight.exported / "model.safetensors" if straight.exported else None
    return {"identical": all(np.array_equal(a[k], b[k]) for k in a), "tensors": len(a), "parameters": n,
            "checkpoint_bytes": straight.last.stat().st_size,
            "exported_bytes": exported.stat().st_size if exported else 0,
            "groups": {"param": len(params), "adam_m": len(m), "adam_v": len(v)},
            "state": sorted(k for k in meta if k not in ("history", "evals")),
            "order": meta["order"], "optimizer_step": meta["optimizer_step"]}


def record(progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Everything the chapter shows, by running it (a few minutes on 2 cores; the record keeps the seconds)."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as name, threadpool_limits(limits=1):
        folder = Path(name)
        corpus, validation, tokenizer = load_data(folder / "tokenizer")
        progress(f"data ready ({time.perf_counter() - started:.0f} s)")
        facts = data_facts(corpus, tokenizer)
        history = main_run(corpus, validation, tokenizer, RUN["steps"], progress)
        best_model = history.pop("best_model")
        test_docs, test_chars = evaluation.encoded_documents(tokenizer, data.shakespeare_split("test"))
        test = evaluation.score_text(best_model.forward, test_docs, test_chars, RUN["context"]).summary()
        full_validation = evaluation.score_text(best_model.forward, corpus.validation, corpus.validation_characters,
                                                RUN["context"]).summary()
        progress(f"trained and tested ({time.perf_counter() - started:.0f} s)")
        overfit = one_step_overfit(best_model, corpus, validation[0])
        noise = gradient_noise(corpus)
        accumulated = accumulation(corpus)
        early = early_stopping_run(folder)
        resume = resume_run(folder)
        progress(f"done ({time.perf_counter() - started:.0f} s)")
    return {"config": CONFIG, "run": RUN, "parameters": parameter_count(model_config()), "data": facts,
            "history": history, "test": {k: test[k] for k in ("loss_per_token", "bits_per_character", "tokens")},
            "validation_full": {k: full_validation[k] for k in ("loss_per_token", "bits_per_character", "tokens")},
            "overfit_one_step": overfit, "noise": noise, "accumulation": accumulated, "early_stopping": early,
            "resume": resume, "seconds": round(time.perf_counter() - started)}


def check_first_steps(recorded: dict[str, Any], steps: int = CHECKED_STEPS) -> None:
    """Repeat the recorded run's first steps; raise naming the first loss that differs beyond rounding."""
    with tempfile.TemporaryDirectory() as name, threadpool_limits(limits=1):
        corpus, validation, tokenizer = load_data(Path(name))
        model, params, optimizer = fresh_model()
        order = text_data.WindowOrder(len(corpus.train), RUN["context"], RUN["seed"])
        fresh = [validation_loss(model, validation)] + [train_step(model, params, optimizer, order, corpus.train, s)
                                                        for s in range(steps)]
    wanted = [recorded["history"]["evals"][0]["loss"]] + recorded["history"]["loss"][:steps]
    for index, (got, want) in enumerate(zip(fresh, wanted)):
        if not np.isclose(got, want, rtol=1e-3):
            what = "the validation loss at init" if index == 0 else f"the loss of step {index}"
            raise AssertionError(f"{what} is {got:.6g} now, {want:.6g} in {RECORD.name}: the code changed; "
                                 "re-record with `python tools/walkthrough/walkthrough_chapter_train.py`")


def early_stopping_spread(progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """The early-stopping run again with each of SPREAD_SEEDS, on this process's BLAS kernel: where its best step
    and its stop land. A different seed (or a kernel that sums in another order) changes the trajectory, and
    with it where validation turns."""
    kernel = {name: os.environ.get(name) for name in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    runs = []
    for seed in SPREAD_SEEDS:
        with tempfile.TemporaryDirectory() as folder:
            e = early_stopping_run(Path(folder), seed)
        best = min(e["evals"], key=lambda x: x["loss"])
        runs.append({"seed": seed, "kernel": kernel, "best_step": best["step"], "best_loss": best["loss"],
                     "stop_step": e["steps_run"]})
        progress(f"seed {seed}: best step {best['step']}, stopped at {e['steps_run']}")
    return runs


def main(argv: list[str] | None = None) -> None:
    import argparse


    parser = argparse.ArgumentParser(description="Run the walkthrough's training chapter (a few minutes on 2 cores) "
                                                 "and record what it shows.")
    parser.add_argument("--out", type=Path, default=RECORD,
                        help=f"where to write the record (default: {RECORD.relative_to(REPO_ROOT)}, which the page is made from)")
    parser.add_argument("--spread", action="store_true",
                        help=f"instead, rerun the early-stopping run with seeds {SPREAD_SEEDS} on this BLAS kernel and add "
                             f"the steps to {SPREAD_RECORD.relative_to(REPO_ROOT)} (about a minute a run)")
    args = parser.parse_args(argv)
    if args.spread:
        earlier = json.loads(SPREAD_RECORD.read_text(encoding="utf-8")) if SPREAD_RECORD.is_file() else []
        runs = earlier + rounded(early_stopping_spread())
        SPREAD_RECORD.write_text(json.dumps(runs, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {SPREAD_RECORD}")
        return
    out = args.out
    result = rounded(record())
    out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()


# --- The page ---------------------------------------------------------------------------------------

def load_record() -> dict[str, Any]:
    return walkthrough_common.read_record(RECORD, "python tools/walkthrough/walkthrough_chapter_train.py", "a few minutes")


def claim(holds: bool, what: str) -> None:
    walkthrough_common.claim(holds, what, "training chapter")


def data_part(rec: dict[str, Any]) -> str:
    d, run = rec["data"], rec["run"]
    T, B, N, per_epoch = run["context"], run["batch_size"], d["windows"], d["batches_per_epoch"]
    bundled = d["bundled"]
    rows = "\n".join(f"| {name} | {len(s['plays'])} | {s['characters']:,} | {s['tokens']:,} | "
                     f"{s['characters'] / s['tokens']:.2f} |" for name, s in d["splits"].items())
    held = ", ".join(d["splits"]["validation"]["plays"]), ", ".join(d["splits"]["test"]["plays"])
    first = "\n".join(f"| {i + 1} | `{a!r}` | `{b!r}` |" for i, (a, b) in enumerate(zip(*d["first_windows"])))
    return f"""**The data.** `data.shakespeare_split` cuts the plays into three fixed sets, **by play**, so no
scene of a held-out play was ever read in training: **train** (the only text whose gradients
change the weights), **validation** ({held[0]}: it picks the step to keep and the settings
to use) and **test** ({held[1]}: scored once, at the very end). The tokenizer is a {rec['config']['vocab_size']}-token
BPE trained on the train split only (`text_data.load_corpus`):

| split | plays | characters | tokens | characters per token |
|---|---:|---:|---:|---:|
{rows}

**Batches and epochs.** `text_data.WindowOrder` cuts the {d['splits']['train']['tokens']:,} training tokens into
N = {N:,} windows of T + 1 = {T + 1} tokens (T = {T}); a batch stacks B = {B} of them, so
**one epoch, one pass over every window, is N / B = {N:,} / {B} = {per_epoch:,} batches** (optimizer
steps). Each epoch starts the windows at a new random offset and visits them in a new random order,
so the model never sees the same batches twice. The first three windows of epoch 1 and of epoch 2
(their first 12 tokens):

| window | epoch 1 | epoch 2 |
|---:|---|---|
{first}

This run takes {run['steps']:,} steps: {run['steps'] / per_epoch:.2f} of an epoch. The run that trained the bundled model
({bundled['tokens']:,} tokens with its {BUNDLED_VOCAB:,}-token BPE, B × T = {bundled['batch_size']} × {bundled['context']}) had
N / B = {bundled['windows']:,} / {bundled['batch_size']} = **{bundled['batches_per_epoch']:,} batches per epoch**: its
{bundled['steps']:,} steps were {bundled['steps'] / bundled['batches_per_epoch']:.1f} epochs."""


def curve_part(rec: dict[str, Any]) -> str:
    h, run = rec["history"], rec["run"]
    evals = h["evals"]
    uniform = two(float(np.log(rec["config"]["vocab_size"])))
    claim(evals[-1]["loss"] < evals[0]["loss"] - 1, "validation loss falls by more than a nat")
    samples = "\n".join(f"| {s['step']} | `{s['text'].replace(chr(10), ' ↵ ')}` |" for s in h["samples"])
    shown = [e for e in evals if e["step"] % (4 * run["eval_every"]) == 0 or e["step"] == h["best_step"]]
    train_at = {e["step"]: np.mean(h["loss"][max(0, e["step"] - run["eval_every"]):e["step"]]) for e in shown if e["step"]}
    rows = "\n".join(f"| {e['step']} | {two(train_at[e['step']]) if e['step'] else '—'} | {two(e['loss'])} |" for e in shown)
    return f"""**Train and validation loss as it learns.** Every {run['eval_every']} steps the loop scores the first
{VALIDATION_TOKENS:,} tokens of each validation play with the inference forward pass
(`evaluation.score_text`); the training loss is each step's own batch, before its update. At step 0
the random model scores {two(evals[0]['loss'])} nats per token, near ln V = {uniform} (a uniform guess):

![train and validation loss](figures/training_run.png)

| step | training loss (mean of the last {run['eval_every']} steps) | validation loss |
|---:|---:|---:|
{rows}

What it writes, greedy, from `{PROMPT!r}` (`generate`, temperature 0), as it learns: first nothing
but line breaks (↵), then the layout of a play (speaker, colon, short lines), then words:

| step | greedy continuation of `{PROMPT!r}`, {SAMPLE_TOKENS} tokens |
|---:|---|
{samples}

**The step validation picks.** The lowest validation loss came at step {h['best_step']} ({two(h['best_loss'])}):
the loop keeps a copy of those weights, as `train` keeps `best.safetensors`; that copy is the model
this run would export. Here validation still fell at the end (the run is short, the text large), so
the best step is the last; the next run shows the other case."""


def early_stopping_part(rec: dict[str, Any]) -> str:
    e, s = rec["early_stopping"], SMALL_RUN
    best = min(e["evals"], key=lambda x: x["loss"])
    later = [x for x in e["evals"] if x["step"] > best["step"]]
    claim(bool(e["stopped"]) and e["steps_run"] < s["steps"] and len(later) == s["patience"],
          "the small-text run stops early")
    claim(all(x["loss"] > best["loss"] for x in later) and e["loss"][-1] < e["loss"][best["step"] - 1],
          "validation turns up while the training loss keeps falling")
    shown = [x for x in e["evals"] if x["step"] >= best["step"] - 2 * s["eval_every"]]
    rows = "\n".join(f"| {x['step']} | {two(np.mean(e['loss'][x['step'] - s['eval_every']:x['step']]))} | "
                     f"{two(x['loss'])} | {'best' if x is best else ''} |" for x in shown)
    flags = " ".join(f"--{k.replace('_', '-')} {s[k]:g}" for k in ("steps", "batch_size", "context", "lr", "warmup",
                                                                     "eval_every", "patience"))
    return f"""**Early stopping.** Now the same model on a small text it can learn by heart: the first
{e['lines']} lines of Hamlet ({e['characters']:,} characters), with the `train` command's own loop
(`trainer.run`; `--data FILE` validates on the file's last 5% of lines, here {e['lines'] // 20}; `chapter.json` is
`CONFIG` of `tools/walkthrough/walkthrough_chapter_train.py` written out):

```bash
python -m qwen_np train --config chapter.json --data small.txt --out /tmp/small \\
    {flags}
```

| step | training loss (mean of the last {s['eval_every']} steps) | validation loss | |
|---:|---:|---:|---|
{rows}

Validation was lowest at step {best['step']}; after that the training loss kept falling
while validation rose: the model memorises its {e['lines']} lines instead of learning what carries over to
other text (**overfitting**). After {s['patience']} evaluations without improvement (`--patience {s['patience']}`) the
run stopped, at step {e['steps_run']} of the {s['steps']:,} it was given ("{e['stopped']}"), and exported the
step-{best['step']} weights. More text, fewer steps, or a smaller model are the cures.

{spread_note(best['step'], e['steps_run'])}"""


def spread_note(best_step: int, stop_step: int) -> str:
    """Where the best and stop steps land over reruns (SPREAD_RECORD), around the recorded run's."""
    runs = json.loads(SPREAD_RECORD.read_text(encoding="utf-8"))
    kernels = {json.dumps(run["kernel"], sort_keys=True): run["kernel"] for run in runs}
    claim(any(run["seed"] == SMALL_RUN["seed"] and run["best_step"] == best_step and run["stop_step"] == stop_step
              for run in runs), "the spread's reruns include the recorded run's best and stop steps")
    claim(all(run["stop_step"] - run["best_step"] == SMALL_RUN["patience"] * SMALL_RUN["eval_every"] for run in runs),
          "every rerun stops `patience` evaluations after its best step")
    named = [kernel["OPENBLAS_CORETYPE"] or "the one OpenBLAS picks for the CPU" for kernel in kernels.values()]
    best, stop = [run["best_step"] for run in runs], [run["stop_step"] for run in runs]
    claim(max(stop) < SMALL_RUN["steps"], "every rerun stops early")
    return f"""These two steps are not fixed facts of the model: they move with anything that changes the run's
trajectory. Rerun with seeds {', '.join(str(x) for x in SPREAD_SEEDS)} on {len(kernels)} BLAS kernels
({' and '.join(named)}, which sum in different orders), {len(runs)} runs in all, the best step came between
{min(best)} and {max(best)} and the stop between {min(stop)} and {max(stop)}: every run overfitted and stopped early, at a step
of its own (`python tools/walkthrough/walkthrough_chapter_train.py --spread` records them in
`docs/figures/early_stopping_spread.json`). Read the steps above as one draw from that range."""


def one_step_part(rec: dict[str, Any]) -> str:
    o = rec["overfit_one_step"]
    claim(o["batch"][1] < o["batch"][0] and o["held_out"][1] > o["held_out"][0],
          "one step lowers its batch's loss and raises a held-out passage's")
    return f"""**Overfitting in one step.** Take the trained model, one batch of {o['rows']} training windows, and one
AdamW step from a fresh optimizer at learning rate {o['lr']:g}. The loss on the batch the step was
computed from falls, {two(o['batch'][0])} → {two(o['batch'][1])}; the loss on a held-out passage (the first
{rec['run']['context']} tokens of the validation text) rises, {two(o['held_out'][0])} → {two(o['held_out'][1])}. A gradient
points downhill for *its* batch only; averaged over many batches the directions that only suit one
cancel. That is why the training loss alone cannot tell learning from memorising, and why a held-out
set must decide."""


def noise_part(rec: dict[str, Any]) -> str:
    n, run = rec["noise"], rec["run"]
    cosines = [r["cosine"] for r in n["rows"]]
    claim(all(a < b for a, b in zip(cosines, cosines[1:])), "larger batches give gradients closer to the large batch's")
    rows = "\n".join(f"| {r['batch']} | {r['cosine']:.1f} | {mib(r['activations'])} | {mib(r['memory'])} |"
                     for r in n["rows"])
    return f"""**Batch size and gradient noise.** A batch's gradient estimates the gradient of the whole text.
At the random initialisation, the cosine between the gradient of B windows and that of
{n['reference_rows']} other windows (1: same direction, 0: unrelated), the mean of {n['draws']} batches each, with
what a step of that batch holds (`step_memory.training_memory`, T = {run['context']}):

| B | cosine with the {n['reference_rows']}-window gradient | activations | step total (weights, gradients, AdamW, activations) |
|---:|---:|---:|---:|
{rows}

One window's gradient is mostly noise; the noise averages out roughly as 1/sqrt(B), while the
activations grow as B: memory buys a steadier direction. (The cosines are printed to one decimal:
they vary from draw to draw.)"""


def accumulation_part(rec: dict[str, Any]) -> str:
    a, run = rec["accumulation"], rec["run"]
    micro = run["batch_size"] // a["micro_batches"]
    return f"""**Gradient accumulation.** The same batch of {run['batch_size']} windows, once whole and once as
{a['micro_batches']} micro-batches of {micro} (`training.loss_and_accumulated_gradients(model, batch, {a['micro_batches']})`,
the `--grad-accum {a['micro_batches']}` of `train`): the loss is {two(a['loss'][0])} both times, the gradients agree to
{below(a['gradient_difference'], 1e-6)} of their largest element (the order of FP32 sums differs), and the activations
alive at once drop from {mib(a['activations'][0])} to {mib(a['activations'][1])}. After one AdamW step from
either, no weight differs by more than {below(a['weight_difference'], 1e-3)} (a step moves each by about lr = {run['lr']:g}):
the same update, for a quarter of the activation memory, at the price of {a['micro_batches']} smaller passes."""


def checkpoint_part(rec: dict[str, Any]) -> str:
    r = rec["resume"]
    claim(r["identical"], "a stopped and resumed run ends with the straight run's weights")
    per = r["checkpoint_bytes"] / r["parameters"], r["exported_bytes"] / r["parameters"]
    groups = r["groups"]
    verdict = "identical, bit for bit" if r["identical"] else "different"
    return f"""**Checkpoints.** `train` saves `last.safetensors` at every evaluation: what the next step needs.
For this model ({r['parameters']:,} parameters) it holds {groups['param']} weight tensors, {groups['adam_m']} AdamW first
moments and {groups['adam_v']} second moments (all FP32), and in its header the run's state:
{', '.join(f'`{k}`' for k in r['state'])} and the loss history; `order` is the data position
(epoch {r['order']['epoch']}, {r['order']['position']} windows into it: with the seed, that fixes every
later batch). {r['checkpoint_bytes']:,} bytes, **{per[0]:.1f} bytes per parameter**, against
{r['exported_bytes']:,} bytes, {per[1]:.1f} per parameter, for the exported `model/model.safetensors` (BF16 weights
only: all that inference needs; the headers are the rest of the bytes).

Stop and resume: one run of {RESUME_RUN['steps']} steps straight through; another stopped after {RESUME_STOP}
steps and continued with `--resume --steps {RESUME_RUN['steps']}`. Their final weights are **{verdict}**
(all {r['tensors']} tensors compared with `np.array_equal`): the checkpoint holds everything the run depends on."""


def test_part(rec: dict[str, Any]) -> str:
    t, v = rec["test"], rec["validation_full"]
    return f"""**The test split, once.** Last, the kept weights score the test plays, whole:
{two(t['loss_per_token'])} nats per token ({t['bits_per_character']:.2f} bits per character, {t['tokens']:,} tokens), against
{two(v['loss_per_token'])} on the whole validation split. Once, because every look that leads to a decision (which
step, which learning rate, which model) fits the choice to the text looked at: validation has been
looked at {len(rec['history']['evals'])} times here and is no longer an unbiased estimate; the test split has never
influenced anything, so its score is the honest one. `python -m qwen_np eval --split test` does the
same for a saved model; use `--split validation` while choosing."""


def chapter_section(number: int) -> str:
    """The chapter's markdown, from the recorded run."""
    rec = load_record()
    run, c = rec["run"], rec["config"]
    parts = [data_part(rec), curve_part(rec), early_stopping_part(rec), one_step_part(rec), noise_part(rec),
             accumulation_part(rec), checkpoint_part(rec), test_part(rec)]
    return f"""## {number}. Train one yourself

Sections 9 and 10 took one step on the finished model. Here a Qwen3 learns from random weights:
{rec['parameters']:,} parameters (the bundled model's shape, smaller: D = {c['hidden_size']}, L = {c['num_hidden_layers']},
V = {c['vocab_size']}), {run['steps']:,} steps of B × T = {run['batch_size']} × {run['context']} tokens, peak learning rate
{run['lr']:g}.
Everything below is one run of `python tools/walkthrough/walkthrough_chapter_train.py` ({rec['seconds']:,.0f} s on
2 cores when it was recorded), which recorded it in `docs/figures/training_run.json`; the page
is written from that record, and the test suite repeats its first {CHECKED_STEPS} steps to check the
record still matches the code. Run it yourself (`--out my_run.json` keeps the committed record) and
compare: the digits after the second decimal
may differ on your machine (a long run amplifies the last-bit differences of BLAS kernels), the
story does not.

""" + "\n\n".join(parts)


def figure(data_: dict[str, Any]) -> Any:
    """The training figure: the run's losses, the early-stopping run, the schedule, gradient noise."""
    import matplotlib.pyplot as plt

    h, e, run = data_["history"], data_["early_stopping"], data_["run"]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), dpi=100)
    curve, early, schedule, noise = axes.ravel()
    steps = np.arange(1, len(h["loss"]) + 1)
    curve.plot(steps, h["loss"], color="#9ecae1", lw=0.8, label="training loss (each step's batch)")
    curve.plot([x["step"] for x in h["evals"]], [x["loss"] for x in h["evals"]], "o-", color="#d62728", ms=3,
               label="validation loss")
    curve.axvline(h["best_step"], color="#555555", ls=":", label=f"best validation: step {h['best_step']}")
    curve.set(title="The run: loss per token", xlabel="step", ylabel="nats per token")
    curve.legend(fontsize=8)
    early.plot(np.arange(1, len(e["loss"]) + 1), e["loss"], color="#9ecae1", lw=0.8, label="training loss")
    early.plot([x["step"] for x in e["evals"]], [x["loss"] for x in e["evals"]], "o-", color="#d62728", ms=3,
               label="validation loss")
    best = min(e["evals"], key=lambda x: x["loss"])
    early.axvline(best["step"], color="#555555", ls=":", label=f"best: step {best['step']}")
    early.axvline(e["steps_run"], color="#000000", ls="--", label=f"early stop: step {e['steps_run']}")
    early.set(title=f"A small text ({e['lines']} lines): overfitting, early stop", xlabel="step")
    early.legend(fontsize=8)
    schedule.plot(steps, h["lr"], color="#2ca02c")
    schedule.set(title=f"Learning rate: {run['warmup']}-step warmup, cosine decay", xlabel="step",
                 ylabel="learning rate")
    rows = data_["noise"]["rows"]
    noise.semilogx([r["batch"] for r in rows], [r["cosine"] for r in rows], "o-", base=2)
    noise.set(title="Gradient noise at init (labels: a step's memory)", xlabel="batch size B (windows)",
              ylabel=f"cosine with a {data_['noise']['reference_rows']}-window gradient", ylim=(0, 1))
    for r in rows:
        noise.annotate(f"{r['memory'] / 2 ** 20:.0f} MiB", (r["batch"], r["cosine"]), textcoords="offset points",
                       xytext=(4, -12), fontsize=8)
    fig.tight_layout()
    return fig


def notebook_code() -> str:
    """The chapter's notebook cell: the run's first CHECKED_STEPS steps, as a reader types them."""
    return f'''import tempfile

import matplotlib.pyplot as plt                                          # the plot extra
from qwen_np.core.config import Qwen3Config
from qwen_np.training import parameters

CONFIG = {pformat(CONFIG, width=100, sort_dicts=False)}
config = Qwen3Config.from_dict(parameters.hf_config(CONFIG))
corpus = text_data.load_corpus("shakespeare", Path(tempfile.mkdtemp()), CONFIG["vocab_size"], resume=False)
B, T = {RUN['batch_size']}, {RUN['context']}
print(len(corpus.train), "training tokens:", (len(corpus.train) - 1) // T // B, "batches per epoch")
params = parameters.init_parameters(config, seed={RUN['seed']})             # random weights
small = parameters.model_from_parameters(config, params)                    # the model IS these arrays
optimizer = training.adamw_for(params, weight_decay={RUN['weight_decay']})
order = text_data.WindowOrder(len(corpus.train), T, seed={RUN['seed']})
STEPS = {NOTEBOOK_STEPS}           # the chapter's run: {RUN['steps']} (python tools/walkthrough/walkthrough_chapter_train.py)
losses = []
for step in range(STEPS):
    windows = order.next_batch(corpus.train, B)                          # [B, T+1]
    step_loss, step_grads = training.loss_and_accumulated_gradients(small, windows, 1, threads=2, shards={RUN['shards']})
    training.clip_gradients(step_grads, {RUN['clip']})
    optimizer.update(params, step_grads, training.learning_rate(step, {RUN['lr']}, {RUN['warmup']}, {RUN['steps']}))
    losses.append(step_loss)
    if (step + 1) % 25 == 0:
        print(f"step {{step + 1}}: loss {{np.mean(losses[-25:]):.2f}} (mean of the last 25)")

plt.figure(figsize=(6, 3))
plt.plot(range(1, STEPS + 1), losses, lw=1)
plt.axhline(np.log(CONFIG["vocab_size"]), color="grey", ls=":", label="ln V: knowing nothing")
plt.xlabel("step")
plt.ylabel("training loss")
plt.legend()
plt.show()'''


def notebook_checks() -> dict[str, Any]:
    """Expressions over the notebook's variables after that cell, and what the record says they are."""
    rec = load_record()
    return {"(len(corpus.train) - 1) // T // B": rec["data"]["batches_per_epoch"],
            f"bool(np.allclose(losses[:{CHECKED_STEPS}], {rec['history']['loss'][:CHECKED_STEPS]!r}, rtol=1e-3))": True}
