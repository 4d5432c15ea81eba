"""POST /v1/rerank (and /rerank): how relevant each document is to a query, over generation.rerank
(Qwen3-Reranker's score, P("yes") of its yes/no question), in the shape Jina's and Cohere's APIs give it and
llama-server and vLLM serve:

    {"model": ..., "query": "Why is the sky blue?", "documents": ["...", "..."], "top_n": 3}
    -> {"model", "results": [{"index", "relevance_score", "document": {"text"}}], "usage"}     best first

Scheduling is the embeddings' (embeddings.py): the job's forward passes, at most a prefill chunk's tokens
each, run on the batching thread one after each generation step, so a running stream waits at most one
such pass between two tokens.

Imports bodies.py, requests.py, responses.py and finite.py of serving/.
"""

from __future__ import annotations

import uuid
from typing import Any

from ..errors import APIError, QwenNPError
from ..generation.rerank import DEFAULT_INSTRUCTION, Reranking, rerank_ids
from .bodies import RerankBody
from .finite import all_finite, not_finite
from .requests import Service
from .responses import beside


def rerank_job(service: Service, body: RerankBody) -> Reranking:
    """The scores a body asks for, tokenised and checked, not yet computed: a 400 naming `documents` for a
    pair the context cannot hold, or the model for one that cannot rerank."""
    instruction = body.instruction or DEFAULT_INSTRUCTION
    ids = [rerank_ids(service.tokenizer, body.query, document, instruction) for document in body.documents]
    for i, one in enumerate(ids):
        if len(one) > service.context:
            raise APIError(400, f"documents[{i}]: with the query, {len(one)} tokens; this model's maximum context "
                                f"length is {service.context} tokens", "documents", "context_length_exceeded")
    try:
        return Reranking(service.model, service.tokenizer, ids, service.adapter_of(body.model))
    except QwenNPError as bad:
        raise APIError(400, str(bad), "model") from None


async def reranked(service: Service, job: Reranking, body: RerankBody, http: Any) -> dict[str, Any]:
    """The response for `job`, computed on the batching thread between generation steps: the top_n
    documents (all without it), the most relevant first."""
    await beside(service, job, http, "reranking")
    scores = job.scores.tolist()
    if not all_finite(scores):
        worst = next(i for i, score in enumerate(scores) if not all_finite([score]))
        raise not_finite(service.model, service.tokenizer, job.ids[worst], f"documents[{worst}]", "documents")
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:body.top_n]
    results = [{"index": i, "relevance_score": float(scores[i]),
                **({"document": {"text": body.documents[i]}} if body.return_documents else {})} for i in order]
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": service.name_of(job.adapter), "results": results,
            "usage": {"prompt_tokens": job.tokens, "total_tokens": job.tokens}}
