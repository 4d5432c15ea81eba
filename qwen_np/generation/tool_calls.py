"""Qwen3's tool calls read out of its replies, whole or as they stream.

Qwen3 was trained on Hermes-style calls (its chat template spells the format out in the system turn):

    I'll look both up.                                       <- content (optional)
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>                                              <- parallel calls, one block each
    {"name": "get_weather", "arguments": {"city": "Rome"}}
    </tool_call>

after an optional <think>...</think> block. `ReplyParser` splits a streamed reply into its reasoning (as
files.tokenizer.ThinkingSplitter reads it), its content, and its calls: `feed(piece)` returns the deltas
a piece completes, `finish()` those the end releases. Raw <tool_call> markup never reaches the content,
not even a piece of it: text that could still grow into "<tool_call>" is held back until it cannot, and
so are the newlines before a call (which the template writes around calls). A call is announced
(CallStart: its index, id and name) as soon as its name is read, and its arguments then stream as
ArgumentsDelta fragments of JSON text, as the model writes them, until the arguments' JSON closes; the
official client concatenates the fragments by index. Calls inside the reasoning are left as reasoning
(constraints.tool_call_grammar keeps them out of it when generation is constrained).

A block that is not a call (no JSON, no name, arguments that do not parse, cut off before its arguments
close) is never shown as content: it is kept, raw, in `malformed`, for the caller to report. Its call
is in `calls` only if it was whole. `parse_reply` reads a whole reply with the same parser, so a reply
read whole and streamed gives the same content, calls and reasoning.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Union

from ..files.tokenizer import ThinkingSplitter

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
WHITESPACE = " \t\r\n"


@dataclass(frozen=True)
class ToolCall:
    """A parsed call: `arguments` is its arguments' JSON text (OpenAI sends it as a string)."""

    index: int
    id: str
    name: str
    arguments: str

    def openai(self) -> dict[str, Any]:
        """The call as OpenAI's message.tool_calls lists it."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class TextDelta:
    """New text of the reply's reasoning (field "reasoning") or of its content ("content")."""

    field: str
    text: str


@dataclass(frozen=True)
class CallStart:
    """A call begins: its index among the reply's calls, its id and the tool's name."""

    index: int
    id: str
    name: str

    def openai(self) -> dict[str, Any]:
        """The first of the call's delta.tool_calls entries in a stream."""
        return {"index": self.index, "id": self.id, "type": "function", "function": {"name": self.name, "arguments": ""}}


@dataclass(frozen=True)
class ArgumentsDelta:
    """The next fragment of call `index`'s arguments (JSON text)."""

    index: int
    text: str

    def openai(self) -> dict[str, Any]:
        return {"index": self.index, "function": {"arguments": self.text}}


Delta = Union[TextDelta, CallStart, ArgumentsDelta]


def new_call_id() -> str:
    """A fresh call id in OpenAI's form ("call_" and 24 hex digits)."""
    return "call_" + secrets.token_hex(12)


@dataclass
class ParsedReply:
    """A whole reply: its reasoning, its content (without the calls) and its calls; `malformed` holds the
    raw bodies of <tool_call> blocks that were not calls."""

    reasoning: str
    content: str
    tool_calls: list[ToolCall]
    malformed: list[str] = field(default_factory=list)


def parse_reply(text: str, split_reasoning: bool = True, new_id: Callable[[], str] = new_call_id) -> ParsedReply:
    """Read a whole reply (what ReplyParser gives for it in one piece)."""
    parser = ReplyParser(split_reasoning, new_id)
    deltas = parser.feed(text) + parser.finish()
    texts = {"reasoning": "", "content": ""}
    for delta in deltas:
        if isinstance(delta, TextDelta):
            texts[delta.field] += delta.text
    return ParsedReply(texts["reasoning"], texts["content"], parser.calls, parser.malformed)


