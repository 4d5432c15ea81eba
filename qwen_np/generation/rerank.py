"""Reranking: how relevant each document is to a query, as Qwen3-Reranker defines it.

    from qwen_np import load_model
    from qwen_np.files.model_files import read_tokenizer
    from qwen_np.generation.rerank import rerank

    scores = rerank(model, tokenizer, "Why is the sky blue?", ["Rayleigh scattering ...", "Paris is ..."])

Qwen3-Reranker is a Qwen3 causal LM asked a yes/no question (its model card's code): a system turn saying the
answer can only be "yes" or "no", a user turn `<Instruct>: {instruction}\\n<Query>: {query}\\n<Document>:
{document}`, and the assistant turn opened with an empty think block; the score is P("yes") of a softmax over
just the last position's logits of the tokens "yes" and "no". The three parts are tokenised apart, as the
model card's code does (the prefix and suffix with their special tokens, the user's text as text).

The forward passes are embedding.Embedding's (the final norm's output at each prompt's last position, short
prompts packed, long ones chunked), so a server runs them between its generation steps the same way; the
LM head then multiplies those rows only, and only "yes" and "no" of its logits are kept.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..core import layers
from ..core.adapters import Adapter
from ..core.model import Qwen3Model
from ..errors import QwenNPError
from ..files.tokenizer import Tokenizer
from .embedding import Embedding

SYSTEM = ('Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
          'Note that the answer can only be "yes" or "no".')
PREFIX = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
ANSWERS = ("yes", "no")
HEAD_ROWS = 64                       # documents whose logits [HEAD_ROWS, V] are computed at once


def rerank_ids(tokenizer: Tokenizer, query: str, document: str, instruction: str = DEFAULT_INSTRUCTION) -> list[int]:
    """The token ids Qwen3-Reranker reads for one (query, document) pair."""
    text = f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
    return (tokenizer.encode(PREFIX, parse_special=True) + tokenizer.encode(text, parse_special=False)
            + tokenizer.encode(SUFFIX, parse_special=True))


class Reranking(Embedding):
    """The scores of (query, document) pairs (`ids`: rerank_ids of each), computed one forward pass at a time
    as an Embedding's passes are (step(); a server runs them between its generation steps), then read off
    the LM head's "yes" and "no" rows (scores)."""

    def __init__(self, model: Qwen3Model, tokenizer: Tokenizer, ids: list[list[int]],
                 adapter: Adapter | None = None) -> None:
        if not model.has_head:
            raise QwenNPError("rerank: this checkpoint has no LM head (an embedding model); a reranker is a Qwen3 "
                              "with its head, such as Qwen3-Reranker")
        try:
            self.answers = [tokenizer.token_to_id(answer) for answer in ANSWERS]
        except QwenNPError:
            raise QwenNPError(f"rerank: this tokenizer has no {' and '.join(map(repr, ANSWERS))} tokens") from None
        super().__init__(model, ids, adapter=adapter)

    @property
    def scores(self) -> np.ndarray:
        """P("yes") of each document [N] (float64), once step() has said every pass is done: a two-way softmax
        of the last position's "yes" and "no" logits. The head multiplies HEAD_ROWS documents at a time, so
        their [rows, V] logits stay small, whatever format holds it."""
        pair = np.concatenate([layers.linear(self.hidden[i:i + HEAD_ROWS], self.model.lm_head)[:, self.answers]
                               for i in range(0, len(self.hidden), HEAD_ROWS)]).astype(np.float64)    # [N, 2]
        pair -= pair.max(axis=1, keepdims=True)
        return np.exp(pair[:, 0]) / np.exp(pair).sum(axis=1)


def rerank(model: Qwen3Model, tokenizer: Tokenizer, query: str, documents: Sequence[str],
           instruction: str = DEFAULT_INSTRUCTION) -> np.ndarray:
    """P("yes") [N] of each document for the query (Qwen3-Reranker's score; higher: more relevant)."""
    job = Reranking(model, tokenizer, [rerank_ids(tokenizer, query, document, instruction) for document in documents])
    while not job.step():
        pass
    return job.scores
