"""Chat batches, padded or packed: conversation tokens a second of a LoRA training step (`python -m bench.chat_batches`).

A random Qwen3 (hidden 64, 2 layers, the real tokenizer's vocabulary, tied; LoRA rank 8 on all seven projections),
conversations of 4 to 42 words (about 25 to 80 tokens) rendered by Qwen3's chat template, batches of 8 at
--context 128, three ways:
  padded to the context   every row context + 1 tokens (the padding computed, never learned)
  padded to the longest   every row as long as the batch's longest conversation (the trainer's way: chats.padded_rows)
  packed                  conversations one after another, cut into rows of context + 1 (no padding, but a
                          conversation attends to the ones before it in its row and starts past position 0)
Tokens a second count the conversations' own tokens (not the padding); median of --repeats steps each.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import numpy as np

from qwen_np.core.config import Qwen3Config
from qwen_np.files.tokenizer import Tokenizer
from qwen_np.training import chats, lora
from qwen_np.training.step import loss_and_accumulated_gradients
from qwen_np.training.parameters import init_parameters, model_from_parameters

TOKENIZER = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "qwen3_tokenizer_random"
CONFIG = dict(vocab_size=151936, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, tie_word_embeddings=True)
WORDS = "the king and queen of this fair land shall speak to thee my lord what news from rome".split()


def conversations(tokenizer: Tokenizer, count: int, seed: int) -> list[chats.Chat]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12)))
        answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 30)))
        out.append(chats.chat_tokens(tokenizer, [{"role": "user", "content": question},
                                                 {"role": "assistant", "content": answer}]))
    return out


def padded_to_context(batch: list[chats.Chat], context: int) -> tuple[np.ndarray, np.ndarray]:
    ids, learned = chats.padded_rows(batch, context, 0)
    width = context + 1
    return (np.pad(ids, ((0, 0), (0, width - ids.shape[1]))),
            np.pad(learned, ((0, 0), (0, width - learned.shape[1]))))


def packed(batch: list[chats.Chat], context: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.concatenate([chat.ids for chat in batch])
    learned = np.concatenate([chat.learned for chat in batch])
    rows = max(1, len(ids) // (context + 1))
    cut = rows * (context + 1)
    return ids[:cut].reshape(rows, -1), learned[:cut].reshape(rows, -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    config = Qwen3Config(**CONFIG)
    model = model_from_parameters(config, init_parameters(config, seed=0))
    lora.add_adapters(model, rank=8)
    data = conversations(Tokenizer.from_folder(TOKENIZER), 8 * args.repeats, seed=0)
    ways = {"padded to the context": lambda b: padded_to_context(b, args.context),
            "padded to the longest": lambda b: chats.padded_rows(b, args.context, 0),
            "packed": lambda b: packed(b, args.context)}
    for name, rows in ways.items():
        rates = []
        for repeat in range(args.repeats):
            batch = data[8 * repeat:8 * (repeat + 1)]
            ids, learned = rows(batch)
            real = min(sum(len(chat.ids) for chat in batch), ids.size)
            started = time.perf_counter()
            loss_and_accumulated_gradients(model, ids, 1, threads=args.threads, learned=learned)
            rates.append(real / (time.perf_counter() - started))
        print(f"{name:<24} {ids.shape[0]} x {ids.shape[1]:>3} tokens  {statistics.median(rates):8.0f} tokens/s")


if __name__ == "__main__":
    main()