class ReplyParser:
    """Streams a reply apart into reasoning, content and tool calls (see the module's docstring).
    split_reasoning False: a <think> block is content like any other text."""

    def __init__(self, split_reasoning: bool = True, new_id: Callable[[], str] = new_call_id) -> None:
        self.thinking = ThinkingSplitter() if split_reasoning else None
        self.new_id = new_id
        self.calls: list[ToolCall] = []        # the complete calls so far
        self.malformed: list[str] = []         # the raw bodies of blocks that were not calls
        self.started = 0                       # calls announced (CallStart) so far
        self.held = ""                         # content not yet released (it may begin a call, or precede one)
        self.after_call = False                # the content follows a call (and may be only the whitespace after it)
        self.wrote = False                     # whether any content was released
        self.block: _Block | None = None       # the <tool_call> block being read

    def feed(self, piece: str) -> list[Delta]:
        """The deltas this piece of the reply completes."""
        parts = self.thinking.feed(piece) if self.thinking is not None else [("content", piece)]
        deltas: list[Delta] = []
        for name, text in parts:
            if name == "reasoning":
                deltas.append(TextDelta("reasoning", text))
            else:
                self._content(text, deltas)
        return deltas

    def finish(self) -> list[Delta]:
        """What the end of the reply releases: held-back content, and the end of a call cut off before its
        </tool_call> (kept if its arguments were whole, else malformed)."""
        deltas: list[Delta] = []
        if self.block is not None:
            self._close(deltas)
        if self.held and not (self.after_call and not self.held.strip(WHITESPACE)):   # not the newlines after a call
            self._release(self.held, deltas)
        self.held = ""
        return deltas

    def _content(self, text: str, deltas: list[Delta]) -> None:
        while text:
            if self.block is not None:                        # inside a call: read up to its end
                body, closed, text = (self.block.pending + text).partition(TOOL_CALL_CLOSE)
                self.block.add(body, bool(closed), deltas, self)
                if not closed:
                    return
                self._close(deltas)
                continue
            self.held += text
            text = ""
            before, opened, after = self.held.partition(TOOL_CALL_OPEN)
            if opened:
                self._release(before.rstrip(WHITESPACE), deltas)
                self.held, self.block, text = "", _Block(), after
                continue
            keep = _partial_suffix(self.held, TOOL_CALL_OPEN)         # may still become "<tool_call>"
            releasable = self.held[:len(self.held) - keep]
            ready = releasable.rstrip(WHITESPACE)                     # newlines may still precede a call
            self._release(ready, deltas)
            self.held = self.held[len(ready):]

    def _release(self, text: str, deltas: list[Delta]) -> None:
        if self.after_call and text:
            # The whitespace after a call separates the content around it; with no content before, it goes.
            text = text if self.wrote else text.lstrip(WHITESPACE)
            self.after_call = False
        if text:
            deltas.append(TextDelta("content", text))
            self.wrote = True

    def _close(self, deltas: list[Delta]) -> None:
        assert self.block is not None
        call = self.block.close(deltas, self)
        if call is None:
            self.malformed.append(self.block.body)
        else:
            self.calls.append(call)
        self.block, self.after_call = None, True

    def announce(self, name: str) -> CallStart:
        start = CallStart(self.started, self.new_id(), name)
        self.started += 1
        return start


