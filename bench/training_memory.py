"""The training memory plan against the measured peak (`python -m bench.training_memory`).

`train --model M --data chats.jsonl` as the command runs it (trainer.run, README's defaults: 16 conversations a
step, --context 256), with LoRA rank 8 on all seven projections and with every weight trained, on random Qwen3s
of a few sizes with the real tokenizer's 151,936-token vocabulary (tied), each configuration in its own process.
The data: 40 short chats (about 27 tokens each, as a new user's first try) or 40 long ones (about 100). The run's
own figures: the plan it prints before its first step (trainer.TrainingMemory.predicted: the process's RSS before
the model is built plus engine.step_memory.training_memory's peak moment) and the peak RSS it measured from the
model's load through its last step (VmHWM, restarted there), and their ratio. --steps steps each (the second
and later with AdamW's moments), then the validation.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from qwen_np.core.config import LAYER_MATRICES, Qwen3Config
from qwen_np.engine.step_memory import training_peak
from qwen_np.training import trainer, run_spec
from qwen_np.training.lora import LoraSettings

from .checkpoints import TOKENIZER, write_random_checkpoint

VOCABULARY = dict(vocab_size=151936, max_position_embeddings=4096, tie_word_embeddings=True)
SIZES = {  # name: Qwen3Config's shapes (with VOCABULARY)
    "hidden 64, 2 layers": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=32),       # the 20 MB random model
    "hidden 256, 4 layers": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=64),
    "hidden 512, 8 layers": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                                 num_key_value_heads=4, head_dim=64),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128),               # 12 GiB for a full step: --sizes to ask
}
DEFAULT_SIZES = ("hidden 64, 2 layers", "hidden 256, 4 layers", "hidden 512, 8 layers")
KINDS = ("lora", "full")
CHATS = {"short": (2, 4), "long": (20, 30)}     # words in a question, in an answer (x 1..2 for the answer)
WORDS = "the king and queen of this fair land shall speak to thee my lord what news from rome".split()


def write_chats(path: Path, length: str, count: int = 40) -> Path:
    """`count` conversations of a user's question and the assistant's answer, of CHATS[length] words."""
    rng = random.Random(0)
    question, answer = CHATS[length]
    with path.open("w", encoding="utf-8") as f:
        for _ in range(count):
            messages = [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(question))},
                        {"role": "assistant", "content": " ".join(rng.choice(WORDS)
                                                                  for _ in range(rng.randint(answer, 2 * answer)))}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def write_model(folder: Path, size: str) -> Path:
    """A random BF16 checkpoint of SIZES[size] with the real tokenizer's files."""
    folder.mkdir()
    write_random_checkpoint(folder, Qwen3Config(**VOCABULARY, **SIZES[size]))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TOKENIZER / name, folder / name)
    return folder


def one(size: str, kind: str, length: str, steps: int) -> dict[str, object]:
    """One run in this process: the plan's predicted peak and the measured one (bytes)."""
    with tempfile.TemporaryDirectory(prefix="qwen_np_bench_") as tmp:
        folder = Path(tmp)
        model = write_model(folder / "model", size)
        data = write_chats(folder / "chats.jsonl", length)
        lora = LoraSettings(8, None, LAYER_MATRICES) if kind == "lora" else None
        result = trainer.run(run_spec.RunSpec(folder / "run", model=str(model), data=str(data), lora=lora,
                                             overrides={"steps": steps}))
        memory = result.memory
        return {"size": size, "kind": kind, "chats": length, "predicted": memory.predicted, "measured": memory.peak,
                "baseline": memory.baseline, "moment": training_peak(memory.estimate)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", choices=SIZES, default=DEFAULT_SIZES, metavar="SIZE",
                        help=f"models to run (default: the three small ones; one of {', '.join(SIZES)})")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=KINDS)
    parser.add_argument("--chats", nargs="+", choices=CHATS, default=tuple(CHATS))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--only", nargs=3, help=argparse.SUPPRESS)     # SIZE KIND CHATS: one run (a worker)
    args = parser.parse_args()
    if args.only:
        print(json.dumps(one(*args.only, args.steps)))
        return
    print(f"{'model':<22} {'run':<5} {'chats':<6} {'predicted':>10} {'measured':>10} {'ratio':>6}  peak moment")
    for size in args.sizes:
        for kind in args.kinds:
            for length in args.chats:
                worker = subprocess.run([sys.executable, "-m", "bench.training_memory", "--only", size, kind, length,
                                         "--steps", str(args.steps)], capture_output=True, text=True)
                if worker.returncode:
                    print(f"{size:<22} {kind:<5} {length:<6} failed: {worker.stderr.strip().splitlines()[-1:]}")
                    continue
                r = json.loads(worker.stdout.strip().splitlines()[-1])
                print(f"{size:<22} {kind:<5} {length:<6} {r['predicted'] / 2**20:6.0f} MiB {r['measured'] / 2**20:6.0f} MiB "
                      f"{r['measured'] / r['predicted']:6.2f}  {r['moment']}", flush=True)


if __name__ == "__main__":
    main()
