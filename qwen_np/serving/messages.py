"""Anthropic's Messages API on the same server: `POST /v1/messages` (whole, or streamed as Anthropic's events)
and `POST /v1/messages/count_tokens`, as the official `anthropic` client calls them.

An Anthropic body is read into the ChatBody the chat endpoint reads (bodies.read_chat), so everything after
it is the chat's: the template, tools and their grammar, the thinking budget, the batch row (requests.Service)
and the reply's events (responses.Reply). What is Anthropic's is only its shape:

    system (a string or text blocks)   the system message
    messages[i].content                a string, or blocks: text; an assistant's thinking (its reasoning, the
                                       signature left alone) and tool_use (a call, its input the arguments);
                                       a user's tool_result (a "tool" message; is_error writes "[error] "
                                       before its text); cache_control on any block is read and left alone
                                       (the prefix cache reuses what it can by itself)
    tools [{name, description, input_schema}]   function tools (strict, type "custom" accepted)
    tool_choice auto / any / none / tool       auto / required / none / a named tool; disable_parallel_tool_use
    stop_sequences, temperature (0 to 1, Anthropic's range), top_p, top_k, max_tokens (required); metadata and
                                       cache_control read and left alone
    thinking enabled (budget_tokens: the thinking budget, any N >= 0 here) / adaptive (thinking, no budget) /
                                       disabled (enable_thinking false); absent: the template's default

The reply's content blocks: thinking (with a signature: a digest of its text, checked by nothing), text,
tool_use (id "toolu_...", input the parsed arguments); a <tool_call> block that is no call comes as text
(streamed, a cut call's tool_use block and its pieces were sent as they came).
stop_reason: end_turn, max_tokens, stop_sequence (with the stop_sequence met) or tool_use. usage counts
input_tokens as Anthropic does, beside cache_read_input_tokens (the prompt tokens the prefix cache held).
Errors on these routes are Anthropic's: {"type": "error", "error": {"type", "message"}}.

Imports bodies.py, requests.py, responses.py and structured.py of serving/.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import uuid
from typing import Any, AsyncIterator, Iterator

from ..errors import APIError
from ..generation.batching import Request
from .bodies import MAX_STOP_CHARS, MAX_STOPS, ChatBody, Limits, in_range, read_chat
from .requests import Service
from .responses import Reply
from .structured import field_of, refuse_unknown, tagged

PATH, COUNT_PATH = "/v1/messages", "/v1/messages/count_tokens"
# Each block's keys (one not listed is refused by name, never ignored).
BLOCK_KEYS = {"text": ("type", "text", "cache_control", "citations"),
              "thinking": ("type", "thinking", "signature", "cache_control"),
              "tool_use": ("type", "id", "name", "input", "cache_control"),
              "tool_result": ("type", "tool_use_id", "content", "is_error", "cache_control")}
BLOCKS_OF = {"user": ("text", "tool_result"), "assistant": ("text", "thinking", "tool_use")}
TOOL_KEYS = ("name", "description", "input_schema", "cache_control", "type", "strict")
TOOL_CHOICE_KEYS = {"auto": ("type", "disable_parallel_tool_use"), "any": ("type", "disable_parallel_tool_use"),
                    "none": ("type",), "tool": ("type", "name", "disable_parallel_tool_use")}
THINKING_KEYS = {"enabled": ("type", "budget_tokens", "display"), "adaptive": ("type", "display"),
                 "disabled": ("type",)}
# The chat fields a conversion sets -> the Anthropic field a client sent them in (an error names the latter).
FIELD_NAMES = {"stop": "stop_sequences", "thinking_budget": "thinking.budget_tokens", "chat_template_kwargs": "thinking",
               "parallel_tool_calls": "tool_choice", "max_completion_tokens": "max_tokens"}
# The chat's names of a tool's fields (files/messages.declared_tools words its errors with them) -> Anthropic's.
TOOL_FIELDS = ((re.compile(r"^tools\[(\d+)\]\.function\.parameters"), r"tools[\1].input_schema"),
               (re.compile(r"^tools\[(\d+)\]\.function\."), r"tools[\1]."))
# Our finish reasons -> Anthropic's stop_reason ("stop" is a stop sequence's only where one was met).
STOP_REASONS = {"eos": "end_turn", "stop": "end_turn", "length": "max_tokens", "context": "max_tokens"}
# HTTP status -> Anthropic's error type.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
               413: "request_too_large", 415: "invalid_request_error", 422: "invalid_request_error",
               429: "rate_limit_error", 499: "invalid_request_error", 503: "overloaded_error", 529: "overloaded_error"}


def is_messages(path: str) -> bool:
    """Whether `path` is one of this API's (its errors then come in Anthropic's shape)."""
    return path == PATH or path.startswith(PATH + "/")


def error_body(problem: APIError) -> dict[str, Any]:
    """Anthropic's error JSON of `problem`: {"type": "error", "error": {"type", "message"}}."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(problem.status, "api_error"), "message": problem.message}}


