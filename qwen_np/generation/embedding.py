"""Embeddings: one unit vector per text, as Qwen3-Embedding defines them.

    from qwen_np import embed, load_model
    from qwen_np.files.checkpoint import resolve_model_path
    from qwen_np.files.model_files import read_tokenizer

    folder = resolve_model_path("Qwen/Qwen3-Embedding-0.6B")
    model, tokenizer = load_model(folder), read_tokenizer(folder)
    vectors = embed(model, ["Instruct: Given a question, find its answer\\nQuery:Why is the sky blue?",
                            "Rayleigh scattering makes short wavelengths..."], tokenizer)    # [2, D]
    similarity = vectors @ vectors.T

Qwen3-Embedding is a Qwen3 decoder without its LM head (a bare Qwen3Model checkpoint: load_model
reads it). A text's embedding is the final norm's output at the last of the ids its tokenizer gives,
with the tokenizer's post-processor applied (Qwen3-Embedding's appends <|endoftext|>, so the vector is
read where the model has seen the whole text), L2-normalised: "last-token pooling". The decoder's
causal attention is why the last position, and only it, has read every token. Queries carry their
task as `Instruct: {task}\\nQuery:{query}` (the model card), which the caller writes; documents are
embedded as they are. `dimensions` keeps the first d values and normalises again (the model was
trained for such truncation, Matryoshka style).

Texts are run together: short ones packed into one forward pass (forward_batch: each attends only to
itself), long ones in chunks through a KV cache of their own, as a prompt is prefilled.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from ..core.adapters import Adapter
from ..core.batch import check_token_ids
from ..core.model import Qwen3Model
from ..engine.budget import PREFILL_CHUNK, context_for, prefill_chunks
from ..errors import QwenNPError
from ..files.tokenizer import Tokenizer

Inputs = str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]]


def embed(model: Qwen3Model, inputs: Inputs, tokenizer: Tokenizer | None = None, *,
          dimensions: int | None = None) -> np.ndarray:
    """Unit vectors [N, D] (float32; [N, dimensions] with `dimensions`) for `inputs`: a text, a list of
    texts (which need the checkpoint's `tokenizer`), a list of token ids, or a list of such lists."""
    job = Embedding(model, input_ids(inputs, tokenizer), dimensions)
    while not job.step():
        pass
    return job.vectors


class Embedding:
    """The embeddings of `ids` (input_ids' lists), computed one forward pass at a time: step() runs the
    next (at most PREFILL_CHUNK tokens: several short inputs packed, or one chunk of a long one), so a
    server can run them between its generation steps, each delaying the batch by one prefill chunk at
    most (serving.embeddings). Checks everything before any pass. adapter: the LoRA adapter whose model embeds
    them (None: the base), as a server's request names it."""

    def __init__(self, model: Qwen3Model, ids: list[list[int]], dimensions: int | None = None,
                 adapter: Adapter | None = None) -> None:
        width = model.config.hidden_size
        if dimensions is not None and not 1 <= dimensions <= width:
            raise QwenNPError(f"must be in [1, {width}] (the model's hidden size), got {dimensions}", "dimensions")
        for i, one in enumerate(ids):
            if len(one) > context_for(model.config, default=None):
                raise QwenNPError(f"input[{i}]: {len(one)} tokens, more than the model's "
                                  f"{context_for(model.config, default=None)}-token context")
            check_token_ids(one, model.config.vocab_size, f"input[{i}]")
        self.model, self.ids, self.dimensions, self.adapter = model, ids, dimensions, adapter
        self.batches = _batches([len(one) for one in ids])
        self.passes = sum(len(prefill_chunks(len(ids[batch[0]]))) if len(batch) == 1 else 1
                          for batch in self.batches)           # forward passes in all
        self.done = 0                                          # forward passes run
        self.hidden = np.empty((len(ids), width), dtype=np.float32)        # [N, D] the final norm's output
        self._passes = self._run()

    @property
    def tokens(self) -> int:
        return sum(len(one) for one in self.ids)

    def step(self) -> bool:
        """Run the next forward pass; whether every input's vector is then known."""
        next(self._passes)
        self.done += 1
        return self.done == self.passes

    @property
    def vectors(self) -> np.ndarray:
        """The unit vectors [N, dimensions or D] (float32), once step() has said so."""
        kept = self.hidden[:, :self.dimensions].astype(np.float64)
        return (kept / np.linalg.norm(kept, axis=1, keepdims=True)).astype(np.float32)

    def _run(self) -> Iterator[None]:
        """Each forward pass, one per next(): the final norm's output at the last position of each sequence.
        Sequences up to a prefill chunk run packed without a cache; a longer one (a batch of its own) runs
        chunk by chunk through a cache of its own."""
        for batch in self.batches:
            tokens = self.ids[batch[0]]
            if len(batch) == 1 and len(tokens) > PREFILL_CHUNK:
                cache = self.model.new_cache(len(tokens))
                for chunk in prefill_chunks(len(tokens)):
                    self.hidden[batch] = self.model.forward_batch([tokens[chunk]], [cache],
                                                                  last_only=True, head=False, adapters=[self.adapter])
                    yield
            else:
                self.hidden[batch] = self.model.forward_batch([self.ids[i] for i in batch], [None] * len(batch),
                                                              last_only=True, head=False,
                                                              adapters=[self.adapter] * len(batch))
                yield


def input_ids(inputs: Inputs, tokenizer: Tokenizer | None) -> list[list[int]]:
    """The token ids of each input: texts encoded with the tokenizer's special tokens (its post-processor),
    ids as given. Raises QwenNPError for an empty input, or texts without a tokenizer."""
    if isinstance(inputs, str):
        inputs = [inputs]
    items = list(inputs)
    if not items:
        raise QwenNPError("input: no texts or token ids")
    if all(isinstance(item, (int, np.integer)) and not isinstance(item, bool) for item in items):
        items = [items]                              # one list of token ids
    ids: list[list[int]] = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            if tokenizer is None:
                raise QwenNPError("embed: texts need the checkpoint's tokenizer (tokenizer=read_tokenizer(folder))")
            one = tokenizer.encode(item, add_special_tokens=True)
        elif isinstance(item, (list, tuple, np.ndarray)) and all(
                isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in item):
            one = [int(t) for t in item]
        else:
            raise QwenNPError(f"input[{i}]: must be a text or a list of token ids")
        if not one:
            raise QwenNPError(f"input[{i}]: no tokens")
        ids.append(one)
    return ids


def _batches(lengths: list[int]) -> list[list[int]]:
    """Indices of the inputs, grouped into forward passes of at most PREFILL_CHUNK tokens (a longer input
    alone), in order."""
    batches: list[list[int]] = []
    tokens = 0
    for i, n in enumerate(lengths):
        if batches and n <= PREFILL_CHUNK and tokens + n <= PREFILL_CHUNK:
            batches[-1].append(i)
            tokens += n
        else:
            batches.append([i])
            tokens = n
    return batches
