"""A request's choices: `n` replies of one prompt (choices[i].index), a completion's `best_of` candidates of
which the n most likely are returned, and its `echo` of the prompt (with the prompt tokens' logprobs: how an
evaluation harness scores a text, `max_tokens: 0` then generating nothing).

Each choice is a row of the batch (responses.Reply); the rows of one prompt share its prefill: the batch
lets the 2nd..nth row join once the first has read the prompt (BatchGenerator.follows), so they take its
full blocks from the prefix cache and each computes only the last, partly filled block. Seeds: choice i
(candidate i with best_of) samples with seed + i (vLLM's rule), so choice 0 is what n=1 gives and the same
seed gives the same choices again. best_of ranks the candidates by their mean token log-probability (the
model's own, as `logprobs` reports it: OpenAI's "highest log probability per token"), and refuses `stream`
as OpenAI does (the best are known only at the end). Usage counts the prompt once and every candidate's
tokens.

Imports bodies.py, requests.py, responses.py and finite.py of serving/.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from typing import Any, AsyncIterator

from ..generation.batching import Request
from ..generation.logprobs import PromptLogprobs
from ..generation.speculative import SpeculationCounts
from .finite import all_finite, not_finite
from .bodies import ChatBody, CompletionBody, GenerationBody
from .requests import Service
from .responses import Echo, Reply, beside, prompt_logprobs


def choice_requests(body: GenerationBody, request: Request) -> list[Request]:
    """The rows a body asks for: its best_of candidates (n unless a completion asks for more), row i seeded
    with seed + i; a best_of candidate reports its tokens' log-probabilities (what ranks it)."""
    logprobs = request.logprobs if request.logprobs is not None or body.best_of == body.n else 0
    seed = request.params.seed
    return [dataclasses.replace(request, logprobs=logprobs, params=dataclasses.replace(
        request.params, seed=None if seed is None else seed + i)) for i in range(body.best_of)]


async def echo_of(service: Service, body: CompletionBody, request: Request, http: Any) -> Echo | None:
    """A completion's echo (None without `echo`): the prompt's text (as sent, or its ids decoded), and with
    `logprobs` its tokens' log-probabilities, computed on the batching thread between generation steps."""
    if not body.echo:
        return None
    text = body.prompt if isinstance(body.prompt, str) else service.tokenizer.decode(list(request.prompt))
    if request.logprobs is None:
        return Echo(text)
    ids = list(request.prompt)
    job = PromptLogprobs(service.model, ids, request.logprobs, service.tokenizer, request.adapter)
    await beside(service, job, http, "scoring the prompt")
    numbers = [number for entry in job.entries for number in (entry.chosen.logprob, *(t.logprob for t in entry.top))]
    if not all_finite(numbers):
        raise not_finite(service.model, service.tokenizer, ids, "prompt", "prompt")
    return Echo(text, prompt_logprobs(service.tokenizer.decode(ids[:1]), job.entries))


class Choices:
    """A request's replies, one per candidate row (all of one id), shaped as one response: whole (the n best
    of best_of) or streamed (every choice's chunks as they come, each with its index)."""

    def __init__(self, service: Service, body: GenerationBody, requests: list[Request], echo: Echo | None = None) -> None:
        chat = isinstance(body, ChatBody)
        self.service, self.chat, self.n, self.echo = service, chat, body.n, echo
        self.show_logprobs = body.logprobs is not None       # else asked for only to rank best_of's candidates
        calls = isinstance(body, ChatBody) and body.calls
        generate = not (isinstance(body, CompletionBody) and body.scores_only)
        self.prompt = requests[0].prompt
        self.model = service.name_of(requests[0].adapter)          # the name asked for: an adapter's, or the base's
        self.replies = [Reply(service, request, chat, calls, i, echo) for i, request in enumerate(requests)] if generate else []
        self.id = self.replies[0].id if self.replies else f"cmpl-{uuid.uuid4().hex}"
        for reply in self.replies:
            reply.id = self.id
            reply.created = self.replies[0].created

    def usage(self) -> dict[str, Any]:
        """The prompt once (and its cached tokens: the first row's), every candidate's tokens."""
        completion = sum(reply.completion_tokens for reply in self.replies)
        cached = self.replies[0].usage()["prompt_tokens_details"] if self.replies else {"cached_tokens": 0}
        usage = {"prompt_tokens": len(self.prompt), "completion_tokens": completion,
                 "total_tokens": len(self.prompt) + completion, "prompt_tokens_details": cached}
        if self.service.speculating:
            counts = sum((reply.row.continuation.counts for reply in self.replies
                          if reply.row is not None and reply.row.continuation is not None), SpeculationCounts())
            usage |= counts.usage(completion)
        return usage

    async def whole(self, http: Any) -> dict[str, Any]:
        if not self.replies:
            return {"id": self.id, "object": "text_completion", "created": int(time.time()),
                    "model": self.model, "choices": self._echoed(), "usage": self.usage()}
        tasks = [asyncio.ensure_future(reply.whole(http)) for reply in self.replies]
        try:
            answers = await asyncio.gather(*tasks)
        finally:
            for task in tasks:                                # one failed: the others' rows are cancelled too
                task.cancel()
        ranked = sorted(range(len(answers)), key=lambda i: -self.replies[i].logprob_sum
                        / max(1, self.replies[i].completion_tokens)) if len(answers) > self.n else range(self.n)
        choices = []
        for index, i in enumerate(ranked[:self.n]):
            choice = answers[i]["choices"][0] | {"index": index}
            if not self.show_logprobs:
                choice["logprobs"] = None                     # asked for only to rank the candidates
            choices.append(choice)
        return answers[0] | {"choices": choices, "usage": self.usage()}

    async def stream(self, include_usage: bool) -> AsyncIterator[str]:
        """Server-Sent Events: each choice's chunks as they come (an echo that generates nothing: one chunk
        per choice), then [usage] and [DONE]."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        head = {"id": self.id, "object": kind, "created": int(time.time()), "model": self.model}
        extra = {"usage": None} if include_usage else {}
        if self.replies:
            async for payload in self._merged(include_usage):
                yield _sse(payload)
        else:
            for choice in self._echoed():
                yield _sse(head | {"choices": [choice]} | extra)
        if include_usage:
            yield _sse(head | {"choices": [], "usage": self.usage()})
        yield "data: [DONE]\n\n"

    def _echoed(self) -> list[dict[str, Any]]:
        """The choices of an echo that generates nothing (max_tokens 0): the prompt, scored when asked."""
        echo = self.echo or Echo()
        return [{"index": i, "text": echo.text, "finish_reason": "length", "logprobs": echo.logprobs}
                for i in range(self.n)]

    async def _merged(self, include_usage: bool) -> AsyncIterator[dict[str, Any]]:
        """Every reply's chunks (their usage left to the end), in the order they come."""
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

        async def pump(reply: Reply) -> None:
            try:
                async for payload in reply.chunks(False):
                    await queue.put(payload | ({"usage": None} if include_usage else {}))
            finally:
                await queue.put(None)

        tasks = [asyncio.ensure_future(pump(reply)) for reply in self.replies]
        try:
            ended = 0
            while ended < len(tasks):
                payload = await queue.get()
                if payload is None:
                    ended += 1
                else:
                    yield payload
        finally:
            for task in tasks:                                # the client left: every row is cancelled
                task.cancel()


def _sse(payload: dict[str, Any]) -> str:
    """One Server-Sent Event."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
