"""A text run's data: its text split and encoded (load_corpus: a Corpus, with the SHA-256 a resumed run
checks), and the shuffled windows of context + 1 tokens its batches are (WindowOrder), together TextData
(a chat run's counterpart is chats.ChatData)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import evaluation
from ..core.model import Qwen3Model
from ..errors import QwenNPError
from ..files.tokenizer import Tokenizer
from .data import END_OF_TEXT


@dataclass
class WindowOrder:
    """Epochs over the training tokens as shuffled windows of context + 1 tokens.

    Each epoch draws, from a generator seeded by (seed, epoch), an offset in [0, context) where the
    windows start and a permutation of them, so windows differ from epoch to epoch and the order is
    reproducible from (seed, epoch, position) alone: that triple is the data's RNG state.
    """

    n_tokens: int
    context: int
    seed: int
    epoch: int = 0
    position: int = 0             # windows of this epoch already used

    def _epoch(self) -> tuple[int, np.ndarray]:
        rng = np.random.default_rng([self.seed, self.epoch])
        offset = int(rng.integers(self.context))
        count = (self.n_tokens - 1 - offset) // self.context
        if count < 1:
            raise QwenNPError(f"{self.n_tokens} tokens are too few for one window of the context ({self.context})", "data")
        return offset, rng.permutation(count)

    def next_batch(self, tokens: np.ndarray, batch_size: int) -> np.ndarray:
        """The next batch_size windows [B, context + 1], continuing into the next epoch when one ends."""
        rows: list[np.ndarray] = []
        while len(rows) < batch_size:
            offset, order = self._epoch()
            if self.position >= len(order):
                self.epoch, self.position = self.epoch + 1, 0
                continue
            start = offset + int(order[self.position]) * self.context
            rows.append(tokens[start:start + self.context + 1])
            self.position += 1
        return np.stack(rows).astype(np.int64)


@dataclass
class Corpus:
    """What a run trains and validates on."""

    train: np.ndarray                    # token ids of the training text
    validation: list[np.ndarray]         # documents, each starting with <|endoftext|>
    validation_characters: int
    sha256: str                          # of the training and validation text (corpus_sha256)


def load_corpus(data: str, out: Path, vocab_size: int, resume: bool, sha256: str | None = None,
                tokenizer: Tokenizer | None = None) -> Corpus:
    """Train (or, resuming, reload) the tokenizer in `out`, and encode the training and validation text.
    tokenizer (a run from --model): the model's own encodes the text instead, each document after its
    <|endoftext|>.

    --data shakespeare uses data.py's fixed by-play splits. A text FILE is split at a line boundary:
    the last 5% of its lines validate, the rest train. sha256 (a resumed run's): the text must be the
    one the run began on, or a QwenNPError names --data before any work is done.
    """
    from . import data as corpora

    if data == "shakespeare":
        train_text, valid_text = corpora.shakespeare_split("train"), corpora.shakespeare_split("validation")
    else:
        lines = corpora.read_text(data).splitlines(keepends=True)
        cut = len(lines) - max(1, len(lines) // 20)
        train_text, valid_text = "".join(lines[:cut]), "".join(lines[cut:])
        if not train_text.strip() or not valid_text.strip():
            raise QwenNPError(f"{data} is too short to split into training and validation text", "data")
    digest = corpus_sha256(train_text, valid_text)
    if sha256 is not None and digest != sha256:
        raise QwenNPError(f"{data} is not the text the run in {out} began on (SHA-256 {digest[:16]}..., the "
                          f"checkpoint's {sha256[:16]}...: edited or replaced since); resuming would train on other "
                          "text with the old text's tokenizer: put the original back, or start a new run", "data")
    if tokenizer is None:
        if not resume:
            corpora.save_tokenizer(corpora.train_tokenizer(train_text, vocab_size), out)
        tokenizer = Tokenizer.from_folder(out)
        if tokenizer.vocab_size != vocab_size:
            raise QwenNPError(f"{out}/tokenizer.json: {tokenizer.vocab_size} tokens, but the config's vocab_size is "
                              f"{vocab_size} (the text is too small for that many BPE merges?)")
    bpe = tokenizer.backend                                                  # encode_corpus's fast batch encoder
    separator = np.array([tokenizer.token_to_id(END_OF_TEXT)], dtype=np.int32)
    train_docs = [corpora.encode_corpus(bpe, doc) for doc in evaluation.documents(train_text)]
    train = np.concatenate([part for doc in train_docs for part in (separator, doc)])
    valid, characters = evaluation.encoded_documents(tokenizer, valid_text)
    return Corpus(train, valid, characters, digest)


def corpus_sha256(train_text: str, validation_text: str) -> str:
    """The SHA-256 of a run's text, its training and validation parts (as normalised: what is trained on)."""
    return hashlib.sha256(f"{len(train_text)}\0{train_text}{validation_text}".encode()).hexdigest()


@dataclass
class TextData:
    """A text run's data and its place in the training windows (a chat run's: chats.ChatData)."""

    corpus: Corpus
    order: WindowOrder

    @property
    def sha256(self) -> str:
        return self.corpus.sha256

    def next_batch(self, batch_size: int) -> tuple[np.ndarray, None]:
        """The next batch_size windows [B, context + 1]; every token is learned (None: no mask)."""
        return self.order.next_batch(self.corpus.train, batch_size), None

    def validate(self, model: Qwen3Model) -> dict[str, Any]:
        """Loss on the validation documents, with the inference forward pass (what generation runs)."""
        return evaluation.score_text(model.forward, self.corpus.validation, self.corpus.validation_characters,
                                     self.order.context).summary()

    def describe(self) -> str:
        return f"{len(self.corpus.train):,} tokens"
