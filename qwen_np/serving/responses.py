"""Batch rows to responses: one request's row, its token events arriving on the event loop, shaped as OpenAI's
chat.completion / text_completion objects or their stream chunks (Server-Sent Events), with usage (cached
prompt tokens, and drafted and accepted ones when speculating) and a chat reply's thinking apart.

Imports requests.py (its Service and api_error) of serving/.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import Any, AsyncIterator

from ..errors import APIError, QwenNPError
from ..files.tokenizer import THINK_OPEN, ThinkingSplitter, split_thinking
from ..generation.batching import Request, Row
from ..generation.generate import TokenEvent
from .requests import Service, api_error

# Our finish reasons -> OpenAI's: the model ended or a stop string was met -> "stop"; a token limit -> "length".
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}
DISCONNECT_POLL_SECONDS = 0.5


class Reply:
    """One request's row in the batch, its events arriving on this event loop, shaped as OpenAI's
    chat.completion / text_completion objects or their stream chunks."""

    def __init__(self, service: Service, request: Request, chat: bool) -> None:
        self.service, self.request, self.chat = service, request, chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.events: asyncio.Queue[TokenEvent | BaseException] = asyncio.Queue()
        self.row: Row | None = None
        self.completion_tokens = 0

    def _submit(self) -> None:
        loop = asyncio.get_running_loop()

        def hand_over(event: TokenEvent | BaseException) -> None:      # on the batching thread
            with contextlib.suppress(RuntimeError):                      # the loop closed: server shutting down
                loop.call_soon_threadsafe(self.events.put_nowait, event)

        self.row = self.service.runner.submit(self.request, hand_over)

    async def _next(self) -> TokenEvent:
        event = await self.events.get()
        if isinstance(event, QwenNPError):      # this request's own sampling failed (batching ends it alone)
            raise api_error(event)
        if isinstance(event, BaseException):
            raise APIError(500, f"generation failed: {type(event).__name__}: {event}", kind="server_error")
        self.completion_tokens += 1
        return event

    async def _events(self) -> AsyncIterator[TokenEvent]:
        """This request's events until its last; cancels the row if the consumer goes away first
        (a streaming client that disconnects cancels the stream, and so this)."""
        self._submit()
        finished = False
        try:
            while not finished:
                event = await self._next()
                finished = event.finish_reason is not None
                yield event
        finally:
            if not finished and self.row is not None:
                self.service.runner.cancel(self.row)

    def usage(self) -> dict[str, Any]:
        prompt = len(self.request.prompt)
        cached = self.row.cached_tokens if self.row is not None else 0      # reused from the prefix cache
        usage = {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                 "total_tokens": prompt + self.completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}
        sequence = self.row.continuation if self.row is not None else None
        if self.service.speculating and sequence is not None:
            usage |= sequence.counts.usage(self.completion_tokens)
        return usage

    def _object(self, kind: str, choice: dict[str, Any], **extra: Any) -> dict[str, Any]:
        adapter = self.request.adapter                     # the name the request asked for: an adapter's, or the base's
        model = adapter.name if adapter is not None else self.service.model_id
        return {"id": self.id, "object": kind, "created": self.created, "model": model,
                "choices": [{"index": 0, **choice, "logprobs": None}] if choice else [], **extra}

    async def whole(self, http: Any) -> dict[str, Any]:
        """The non-streamed response. Nothing cancels a plain request when its client leaves, so the
        wait looks for a disconnect now and then, and cancels the row then."""
        self._submit()
        pieces, finish = [], None
        try:
            while finish is None:
                try:
                    event = await asyncio.wait_for(self._next(), DISCONNECT_POLL_SECONDS)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        raise APIError(499, "client disconnected") from None
                    continue
                pieces.append(event.text)
                finish = event.finish_reason
        finally:
            if finish is None and self.row is not None:
                self.service.runner.cancel(self.row)
        text, reason = "".join(pieces), FINISH[finish]
        choice = ({"message": assistant_message(text, self.service.split_reasoning), "finish_reason": reason} if self.chat
                  else {"text": text, "finish_reason": reason})
        return self._object("chat.completion" if self.chat else "text_completion", choice, usage=self.usage())

    async def stream(self, include_usage: bool) -> AsyncIterator[str]:
        """Server-Sent Events: one chunk per piece of text, the finish reason, [usage], [DONE]."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        extra = {"usage": None} if include_usage else {}

        splitter = ThinkingSplitter() if self.chat and self.service.split_reasoning else None

        def chunk(text: str | None, finish: str | None = None, role: bool = False, field: str = "content") -> str:
            if self.chat:
                names = ("reasoning_content", "reasoning") if field == "reasoning" else ("content",)
                delta = {"role": "assistant", "content": ""} if role else dict.fromkeys(names, text) if text else {}
                choice = {"delta": delta, "finish_reason": finish}
            else:
                choice = {"text": text or "", "finish_reason": finish}
            return _sse(self._object(kind, choice, **extra))

        try:
            if self.chat:
                yield chunk(None, role=True)
            async for event in self._events():
                if event.text and splitter is not None:
                    for field, text in splitter.feed(event.text):
                        yield chunk(text, field=field)
                elif event.text:
                    yield chunk(event.text)
                if event.finish_reason:
                    yield chunk(None, FINISH[event.finish_reason])
            if include_usage:
                yield _sse(self._object(kind, {}, usage=self.usage()))
        except APIError as problem:            # the stream has begun: the error goes in the stream
            yield _sse(problem.body())
        yield "data: [DONE]\n\n"


def assistant_message(text: str, split_reasoning: bool) -> dict[str, Any]:
    """The assistant message of a whole chat reply: Qwen3's thinking apart from its answer, under both names
    clients read (reasoning_content: llama-server's and DeepSeek's; reasoning: vLLM's), unless the server
    leaves replies as generated (--reasoning-format raw). Streamed replies split alike (ThinkingSplitter)."""
    if not split_reasoning or not text.startswith(THINK_OPEN):
        return {"role": "assistant", "content": text}
    reasoning, answer = split_thinking(text)
    return {"role": "assistant", "content": answer, "reasoning_content": reasoning, "reasoning": reasoning}


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
