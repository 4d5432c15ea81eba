"""How well a model predicts a text: loss per token, perplexity, and loss per character.

The text is cut into documents at `<|endoftext|>` (the Shakespeare splits join plays with it). Each
document is scored on its own, read in windows of `context` tokens, each window predicting its tokens
from the ones before it in that window (stride = context, so every token is predicted exactly once).
When the tokenizer has an end-of-text token, it starts each document, as it does in training, so the
document's first token is predicted too.

Per-token figures depend on the tokenizer; per-character figures (nats and bits per character of the
text, separators excluded) compare models with different tokenizers.
"""

from __future__ import annotations

import math
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from ..engine import memory, runtime
from .data import END_OF_TEXT
from ..core.layers import log_softmax
from ..errors import QwenNPError



@dataclass
class TextScore:
    """Summed negative log-likelihood over a text, with the counts it is divided by."""

    nats: float = 0.0          # sum over predicted tokens of -log p(token)
    tokens: int = 0            # predicted tokens
    characters: int = 0        # characters of the text (separators excluded)

    def add(self, nats: float, tokens: int) -> None:
        self.nats += nats
        self.tokens += tokens

    def summary(self) -> dict[str, Any]:
        loss = self.nats / max(1, self.tokens)
        per_char = self.nats / max(1, self.characters)
        return {**asdict(self), "loss_per_token": loss, "perplexity": math.exp(loss),
                "nats_per_character": per_char, "bits_per_character": per_char / math.log(2)}




def documents(text: str) -> list[str]:
    """The non-empty documents of a text joined by <|endoftext|>."""
    return [doc for doc in text.split(END_OF_TEXT) if doc]


def windows(ids: np.ndarray, context: int) -> Iterator[np.ndarray]:
    """Overlapping-by-one windows of at most context + 1 tokens: window i reads tokens
    [i*context, (i+1)*context) and predicts [i*context + 1, (i+1)*context + 1)."""
    for start in range(0, len(ids) - 1, context):
        yield ids[start:start + context + 1]


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log softmax(logits)[target] per row, in float64.  logits [N, V], targets [N] -> [N]."""
    return -log_softmax(logits)[np.arange(len(targets)), targets]


def encoded_documents(tokenizer: Any, text: str) -> tuple[list[np.ndarray], int]:
    """Each document's ids (preceded by <|endoftext|> when the tokenizer has it) and the characters."""
    docs = documents(text)
    if not docs:
        raise QwenNPError("the text is empty", "text")
    try:
        start: int | None = tokenizer.token_to_id(END_OF_TEXT)
    except QwenNPError:
        start = None
    ids = [np.asarray(([start] if start is not None else []) + tokenizer.encode(doc), dtype=np.int64) for doc in docs]
    return ids, sum(len(doc) for doc in docs)


def score_text(logits_of: Callable[[np.ndarray], np.ndarray], docs: list[np.ndarray], characters: int,
               context: int, progress: Callable[[int], None] = lambda n: None, jobs: int = 1,
               learned: list[np.ndarray] | None = None) -> TextScore:
    """Score documents window by window. logits_of maps ids [T] to logits [T, V] (e.g. model.forward);
    jobs: windows scored at once, on threads of their own (runtime.independent_jobs); the sum is taken
    in window order, so the score does not depend on it. learned: per document, which tokens count
    (a chat's assistant tokens, chats.chat_tokens); every token is still read as context."""
    shown = threading.Lock()                     # progress (a tqdm bar) is called from the jobs' threads
    masks = learned if learned is not None else [np.ones(len(ids), dtype=bool) for ids in docs]

    def window_nats(job: tuple[np.ndarray, np.ndarray]) -> tuple[float, int]:
        window, counted = job
        nll = token_nll(logits_of(window[:-1]), window[1:])                          # [T]
        with shown:
            progress(len(nll))
        return float(nll[counted[1:]].sum()), int(counted[1:].sum())

    jobs_in_order = [job for ids, mask in zip(docs, masks) for job in zip(windows(ids, context), windows(mask, context))]
    score = TextScore(characters=characters)
    for nats, tokens in runtime.independent_jobs(window_nats, jobs_in_order, jobs):
        score.add(nats, tokens)
    if score.tokens == 0:
        raise QwenNPError("too short to score (needs at least two tokens)", "text")
    return score


def window_jobs(model: Any, context: int) -> int:
    """How many windows to score at once: one per thread, fewer when the RAM left after the weights cannot
    hold that many windows' activations: each its forward's, and its logits' log-softmax, which holds two
    float64 [T, V] arrays beside the float32 logits (20 bytes a logit: 3.1 GB for a 1,024-token window at
    Qwen3's vocabulary)."""
    config, plan = model.config, model.plan
    one_window = memory.working_bytes(config, context, chunk=context) + context * config.vocab_size * 16
    if plan is None:
        return runtime.threads_wanted()
    room = plan.room_for_kv_cache + plan.working_bytes          # the plan's working set is one chunk's
    return max(1, min(runtime.threads_wanted(), room // one_window))


def read_eval_text(path: Path | None, split: str | None) -> tuple[str, str]:
    """(a name for the report, the text): a file, or a Shakespeare split (test by default)."""
    from . import data

    if path is not None:
        return str(path), data.read_text(path)
    name = split or "test"
    return f"Shakespeare {name} split", data.shakespeare_split(name)
