"""POST /v1/embeddings: OpenAI's embeddings endpoint over generation.embedding (last-token pooling of the final
norm's output, L2-normalised, as Qwen3-Embedding defines it; a Qwen3 with its LM head embeds the same way).

    client.embeddings.create(model=..., input=["a text", "another"])       # the official client

`input` is a text, a list of texts, a list of token ids, or a list of such lists (at most bodies.MAX_INPUTS,
each at most the server's context: refused by its characters before it is tokenised, as a prompt is); `dimensions`
keeps the first d values, normalised again (Qwen3-Embedding was trained for it, Matryoshka style), in
1..hidden size; `encoding_format` "float" (lists of numbers) or "base64" (each vector's little-endian
float32 bytes, base64: what the official client asks for unless told otherwise, and decodes).

Scheduling: the model is used from the batching thread only, so a request's forward passes (embedding.Embedding:
at most a prefill chunk's tokens each) run there, one after each generation step (BatchRunner.run_beside).
A running stream waits at most one such pass between two tokens, as it does for another request's prefill,
and an embedding request advances at every step however busy the batch; requests take turns.

Imports bodies.py, requests.py, responses.py and finite.py of serving/.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from ..errors import APIError, QwenNPError
from ..generation.embedding import Embedding, input_ids
from .finite import all_finite, not_finite
from .bodies import EmbeddingBody, input_too_long, is_token_id
from .requests import Service
from .responses import beside

def embedding_job(service: Service, body: EmbeddingBody) -> Embedding:
    """The embeddings a body asks for, tokenised and checked, not yet computed: a 400 naming `input` or
    `dimensions` otherwise."""
    try:
        ids = input_ids(list(body.inputs), service.tokenizer)
    except QwenNPError as bad:
        raise APIError(400, str(bad), "input") from None
    for i, one in enumerate(ids):
        if len(one) > service.context:
            raise input_too_long(service.context, i, f"{len(one)} tokens")
        outside = next((t for t in one if not is_token_id(t, service.vocab)), None)
        if outside is not None:                  # a text's ids are the tokenizer's; a list of ids may hold any
            raise APIError(400, f"input[{i}]: id {outside} is outside the vocabulary [0, {service.vocab})", "input")
    try:
        return Embedding(service.model, ids, body.dimensions, service.adapter_of(body.model))
    except QwenNPError as bad:
        raise APIError(400, str(bad), bad.param or "input") from None     # input[i]'s ids, or dimensions


async def embeddings(service: Service, job: Embedding, body: EmbeddingBody, http: Any) -> dict[str, Any]:
    """OpenAI's embeddings response for `job`, computed on the batching thread between generation steps; a
    client that leaves cancels the rest of its passes."""
    await beside(service, job, http, "embedding")
    vectors = job.vectors
    for i, vector in enumerate(vectors):
        if not all_finite(vector):
            raise not_finite(service.model, service.tokenizer, job.ids[i], f"input[{i}]", "input")
    data = [{"object": "embedding", "index": i, "embedding": encoded(vector, body.base64)}
            for i, vector in enumerate(vectors)]
    return {"object": "list", "data": data, "model": service.name_of(job.adapter), "usage": usage(job)}


def usage(job: Embedding) -> dict[str, int]:
    return {"prompt_tokens": job.tokens, "total_tokens": job.tokens}


def encoded(vector: np.ndarray, base64_encoded: bool) -> list[float] | str:
    """A vector as JSON numbers, or as its little-endian float32 bytes in base64 (OpenAI's "base64")."""
    if base64_encoded:
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