def _problem(where: str, why: str) -> APIError:
    return APIError(400, f"{where}: {why}", field_of(where))


def _text(value: Any, where: str) -> str:
    """A string, or text blocks joined (system, a tool_result's content)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _problem(where, "must be a string or a list of text blocks")
    texts = []
    for i, block in enumerate(value):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise _problem(f"{where}[{i}]", 'must be a text block, {"type": "text", "text": ...} (Qwen3 reads text only)')
        refuse_unknown(block, BLOCK_KEYS["text"], f"{where}[{i}]")
        texts.append(block["text"])
    return "".join(texts)


def _messages(fields: dict[str, Any]) -> list[dict[str, Any]]:
    """system and messages as the chat's messages."""
    chat: list[dict[str, Any]] = []
    if fields.get("system") is not None:
        chat.append({"role": "system", "content": _text(fields["system"], "system")})
    messages = fields.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _problem("messages", "must be a non-empty list of messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in BLOCKS_OF:
            raise _problem(where, 'must be an object with a role "user" or "assistant" and a content')
        refuse_unknown(message, ("role", "content"), where)
        role, content = message["role"], message.get("content")
        if isinstance(content, str):
            chat.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise _problem(f"{where}.content", "must be a string or a list of content blocks")
        text: list[str] = []
        reasoning: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in BLOCKS_OF[role]:
                raise _problem(at, f"a {role} message's blocks are {', '.join(BLOCKS_OF[role])} (got {kind!r}; Qwen3 "
                                   "reads text only)")
            assert isinstance(block, dict)
            refuse_unknown(block, BLOCK_KEYS[kind], at)
            if block.get("citations") not in (None, []):
                raise APIError(400, f"{at}.citations: not supported by this server", "messages", "unsupported_field")
            if kind == "text":
                text.append(_string(block, "text", at))
            elif kind == "thinking":
                reasoning.append(_string(block, "thinking", at))
            elif kind == "tool_use":
                if not isinstance(block.get("input"), dict):
                    raise _problem(f"{at}.input", "must be an object")
                calls.append({"id": _string(block, "id", at), "type": "function",
                              "function": {"name": _string(block, "name", at), "arguments": json.dumps(block["input"])}})
            else:                                                            # tool_result
                if text:
                    chat.append({"role": "user", "content": "".join(text)})
                    text = []
                if block.get("is_error") not in (None, True, False):
                    raise _problem(f"{at}.is_error", "must be true or false")
                result = _text(block.get("content", ""), f"{at}.content")
                chat.append({"role": "tool", "tool_call_id": _string(block, "tool_use_id", at),
                             "content": ("[error] " if block.get("is_error") else "") + result})
        if role == "assistant":
            chat.append({"role": "assistant", "content": "".join(text),
                         **({"reasoning_content": "".join(reasoning)} if reasoning else {}),
                         **({"tool_calls": calls} if calls else {})})
        elif text or not content:
            chat.append({"role": "user", "content": "".join(text)})
    if messages[-1].get("role") == "assistant":
        raise _problem(f"messages[{len(messages) - 1}]", "an assistant message last (a prefill of the reply) is not "
                                                       "supported: the reply is a new assistant turn")
    return chat


def _string(block: dict[str, Any], key: str, where: str) -> str:
    if not isinstance(block.get(key), str):
        raise _problem(f"{where}.{key}", "must be a string")
    return str(block[key])


def _tools(fields: dict[str, Any]) -> dict[str, Any]:
    """tools and tool_choice as the chat's tools, tool_choice and parallel_tool_calls."""
    out: dict[str, Any] = {}
    tools = fields.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _problem("tools", "must be a list of tools")
        declared = []
        for i, tool in enumerate(tools):
            where = f"tools[{i}]"
            if not isinstance(tool, dict):
                raise _problem(where, "must be an object with a name and an input_schema")
            if tool.get("type") not in (None, "custom"):
                raise APIError(400, f"{where}.type: {tool.get('type')!r}: Anthropic's server tools are not supported "
                                    "(only client tools: a name, a description and an input_schema)", "tools",
                               "unsupported_field")
            refuse_unknown(tool, TOOL_KEYS, where)
            if not isinstance(tool.get("input_schema"), dict):
                raise _problem(f"{where}.input_schema", "must be a JSON schema (an object)")
            if tool.get("strict") not in (None, True, False):
                raise _problem(f"{where}.strict", "must be true or false")
            function = {"name": tool.get("name"), "parameters": tool["input_schema"],
                        **({"description": tool["description"]} if "description" in tool else {})}
            declared.append({"type": "function", "function": function})
        out["tools"] = declared
    choice = fields.get("tool_choice")
    if choice is not None:
        kind = tagged(choice, TOOL_CHOICE_KEYS, "tool_choice", '{"type": "auto"}, {"type": "any"}, {"type": "none"} '
                                                               'or {"type": "tool", "name": ...}')
        disable = choice.get("disable_parallel_tool_use")
        if disable not in (None, True, False):
            raise _problem("tool_choice.disable_parallel_tool_use", "must be true or false")
        if kind == "tool":
            names = [tool.get("name") for tool in tools or []]
            if not isinstance(choice.get("name"), str) or choice["name"] not in names:
                raise _problem("tool_choice.name", f"must be the name of a declared tool, got {choice.get('name')!r}")
            out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        else:
            out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
        if disable is not None:
            out["parallel_tool_calls"] = not disable
    return out


def _thinking(fields: dict[str, Any]) -> dict[str, Any]:
    """thinking as the chat's enable_thinking and thinking_budget."""
    thinking = fields.get("thinking")
    if thinking is None:
        return {}
    kind = tagged(thinking, THINKING_KEYS, "thinking", '{"type": "enabled", "budget_tokens": N}, {"type": "adaptive"} '
                                                       'or {"type": "disabled"}')
    if thinking.get("display") not in (None, "summarized"):
        raise APIError(400, "thinking.display: only \"summarized\" (the thinking is returned whole)", "thinking",
                       "unsupported_field")
    out: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": kind != "disabled"}}
    if kind == "enabled":
        if thinking.get("budget_tokens") is None:
            raise _problem("thinking.budget_tokens", "required with type \"enabled\"")
        out["thinking_budget"] = in_range("thinking.budget_tokens", thinking["budget_tokens"], int, 0)
    return out


def chat_fields(fields: dict[str, Any], count: bool = False) -> dict[str, Any]:
    """An Anthropic body's fields as the chat endpoint's (bodies.read_chat reads them); count: a count_tokens
    body (no max_tokens, nothing sampled)."""
    if not count and fields.get("max_tokens") is None:
        raise _problem("max_tokens", "required (the reply's most tokens)")
    if fields.get("cache_control") is not None and not isinstance(fields["cache_control"], dict):
        raise _problem("cache_control", 'must be an object, {"type": "ephemeral"}')
    stops = fields.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list) or len(stops) > MAX_STOPS
                              or not all(isinstance(s, str) and len(s) <= MAX_STOP_CHARS for s in stops)):
        raise _problem("stop_sequences", f"must be a list of at most {MAX_STOPS} strings, each at most "
                                         f"{MAX_STOP_CHARS} characters")
    chat: dict[str, Any] = {"model": fields.get("model"), "stream": fields.get("stream"), "messages": _messages(fields),
                            **_tools(fields), **_thinking(fields)}
    if not count:
        chat |= {"max_tokens": fields["max_tokens"], "stop": stops}
        chat |= {name: fields.get(name) for name in ("temperature", "top_p", "top_k")}
        if chat["temperature"] is not None:
            in_range("temperature", chat["temperature"], float, 0, 1)                # Anthropic's range
    return chat


