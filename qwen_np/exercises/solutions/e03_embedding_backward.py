"""Exercise 3 (section 2): the embedding table's gradient.

The embedding is a lookup, x = table[ids]. Its backward sends each position's gradient d_out[t] to the row
of its token: write `embedding_backward(d_out, ids, vocab_size)`, the [V, D] gradient of the table. A
token that appears twice gets both positions' gradients added (the check's ids repeat). Graded against
qwen_np.training.gradients.embed_backward.
"""

from __future__ import annotations

import numpy as np


def embedding_backward(d_out: np.ndarray, ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """d_out [T, D], ids [T] -> d_table [V, D]: row v holds the sum of d_out over the positions of token v."""
    d_table = np.zeros((vocab_size, d_out.shape[-1]), dtype=np.float32)
    np.add.at(d_table, ids, d_out)          # unbuffered: d_table[ids] += d_out would keep one of two repeats
    return d_table