class _Block:
    """One <tool_call> block as it arrives: its header {"name": ..., "arguments": read first, then the
    arguments' JSON streamed until it closes. A block whose header reads otherwise (other keys first,
    arguments that are not an object) is parsed whole when it ends, and its call announced then."""

    def __init__(self) -> None:
        self.body = ""                  # everything read inside the block so far
        self.pending = ""               # text at the end of the body that may begin "</tool_call>"
        self.start: CallStart | None = None
        self.arguments = 0              # where the arguments' JSON starts in body (once the header is read)
        self.extent = _JsonExtent()
        self.end: int | None = None     # where it ends, once it has
        self.whole = False              # parse the block whole at its end (no streaming)

    def add(self, text: str, closed: bool, deltas: list[Delta], parser: ReplyParser) -> None:
        """Read more of the body (`pending` included); closed: "</tool_call>" came right after it. Else an
        end of it that may begin "</tool_call>" in the next piece stays pending, unread."""
        keep = 0 if closed else _partial_suffix(text, TOOL_CALL_CLOSE)
        self.pending = text[len(text) - keep:]
        self.body += text[:len(text) - keep]
        self._stream(deltas, parser)

    def _stream(self, deltas: list[Delta], parser: ReplyParser) -> None:
        if self.whole or self.end is not None:
            return
        if self.start is None:
            header = _read_header(self.body)
            if header is None:
                return                                          # not yet decided
            if header is False or self.body[header[1]] != "{":
                self.whole = True
                return
            name, self.arguments = header
            self.start = parser.announce(name)
            deltas.append(self.start)
            self.extent.position = self.arguments
        begin = self.extent.position
        self.end = self.extent.scan(self.body)
        stop = self.end if self.end is not None else len(self.body)
        if stop > begin:
            deltas.append(ArgumentsDelta(self.start.index, self.body[begin:stop]))

    def close(self, deltas: list[Delta], parser: ReplyParser) -> ToolCall | None:
        """The block's call, or None if it is not one; announces a call parsed whole."""
        self.body += self.pending
        self.pending = ""
        if self.start is not None:
            arguments = self.body[self.arguments:self.end] if self.end is not None else None
            if arguments is None or not _is_object(arguments):
                return None
            return ToolCall(self.start.index, self.start.id, self.start.name, arguments)
        call = _parse_whole(self.body)
        if call is None:
            return None
        name, arguments = call
        start = parser.announce(name)
        deltas += [start, ArgumentsDelta(start.index, arguments)]
        return ToolCall(start.index, start.id, name, arguments)


class _JsonExtent:
    """Finds, character by character, where a JSON object starting at `position` ends (strings and their
    escapes taken into account)."""

    def __init__(self) -> None:
        self.position = 0
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def scan(self, text: str) -> int | None:
        """Read text[position:]; the index just past the value's end, or None if it has not ended yet."""
        for i in range(self.position, len(text)):
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.position = i + 1
                    return i + 1
        self.position = len(text)
        return None


# The header of a call, {"name": "...", "arguments": , read step by step with any whitespace between steps.
_HEADER_STEPS = ("{", '"name"', ":", None, ",", '"arguments"', ":")      # None: the name, a JSON string
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_OPEN_STRING = re.compile(r'"(?:[^"\\]|\\.)*\\?')


def _read_header(body: str) -> tuple[str, int] | Literal[False] | None:
    """(name, where the arguments' value starts) once body holds the whole header and the value's first
    character; None while it may still become one; False if it cannot."""
    i, name = 0, ""
    for step in (*_HEADER_STEPS, ""):
        while i < len(body) and body[i] in WHITESPACE:
            i += 1
        if i == len(body):
            return None
        if step is None:
            string = _STRING.match(body, i)
            if string is None:
                return None if _OPEN_STRING.fullmatch(body, i) else False
            name, i = json.loads(string[0]), string.end()
        elif body.startswith(step, i):
            i += len(step)
        else:
            return None if step.startswith(body[i:]) else False
    return (name, i) if name else False


def _parse_whole(body: str) -> tuple[str, str] | None:
    """(name, arguments' JSON text) of a block's body parsed whole, or None if it is not a call."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"] or "arguments" not in call:
        return None
    arguments = call["arguments"]
    if isinstance(arguments, str):                   # arguments written as a JSON string of JSON
        return (call["name"], arguments) if _is_object(arguments) else None
    return (call["name"], json.dumps(arguments, ensure_ascii=False)) if isinstance(arguments, dict) else None


def _is_object(text: str) -> bool:
    """Whether text is the JSON of an object (a call's arguments must be one)."""
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a beginning of `marker` (but not all of it)."""
    return max((n for n in range(1, min(len(marker), len(text) + 1)) if text.endswith(marker[:n])), default=0)