@contextlib.contextmanager
def anthropic_names() -> Iterator[None]:
    """An error about a chat field, worded with the Anthropic field it came from (FIELD_NAMES)."""
    try:
        yield
    except APIError as problem:
        for pattern, anthropic in TOOL_FIELDS:
            problem.message = pattern.sub(anthropic, problem.message, count=1)
        for name, anthropic in FIELD_NAMES.items():
            if problem.message.startswith(f"{name}: ") or problem.param == name:
                problem.message = problem.message.replace(f"{name}: ", f"{anthropic}: ", 1)
                problem.param = anthropic
        raise problem from None


def read_messages(fields: dict[str, Any], limits: Limits, count: bool = False) -> ChatBody:
    """A /v1/messages body (or count_tokens', `count`) read into the chat's ChatBody."""
    with anthropic_names():
        return read_chat(chat_fields(fields, count), limits)


def message_request(service: Service, body: ChatBody, prompt: list[int]) -> Request:
    """Service.request, its errors worded with Anthropic's fields."""
    with anthropic_names():
        return service.request(body, prompt)


def _signature(thinking: str) -> str:
    """A thinking block's signature: a digest of its text (Anthropic's is checked by its API; nothing checks this)."""
    return "qwen_np-" + hashlib.sha256(thinking.encode()).hexdigest()[:32]


