"""Exercise 2 (section 1): learn BPE merges, as a tokenizer is trained.

Byte-pair encoding starts from single characters and learns merges one at a time: count every pair of
neighbouring symbols over the corpus (a word seen c times counts c times), merge the most frequent pair
into one new symbol everywhere, and repeat. Write `learn_merges(word_counts, n)`: the first n merges, in
order, as (left, right) pairs. Ties: the pair whose left symbol came first in the vocabulary wins, then its
right symbol (the vocabulary: the corpus's characters sorted, then each merged symbol in the order it was
made), as the `tokenizers` library's BpeTrainer breaks them. Words never merge across their ends. The
check trains `tokenizers`' BPE on the same words and compares the merges.
"""

from __future__ import annotations

from collections import Counter


def learn_merges(word_counts: dict[str, int], n: int) -> list[tuple[str, str]]:
    """The first n merges learned from {word: count}, each (left, right); fewer when no pair is left."""
    order = {symbol: i for i, symbol in enumerate(sorted({c for word in word_counts for c in word}))}
    words = {word: list(word) for word in word_counts}
    merges: list[tuple[str, str]] = []
    for _ in range(n):
        pairs: Counter[tuple[str, str]] = Counter()
        for word, symbols in words.items():
            for pair in zip(symbols, symbols[1:]):
                pairs[pair] += word_counts[word]
        if not pairs:
            break
        best = max(pairs, key=lambda p: (pairs[p], -order[p[0]], -order[p[1]]))
        merges.append(best)
        order.setdefault(best[0] + best[1], len(order))
        words = {word: merge(symbols, best) for word, symbols in words.items()}
    return merges


def merge(symbols: list[str], pair: tuple[str, str]) -> list[str]:
    """One merge applied left to right: ["a", "a", "a"] with ("a", "a") -> ["aa", "a"]."""
    out: list[str] = []
    i = 0
    while i < len(symbols):
        if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == pair:
            out.append(symbols[i] + symbols[i + 1])
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return out
