"""Training in each precision, side by side: `python -m bench.precision_training [--png loss.png]`.

Runs `train --preset tiny` (Shakespeare, the same seed, data order and steps) once per precision: fp32,
bf16, fp16 with dynamic loss scaling, fp16 without it, fp8 (E4M3, DeepSeek-V3's tiles). Prints each
run's final and best validation loss (the FP32 forward of the FP32 master weights), its last training
loss, skipped steps and tokens/s; then, on the bundled Shakespeare model, what FP16 without loss scaling
loses (the share of nonzero gradient values entering the backward's products that FP16 flushes to 0, at
loss scales 1, 2^8 and 2^16) and why the master weights stay FP32 (the share of its weights that an
update of 2e-4 cannot move if they are held in BF16). --png draws the runs' validation curves.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

RUNS: dict[str, dict[str, Any]] = {
    "fp32": {"precision": "fp32"},
    "bf16": {"precision": "bf16"},
    "fp16 (loss scaling)": {"precision": "fp16"},
    "fp16 (no loss scaling)": {"precision": "fp16", "loss_scaling": False},
    "fp8 (E4M3, 1x128 / 128x128)": {"precision": "fp8"},
}
BUNDLED = Path(__file__).parents[1] / "weights"


def train_each(steps: int, eval_every: int) -> dict[str, dict[str, Any]]:
    """Each precision's run state as its checkpoint holds it (history, evals, ...)."""
    from qwen_np.training import trainer, run_spec

    metas = {}
    with tempfile.TemporaryDirectory() as folder:
        for i, (name, overrides) in enumerate(RUNS.items()):
            spec = run_spec.RunSpec(Path(folder) / f"run{i}", preset="tiny",
                                   overrides={"steps": steps, "eval_every": eval_every, "threads": 1, **overrides})
            metas[name] = trainer.run(spec).state.to_json()
            print(row(name, metas[name]), flush=True)
    return metas


def row(name: str, meta: dict[str, Any]) -> str:
    history = meta["history"]
    skipped = sum(1 for h in history if h.get("skipped"))
    rate = sorted(h["tokens_per_s"] for h in history)[len(history) // 2]
    return (f"| {name} | {meta['evals'][-1]['loss_per_token']:.4f} | {meta['best_loss']:.4f} | "
            f"{history[-1]['loss']:.4f} | {skipped} | {rate:.0f} |")


LOSS_SCALES = (1.0, 2.0 ** 8, 2.0 ** 16)     # FP16 without loss scaling, and at two fixed scales
UPDATES = (1e-4, 2e-4, 1e-3)                 # update sizes tried on weights held in BF16


def bundled_measurements() -> dict[str, dict[float, float]]:
    """On the bundled model: the share of nonzero gradient values FP16 flushes to 0 at each loss scale, and the
    share of weights held in BF16 that an update of each size cannot move."""
    import numpy as np

    from qwen_np.training import data, mixed, step as training
    from qwen_np.engine.loading import load_model
    from qwen_np.files.tokenizer import Tokenizer

    model = load_model(BUNDLED, memory="fp32")
    ids = np.array(Tokenizer.from_folder(BUNDLED).encode(data.shakespeare_split("validation")[:40_000]))
    batch = ids[:8 * 129].reshape(8, 129)                                          # [B, T+1]
    weights = np.concatenate([p.ravel() for p in training.named_parameters(model).values()])
    return {"underflow": {scale: training.fp16_underflow(model, batch, scale) for scale in LOSS_SCALES},
            "stalled": {update: mixed.stalled_by_update(weights, update) for update in UPDATES}}


def print_bundled(measured: dict[str, dict[float, float]]) -> None:
    for scale, share in measured["underflow"].items():
        print(f"FP16 at loss scale {scale:>7g}: {100 * share:.2f}% of the nonzero gradient values flush to 0")
    for update, share in measured["stalled"].items():
        print(f"weights held in BF16: an update of {update:g} cannot move {100 * share:.1f}% of them")


def plot(metas: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for name, meta in metas.items():
        ax.plot([e["step"] for e in meta["evals"]], [e["loss_per_token"] for e in meta["evals"]], "o-",
                markersize=3, label=name)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation cross-entropy (nats per token)")
    ax.set_title("train --preset tiny in each --precision (same seed and data)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.precision_training", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--png", type=Path, help="draw the validation curves here")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write each run's losses and the bundled "
                                                                  "model's measurements here")
    args = parser.parse_args(argv)
    print(f"train --preset tiny --steps {args.steps} --eval-every {args.eval_every} --threads 1, per precision")
    print("| precision | final validation loss | best | last training loss | skipped steps | tokens/s |")
    print("|---|---:|---:|---:|---:|---:|")
    metas = train_each(args.steps, args.eval_every)
    if args.png:
        plot(metas, args.png)
    measured = bundled_measurements()
    print_bundled(measured)
    if args.json:
        args.json.write_text(json.dumps(record(args.steps, args.eval_every, metas, measured), indent=1) + "\n",
                             encoding="utf-8")


def record(steps: int, eval_every: int, metas: dict[str, dict[str, Any]],
           measured: dict[str, dict[float, float]]) -> dict[str, Any]:
    """What --json writes: each run's per-step training loss and validation losses, and the bundled measurements."""
    runs = {name: {"loss": [h["loss"] for h in meta["history"]],
                   "evals": [{"step": e["step"], "loss": e["loss_per_token"]} for e in meta["evals"]],
                   "best_loss": meta["best_loss"], "skipped": sum(1 for h in meta["history"] if h.get("skipped"))}
            for name, meta in metas.items()}
    return {"preset": "tiny", "steps": steps, "eval_every": eval_every, "runs": runs,
            "underflow": {f"{k:g}": v for k, v in measured["underflow"].items()},
            "stalled": {f"{k:g}": v for k, v in measured["stalled"].items()}}


if __name__ == "__main__":
    main()