def _tool_id(call_id: str) -> str:
    return "toolu_" + (call_id.removeprefix("call_") or uuid.uuid4().hex[:24])


def _input(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return {}


class MessageReply:
    """One /v1/messages reply: the chat's Reply of its one row, shaped as Anthropic's message or its events."""

    def __init__(self, service: Service, body: ChatBody, request: Request) -> None:
        self.service, self.body = service, body
        self.reply = Reply(service, request, chat=True, calls=body.calls)
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.model = service.name_of(request.adapter)

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage of the row (the server's log line reads it)."""
        return self.reply.usage()

    def _usage(self) -> dict[str, int]:
        usage = self.reply.usage()
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        return {"input_tokens": usage["prompt_tokens"] - cached, "cache_read_input_tokens": cached,
                "cache_creation_input_tokens": 0, "output_tokens": usage["completion_tokens"]}

    def _stop(self, called: bool) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) of the finished row."""
        row = self.reply.row
        finish = row.finish_reason if row is not None and row.finish_reason else "eos"
        if called and finish in ("eos", "stop"):
            return "tool_use", None
        if finish == "stop" and self.body.stops and row is not None:
            text = self.service.tokenizer.decode(list(row.generated))
            met = [(text.find(stop), i, stop) for i, stop in enumerate(self.body.stops) if stop and stop in text]
            if met:
                return "stop_sequence", min(met)[2]
        return STOP_REASONS.get(finish, "end_turn"), None

    def _message(self, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
                 usage: dict[str, int]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}

    async def whole(self, http: Any) -> dict[str, Any]:
        """The non-streamed message."""
        answer = await self.reply.whole(http)
        message = answer["choices"][0]["message"]
        content: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            content.append({"type": "thinking", "thinking": message["reasoning_content"],
                            "signature": _signature(message["reasoning_content"])})
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        content += [{"type": "text", "text": raw} for raw in message.get("malformed_tool_calls", [])]
        calls = message.get("tool_calls", [])
        content += [{"type": "tool_use", "id": _tool_id(call["id"]), "name": call["function"]["name"],
                     "input": _input(call["function"]["arguments"])} for call in calls]
        return self._message(content, self._stop(bool(calls)), self._usage())

    async def events(self) -> AsyncIterator[str]:
        """The stream, as Server-Sent Events: message_start, a ping (as Anthropic's API sends one after it),
        each block's content_block_start, its deltas and content_block_stop, message_delta (stop_reason,
        usage), message_stop; an error that ends it as an `error` event."""
        prompt = len(self.reply.request.prompt)
        yield _event("message_start", {"type": "message_start", "message": self._message(
            [], (None, None), {"input_tokens": prompt, "output_tokens": 0})})
        yield _event("ping", {"type": "ping"})
        blocks = Blocks()
        called = False
        async for chunk in self.reply.chunks(include_usage=False):
            if "error" in chunk:
                problem = chunk["error"]
                kind = "api_error" if problem.get("type") == "server_error" else "invalid_request_error"
                for text in blocks.close():
                    yield text
                yield _event("error", {"type": "error", "error": {"type": kind, "message": problem["message"]}})
                return
            choice = chunk["choices"][0]
            delta = choice["delta"]
            if "reasoning_content" in delta:
                for text in blocks.add("thinking", delta["reasoning_content"]):
                    yield text
            if delta.get("content"):
                for text in blocks.add("text", delta["content"]):
                    yield text
            for raw in delta.get("malformed_tool_calls", []):
                for text in [*blocks.add("text", raw), *blocks.close()]:
                    yield text
            for call in delta.get("tool_calls", []):
                called = True
                for text in blocks.call(call):
                    yield text
        for text in blocks.close():
            yield text
        stop = self._stop(called)
        usage = self._usage()
        yield _event("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
                                       "usage": usage})
        yield _event("message_stop", {"type": "message_stop"})


class Blocks:
    """A streamed message's content blocks, opened, added to and closed as its deltas come (one open at a time)."""

    def __init__(self) -> None:
        self.index, self.thinking = -1, ""
        self.open: str | None = None

    def _start(self, block: dict[str, Any]) -> Iterator[str]:
        yield from self.close()
        self.index += 1
        self.open, self.thinking = block["type"], ""
        yield _event("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})

    def _delta(self, delta: dict[str, Any]) -> str:
        return _event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def add(self, kind: str, text: str) -> list[str]:
        """A piece of thinking or text (a new block when the open one is of another kind)."""
        out = []
        if self.open != kind:
            out += list(self._start({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                                    else {"type": "text", "text": ""}))
        if kind == "thinking":
            self.thinking += text
            out.append(self._delta({"type": "thinking_delta", "thinking": text}))
        elif text:
            out.append(self._delta({"type": "text_delta", "text": text}))
        return out

    def call(self, call: dict[str, Any]) -> list[str]:
        """A tool call's delta: its start (id, name) opens a tool_use block, its arguments are input_json_delta."""
        out = []
        if "id" in call:
            out += list(self._start({"type": "tool_use", "id": _tool_id(call["id"]), "name": call["function"]["name"],
                                     "input": {}}))
        arguments = call.get("function", {}).get("arguments")
        if arguments:
            out.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return out

    def close(self) -> list[str]:
        """The open block's end (a thinking block's signature first)."""
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": _signature(self.thinking)}))
        out.append(_event("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.open = None
        return out


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


def count_tokens(service: Service, body: ChatBody) -> dict[str, int]:
    """POST /v1/messages/count_tokens: the rendered prompt's tokens."""
    return {"input_tokens": len(service.chat_prompt(body))}

