"""Batch rows to responses: one request's row, its token events arriving on the event loop, shaped as OpenAI's
chat.completion / text_completion objects or their stream chunks, with usage (cached
prompt tokens, and drafted and accepted ones when speculating), a chat reply's thinking apart, its tool
calls as OpenAI's tool_calls (whole, or as delta.tool_calls the official client assembles), and each
token's log-probabilities when asked for (chat's format, or the completions' legacy one).

Imports requests.py (its Service and api_error) and finite.py of serving/.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, AsyncIterator, Sequence

from ..engine.finite import NonFiniteLogits
from ..errors import APIError, QwenNPError
from ..files.tokenizer import THINK_OPEN, ThinkingSplitter, split_thinking
from ..generation.batching import Request, Row, Work
from ..generation.generate import TokenEvent
from ..generation.logprobs import Logprobs, TokenLogprob
from ..generation.tool_calls import Delta, ReplyParser, TextDelta, parse_reply
from .finite import not_finite
from .requests import Service, api_error

# Our finish reasons -> OpenAI's: the model ended or a stop string was met -> "stop"; a token limit -> "length".
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}
DISCONNECT_POLL_SECONDS = 0.5


@dataclass(frozen=True)
class Echo:
    """What a completion's reply begins with when it echoes its prompt: the prompt's text, and its tokens'
    log-probabilities in the legacy format (prompt_logprobs) when asked for."""

    text: str = ""
    logprobs: dict[str, Any] | None = None


NO_ECHO = Echo()


class Reply:
    """One request's row in the batch, its events arriving on this event loop, shaped as OpenAI's
    chat.completion / text_completion objects or their stream chunks. calls: a chat reply that may call
    tools, read for its calls (tool_calls.ReplyParser)."""

    def __init__(self, service: Service, request: Request, chat: bool, calls: bool = False, index: int = 0,
                 echo: Echo | None = None) -> None:
        self.service, self.request, self.chat, self.calls = service, request, chat, calls
        self.index, self.echo = index, echo           # the choice it is (choices.Choices), the prompt it echoes
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.events: asyncio.Queue[TokenEvent | BaseException] = asyncio.Queue()
        self.row: Row | None = None
        self.completion_tokens = 0
        self.logprob_sum = 0.0                        # of its tokens, when they carry logprobs (best_of ranks by it)

    def _submit(self) -> None:
        loop = asyncio.get_running_loop()

        def hand_over(event: TokenEvent | BaseException) -> None:      # on the batching thread
            with contextlib.suppress(RuntimeError):                      # the loop closed: server shutting down
                loop.call_soon_threadsafe(self.events.put_nowait, event)

        self.row = self.service.runner.submit(self.request, hand_over)

    async def _next(self) -> TokenEvent:
        event = await self.events.get()
        if isinstance(event, NonFiniteLogits):  # the model's numbers for this row's tokens: its weights' doing
            field = "messages" if self.chat else "prompt"
            tokens = self.row.tokens if self.row is not None else self.request.prompt
            raise not_finite(self.service.model, self.service.tokenizer, tokens, field, field, len(self.request.prompt))
        if isinstance(event, QwenNPError):      # this request's own sampling failed (batching ends it alone)
            raise api_error(event)
        if isinstance(event, BaseException):
            raise APIError(500, f"generation failed: {type(event).__name__}: {event}", kind="server_error")
        self.completion_tokens += 1
        self.logprob_sum += event.logprobs.chosen.logprob if event.logprobs is not None else 0.0
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
        return {"id": self.id, "object": kind, "created": self.created, "model": self.service.name_of(self.request.adapter),
                "choices": [{"index": self.index, "logprobs": None, **choice}] if choice else [], **extra}

    async def whole(self, http: Any) -> dict[str, Any]:
        """The non-streamed response. Nothing cancels a plain request when its client leaves, so the
        wait looks for a disconnect now and then, and cancels the row then."""
        self._submit()
        pieces, logprobs, finish = [], [], None
        try:
            while finish is None:
                try:
                    event = await asyncio.wait_for(self._next(), DISCONNECT_POLL_SECONDS)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        raise APIError(499, "client disconnected") from None
                    continue
                pieces.append(event.text)
                logprobs += [event.logprobs] if event.logprobs is not None else []
                finish = event.finish_reason
        finally:
            if finish is None and self.row is not None:
                self.service.runner.cancel(self.row)
        text, echo = "".join(pieces), self.echo or NO_ECHO
        if self.chat:
            message = assistant_message(text, self.service.split_reasoning, self.calls)
            choice = {"message": message, "finish_reason": finish_reason(finish, "tool_calls" in message)}
        else:
            choice = {"text": echo.text + text, "finish_reason": FINISH[finish]}
        if self.request.logprobs is not None:
            choice["logprobs"] = (chat_logprobs(logprobs) if self.chat else joined_logprobs(
                echo.logprobs, completion_logprobs(logprobs, pieces, len(echo.text))))
        return self._object("chat.completion" if self.chat else "text_completion", choice, usage=self.usage())

    async def chunks(self, include_usage: bool) -> AsyncIterator[dict[str, Any]]:
        """The stream's chunks: an echoed prompt first (with its logprobs), one chunk per delta (a piece of text,
        of reasoning, of a call), each token's log-probabilities on the first chunk its text gives (on a chunk
        with an empty delta when its text is held back: the start of what may be a marker), the finish reason,
        [usage]; an error that ends it, as the last."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        extra = {"usage": None} if include_usage else {}
        deltas = ChatDeltas(self.service.split_reasoning, self.calls)
        echo = self.echo or NO_ECHO
        offset = len(echo.text)                      # a completion's text so far: where the next token's begins

        def chunk(delta: dict[str, Any] | str, finish: str | None = None,
                  logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
            choice = {"delta": delta} if self.chat else {"text": delta}
            return self._object(kind, {**choice, "finish_reason": finish,
                                       **({"logprobs": logprobs} if logprobs else {})}, **extra)

        try:
            if self.chat:
                yield chunk({"role": "assistant", "content": ""})
            if echo.text:
                yield chunk(echo.text, logprobs=echo.logprobs)
            async for event in self._events():
                logprobs = [event.logprobs] if event.logprobs is not None else []
                if self.chat:
                    pieces = deltas.feed(event.text) + (deltas.finish() if event.finish_reason else [])
                    for i, delta in enumerate(pieces or ([{}] if logprobs else [])):
                        yield chunk(delta, logprobs=chat_logprobs(logprobs) if logprobs and i == 0 else None)
                elif event.text or logprobs:
                    yield chunk(event.text, logprobs=completion_logprobs(logprobs, [event.text], offset) if logprobs
                                else None)
                    offset += len(event.text)
                if event.finish_reason:
                    finish = (finish_reason(event.finish_reason, deltas.called) if self.chat
                              else FINISH[event.finish_reason])
                    yield chunk({} if self.chat else "", finish)
            if include_usage:
                yield self._object(kind, {}, usage=self.usage())
        except APIError as problem:            # the stream has begun: the error goes in the stream
            yield problem.body()


async def beside(service: Service, work: Work, http: Any, what: str) -> None:
    """Run `work` on the batching thread between generation steps (BatchRunner.run_beside) until it is
    done; a client that leaves cancels the rest of it."""
    loop = asyncio.get_running_loop()
    finished: asyncio.Future[BaseException | None] = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if not finished.done():
            finished.set_result(error)

    def done(error: BaseException | None) -> None:          # on the batching thread
        with contextlib.suppress(RuntimeError):               # the loop closed: server shutting down
            loop.call_soon_threadsafe(settle, error)

    task = service.runner.run_beside(work, done)
    try:
        while True:
            try:
                error = await asyncio.wait_for(asyncio.shield(finished), DISCONNECT_POLL_SECONDS)
                break
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    raise APIError(499, "client disconnected") from None
    finally:
        task.cancelled = not finished.done()
    if error is not None:
        raise APIError(500, f"{what} failed: {type(error).__name__}: {error}", kind="server_error")


def assistant_message(text: str, split_reasoning: bool, calls: bool = False) -> dict[str, Any]:
    """The assistant message of a whole chat reply: Qwen3's thinking apart from its answer, under both names
    clients read (reasoning_content: llama-server's and DeepSeek's; reasoning: vLLM's), unless the server
    leaves replies as generated (--reasoning-format raw). Streamed replies split alike (ChatDeltas).
    calls: the reply's <tool_call> blocks are its tool_calls (content null if nothing else was written), never
    content; a block that is no call (not JSON, no name, cut off) is listed raw as malformed_tool_calls."""
    thinks = split_reasoning and text.startswith(THINK_OPEN)
    parsed = parse_reply(text, split_reasoning) if calls else None
    reasoning, answer = ((parsed.reasoning, parsed.content) if parsed is not None else split_thinking(text) if thinks
                         else ("", text))
    message: dict[str, Any] = {"role": "assistant", "content": answer}
    if thinks:
        message |= {"reasoning_content": reasoning, "reasoning": reasoning}
    if parsed is not None and parsed.tool_calls:
        message |= {"content": answer or None, "tool_calls": [call.openai() for call in parsed.tool_calls]}
    if parsed is not None and parsed.malformed:
        message["malformed_tool_calls"] = parsed.malformed
    return message


def finish_reason(finish: str, called: bool) -> str:
    """OpenAI's finish reason of a chat reply: "tool_calls" for one that ended of itself holding calls."""
    reason = FINISH[finish]
    return "tool_calls" if called and reason == "stop" else reason


class ChatDeltas:
    """A chat reply, piece by piece, as OpenAI's stream deltas: its thinking apart (as assistant_message
    reads it whole) and, when it may call tools, its calls as delta.tool_calls: the call's index, id, type
    and name first, then its arguments in fragments (no <tool_call> markup reaches the content). `called`:
    whether a whole call was read."""

    def __init__(self, split_reasoning: bool, calls: bool) -> None:
        self.parser = ReplyParser(split_reasoning) if calls else None
        self.splitter = ThinkingSplitter() if split_reasoning and not calls else None

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self.parser is not None:
            return [_delta(delta) for delta in self.parser.feed(text)]
        parts = self.splitter.feed(text) if self.splitter is not None else [("content", text)]
        return [_delta(TextDelta(field, piece)) for field, piece in parts if piece]

    def finish(self) -> list[dict[str, Any]]:
        """The deltas the end of the reply releases, and its malformed blocks (as assistant_message lists them)."""
        if self.parser is None:
            return []
        deltas = [_delta(delta) for delta in self.parser.finish()]
        return deltas + ([{"malformed_tool_calls": self.parser.malformed}] if self.parser.malformed else [])

    @property
    def called(self) -> bool:
        return self.parser is not None and bool(self.parser.calls)


def _delta(delta: Delta) -> dict[str, Any]:
    if not isinstance(delta, TextDelta):
        return {"tool_calls": [delta.openai()]}
    return ({"reasoning_content": delta.text, "reasoning": delta.text} if delta.field == "reasoning"
            else {"content": delta.text})


def chat_logprobs(logprobs: Sequence[Logprobs]) -> dict[str, Any]:
    """A chat choice's logprobs, OpenAI's: each token's text, log-probability and bytes, with its top ones."""
    return {"content": [{**_token(entry.chosen), "top_logprobs": [_token(top) for top in entry.top]}
                        for entry in logprobs]}


def _token(entry: TokenLogprob) -> dict[str, Any]:
    return {"token": entry.text, "logprob": entry.logprob, "bytes": list(entry.bytes)}


def completion_logprobs(logprobs: Sequence[Logprobs], texts: Sequence[str], offset: int = 0) -> dict[str, Any]:
    """A completion choice's logprobs in OpenAI's legacy format: the tokens, their log-probabilities, their top
    ones as {text: log-probability}, and where each token's text (`texts`: what each added to the reply's
    text) begins in the text, counting from `offset`."""
    return {"tokens": [entry.chosen.text for entry in logprobs],
            "token_logprobs": [entry.chosen.logprob for entry in logprobs],
            "top_logprobs": [{top.text: top.logprob for top in entry.top} for entry in logprobs],
            "text_offset": list(accumulate((len(text) for text in texts[:-1]), initial=offset))}


def prompt_logprobs(first: str, entries: Sequence[Logprobs]) -> dict[str, Any]:
    """An echoed prompt's logprobs in the legacy format: its first token (`first`, its text) with null
    log-probability and top ones (nothing predicts it, as OpenAI and vLLM write it), then each later token's."""
    rest = (completion_logprobs(entries, [entry.chosen.text for entry in entries], len(first)) if entries
            else {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []})      # a one-token prompt
    return {"tokens": [first, *rest["tokens"]], "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]], "text_offset": [0, *rest["text_offset"]]}


def joined_logprobs(first: dict[str, Any] | None, then: dict[str, Any]) -> dict[str, Any]:
    """Two stretches of legacy logprobs one after the other (an echoed prompt's, then the reply's)."""
    return then if first is None else {key: first[key] + then[key] for key in then}
