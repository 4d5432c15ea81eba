"""POST /v1/embeddings: OpenAI's embeddings endpoint over generation.embedding (last-token pooling of the final
norm's output, L2-normalised, as Qwen3-Embedding defines it; a Qwen3 with its LM head embeds the same way).

    client.embeddings.create(model=..., input=["a text", "another"])       # the official client

`input` is a text, a list of texts, a list of token ids, or a list of such lists (at most MAX_INPUTS, each at
most the server's context: refused by its characters before it is tokenised, as a prompt is); `dimensions`
keeps the first d values, normalised again (Qwen3-Embedding was trained for it, Matryoshka style), in
1..hidden size; `encoding_format` "float" (lists of numbers) or "base64" (each vector's little-endian
float32 bytes, base64: what the official client asks for unless told otherwise, and decodes).

Scheduling: the model is used from the batching thread only, so a request's forward passes (embedding.Embedding:
at most a prefill chunk's tokens each) run there, one after each generation step (BatchRunner.run_beside).
A running stream waits at most one such pass between two tokens, as it does for another request's prefill,
and an embedding request advances at every step however busy the batch; requests take turns.

Imports requests.py, responses.py and finite.py of serving/.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from ..errors import APIError, QwenNPError
from ..generation.embedding import Embedding, input_ids
from .finite import all_finite, not_finite
from .requests import Service, is_token_id
from .responses import beside

MAX_INPUTS = 2048                    # OpenAI's limit on inputs in one request
ENCODINGS = ("float", "base64")


def embedding_job(service: Service, body: dict[str, Any]) -> Embedding:
    """The embeddings a body asks for, checked and tokenised, not yet computed: a 400 naming `input`,
    `dimensions` or `encoding_format` otherwise."""
    if body.get("encoding_format", "float") not in ENCODINGS:
        raise APIError(400, f"encoding_format: must be one of {', '.join(ENCODINGS)}", "encoding_format")
    inputs = body.get("input")
    items = [inputs] if isinstance(inputs, str) else inputs
    if not isinstance(items, list) or not items:
        raise APIError(400, "input: must be a text, a list of texts, a list of token ids or a list of such lists",
                       "input")
    count = 1 if all(isinstance(t, int) and not isinstance(t, bool) for t in items) else len(items)   # ids: one
    if count > MAX_INPUTS:
        raise APIError(400, f"input: {count} inputs, more than {MAX_INPUTS} in one request", "input")
    longest = service.context * service.chars_per_token          # a text longer cannot fit the context
    for i, item in enumerate(items):
        if isinstance(item, str) and len(item) > longest:
            raise _too_long(service, i, f"{len(item)} characters, more than any {service.context} tokens can hold")
    dimensions = body.get("dimensions")
    if dimensions is not None and (not isinstance(dimensions, int) or isinstance(dimensions, bool)):
        raise APIError(400, f"dimensions: must be an integer, got {dimensions!r}", "dimensions")
    try:
        ids = input_ids(items, service.tokenizer)
    except QwenNPError as bad:
        raise APIError(400, str(bad), "input") from None
    for i, one in enumerate(ids):
        if len(one) > service.context:
            raise _too_long(service, i, f"{len(one)} tokens")
        outside = next((t for t in one if not is_token_id(t, service.vocab)), None)
        if outside is not None:                  # a text's ids are the tokenizer's; a list of ids may hold any
            raise APIError(400, f"input[{i}]: id {outside} is outside the vocabulary [0, {service.vocab})", "input")
    try:
        return Embedding(service.model, ids, dimensions, service.adapter_of(body))
    except QwenNPError as bad:
        raise APIError(400, str(bad), bad.param or "input") from None     # input[i]'s ids, or dimensions


def _too_long(service: Service, index: int, what: str) -> APIError:
    return APIError(400, f"input[{index}]: {what}; this model's maximum context length is {service.context} tokens",
                    "input", "context_length_exceeded")


async def embeddings(service: Service, job: Embedding, body: dict[str, Any], http: Any) -> dict[str, Any]:
    """OpenAI's embeddings response for `job`, computed on the batching thread between generation steps; a
    client that leaves cancels the rest of its passes."""
    await beside(service, job, http, "embedding")
    vectors = job.vectors
    for i, vector in enumerate(vectors):
        if not all_finite(vector):
            raise not_finite(service.model, service.tokenizer, job.ids[i], f"input[{i}]", "input")
    base64_encoded = body.get("encoding_format") == "base64"
    data = [{"object": "embedding", "index": i, "embedding": encoded(vector, base64_encoded)}
            for i, vector in enumerate(vectors)]
    return {"object": "list", "data": data, "model": service.name_of(job.adapter), "usage": usage(job)}


def usage(job: Embedding) -> dict[str, int]:
    return {"prompt_tokens": job.tokens, "total_tokens": job.tokens}


def encoded(vector: np.ndarray, base64_encoded: bool) -> list[float] | str:
    """A vector as JSON numbers, or as its little-endian float32 bytes in base64 (OpenAI's "base64")."""
    if base64_encoded:
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
