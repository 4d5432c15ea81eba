"""Compression of the Shakespeare BPE at several vocabulary sizes: tokens per character.

For each size, trains ``qwen_np.training.data.train_tokenizer`` on the train split only and encodes the
train and validation splits. Fewer tokens per character means shorter sequences (cheaper training,
more text per context window) but a larger embedding and LM head and rarer tokens to learn; the
choice itself is by validation loss per character, which needs trained models (this tool only
reports the compression side).

Per-character figures use ``qwen_np.training.data.characters`` (separators excluded); the token counts
include the ``<|endoftext|>`` separators.

Usage: python tools/choose_vocab.py [--sizes 512 1024 2048 4096 8192]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))   # run from a checkout without installing the package

from qwen_np.training.data import characters, encode_corpus, shakespeare_split, train_tokenizer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    args = parser.parse_args()

    splits = {name: shakespeare_split(name) for name in ("train", "validation")}
    print("| split | plays | characters |")
    print("|---|---|---|")
    for name, text in splits.items():
        print(f"| {name} | {text.count('<|endoftext|>') + 1} | {characters(text):,} |")
    print()
    print("| vocab | train tokens/char | validation tokens/char | validation chars/token |")
    print("|---|---|---|---|")
    for size in args.sizes:
        tokenizer = train_tokenizer(splits["train"], size)
        ratios = {name: len(encode_corpus(tokenizer, text)) / characters(text) for name, text in splits.items()}
        print(f"| {size} | {ratios['train']:.4f} | {ratios['validation']:.4f} | {1 / ratios['validation']:.3f} |",
              flush=True)


if __name__ == "__main__":
    main()
