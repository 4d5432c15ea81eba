"""POST /v1/responses, OpenAI's Responses API: a Responses body read into the ChatBody the chat endpoint reads
(read_responses: `input` items as chat messages, `instructions` as the system message, the flat function `tools`,
`text.format` as response_format, `max_output_tokens`, `reasoning.effort` as a thinking budget), generated as a
chat reply (requests.Service, responses.Reply) and shaped as a Response object (`Answer`): its output items (the
thinking as a `reasoning` item's content, and as its summary, verbatim, when one is asked: there is no summariser;
the answer as a `message`, each tool call as a `function_call`, the same items whole and streamed, a call cut by
max_output_tokens an incomplete one), status "completed" or "incomplete" (max_output_tokens), usage with cached
and reasoning tokens; streamed as the documented events (response.created ... response.completed), each with its
sequence_number. A response is kept (unless `store: false`) in a bounded store in memory (Store: the last
MAX_STORED, lost on restart), so that a request may continue it by `previous_response_id`: its input items and
output come before the new input (its instructions do not carry over, as OpenAI's).

Imports bodies.py, requests.py, responses.py and structured.py of serving/.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any, AsyncIterator

from ..errors import APIError
from ..files.tokenizer import THINK_CLOSE
from ..generation.thinking import EFFORT_BUDGETS
from ..generation.tool_calls import TOOL_CALL_OPEN
from .bodies import ChatBody, Limits, read_chat
from .requests import Service
from .responses import ChatDeltas, Reply
from .structured import refuse_unknown, tagged

ROLES = ("user", "system", "developer", "assistant")
MESSAGE_KEYS = ("type", "role", "content", "id", "status")
PART_KEYS = {"input_text": ("type", "text"), "output_text": ("type", "text", "annotations", "logprobs")}
ITEM_KEYS = {"function_call": ("type", "call_id", "name", "arguments", "id", "status"),
             "function_call_output": ("type", "call_id", "output", "id", "status"),
             "reasoning": ("type", "id", "summary", "content", "status", "encrypted_content")}
TOOL_KEYS = ("type", "name", "description", "parameters", "strict")
FORMAT_KEYS = {"text": ("type",), "json_object": ("type",), "json_schema": ("type", "name", "description", "schema",
                                                                             "strict")}
# reasoning.summary: qwen_np has no summariser (a local model, no second model to summarise its thinking), so a
# summary is the thinking itself, verbatim: "auto" and "detailed" are that; a "concise" one it cannot give.
SUMMARIES = (None, "auto", "detailed")
# Responses kept for previous_response_id, the oldest forgotten first: at most this many, and this many
# characters of JSON in all (a conversation is bounded by the context: some MiB at most).
MAX_STORED, MAX_STORED_CHARS = 64, 64 * 2**20
# A chat field an error may name -> the Responses field that set it.
RENAMED = {"messages": "input", "response_format": "text", "max_tokens": "max_output_tokens",
           "reasoning_effort": "reasoning"}


class Store:
    """The conversations of the last `size` stored responses (their input items, then their output), by id, in
    memory: lost on restart."""

    def __init__(self, size: int = MAX_STORED, chars: int = MAX_STORED_CHARS) -> None:
        self.size, self.chars, self.lock = size, chars, threading.Lock()
        self.conversations: OrderedDict[str, tuple[list[Any], int]] = OrderedDict()
        self.held = 0                                   # characters of JSON held

    def get(self, response_id: Any) -> list[Any]:
        if not isinstance(response_id, str):
            raise APIError(400, "previous_response_id: must be a string", "previous_response_id")
        with self.lock:
            kept = self.conversations.get(response_id)
        if kept is None:
            raise APIError(400, f"previous_response_id: no stored response {response_id!r} (this server keeps the "
                                f"last {self.size} in memory, none across a restart)", "previous_response_id")
        return kept[0]

    def put(self, response_id: str, items: list[Any]) -> None:
        """Keep a response's conversation: a copy (JSON's), as it would be sent again."""
        text = json.dumps(items, ensure_ascii=False)
        with self.lock:
            self.conversations[response_id] = (json.loads(text), len(text))
            self.held += len(text)
            while len(self.conversations) > self.size or self.held > self.chars:
                self.held -= self.conversations.popitem(last=False)[1][1]


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or input_text / output_text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content: must be a string or a list of input_text parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in PART_KEYS or not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}.content[{j}]: must be {{\"type\": \"input_text\", \"text\": ...}} "
                                "(only text is supported)", "input")
        refuse_unknown(part, PART_KEYS[kind], f"{where}.content[{j}]")
        texts.append(part["text"])
    return "".join(texts)


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A resent reasoning item's thinking: its `content` (reasoning_text parts, the thinking itself) when it has
    one, else its summary (here the same text)."""
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key) or []
        if not isinstance(parts, list) or not all(isinstance(part, dict) and part.get("type", kind) == kind
                                                  and isinstance(part.get("text"), str) for part in parts):
            raise APIError(400, f"{where}.{key}: must be a list of {kind} parts", "input")
        if parts:
            return "\n".join(part["text"] for part in parts)
    return ""


def input_messages(value: Any, instructions: Any) -> list[dict[str, Any]]:
    """`instructions` and `input` as chat messages: a string is one user message; items are messages,
    function calls (joined into one assistant message's tool_calls), their outputs (tool messages), and
    reasoning items resent from an earlier output (the next assistant message's reasoning_content)."""
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise APIError(400, "instructions: must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    if isinstance(value, str):
        return messages + [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise APIError(400, "input: must be a string or a non-empty list of items", "input")
    reasoning: str | None = None
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where}: must be an object (a message, function_call or function_call_output)",
                           "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            refuse_unknown(item, MESSAGE_KEYS, where)
            if item.get("role") not in ROLES:
                raise APIError(400, f"{where}.role: must be one of {', '.join(ROLES)}", "input")
            message = {"role": item["role"], "content": _text(item.get("content"), where)}
            if item["role"] == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif kind in ITEM_KEYS:
            refuse_unknown(item, ITEM_KEYS[kind], where)
            if kind == "reasoning":
                reasoning = _reasoning_text(item, where)
                continue
            for key in ("call_id", "name", "arguments") if kind == "function_call" else ("call_id",):
                if not isinstance(item.get(key), str):
                    raise APIError(400, f"{where}.{key}: must be a string", "input")
            if kind == "function_call":
                call = {"id": item["call_id"], "type": "function",
                        "function": {"name": item["name"], "arguments": item["arguments"]}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and "tool_calls_open" in last:
                    last["tool_calls"].append(call)
                elif last is not None and last["role"] == "assistant" and "tool_calls" not in last:
                    last["tool_calls"], last["tool_calls_open"] = [call], True
                else:
                    message = {"role": "assistant", "content": None, "tool_calls": [call], "tool_calls_open": True}
                    if reasoning is not None:
                        message["reasoning_content"], reasoning = reasoning, None
                    messages.append(message)
            else:
                output = item.get("output")
                messages.append({"role": "tool", "tool_call_id": item["call_id"],
                                 "content": output if isinstance(output, str) else _text(output, where)})
        else:
            raise APIError(400, f"{where}.type: must be message, function_call, function_call_output or reasoning, "
                                f"got {kind!r}", "input")
    for message in messages:
        message.pop("tool_calls_open", None)
    return messages


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """The flat function tools of a Responses body as OpenAI's chat tools."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise APIError(400, "tools: must be a list of function tools", "tools")
    declared = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise APIError(400, f"tools[{i}].type: only function tools are supported "
                                "({\"type\": \"function\", \"name\": ..., \"parameters\": ...})", "tools")
        refuse_unknown(tool, TOOL_KEYS, f"tools[{i}]")
        if tool.get("strict") not in (None, True, False):
            raise APIError(400, f"tools[{i}].strict: must be true or false", "tools")
        function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
        declared.append({"type": "function", "function": function})
    return declared


def chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str) or set(choice) - {"type", "name"}:
            raise APIError(400, 'tool_choice: a named choice must be {"type": "function", "name": ...}', "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def chat_format(text: Any) -> dict[str, Any] | None:
    """`text` ({"format": {...}}) as a chat response_format."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise APIError(400, "text: must be an object, {\"format\": {...}}", "text")
    refuse_unknown(text, ("format",), "text")
    form = text.get("format")
    if form is None:
        return None
    kind = tagged(form, FORMAT_KEYS, "text.format", '{"type": "text"}, {"type": "json_object"} or '
                                                    '{"type": "json_schema", "name": ..., "schema": ...}')
    if kind != "json_schema":
        return {"type": kind}
    if not isinstance(form.get("name"), str) or form.get("strict") not in (None, True, False):
        raise APIError(400, "text.format: a json_schema format needs a name (and strict true or false)", "text")
    spec = {key: form[key] for key in ("name", "description", "schema", "strict") if key in form}
    return {"type": "json_schema", "json_schema": spec}


def chat_effort(reasoning: Any) -> str | None:
    """`reasoning` ({"effort", "summary"}) as reasoning_effort (a thinking budget), its summary checked (Answer
    reads whether one is asked)."""
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise APIError(400, "reasoning: must be an object, {\"effort\": ..., \"summary\": ...}", "reasoning")
    refuse_unknown(reasoning, ("effort", "summary"), "reasoning")
    effort = reasoning.get("effort")
    if effort is not None and effort not in EFFORT_BUDGETS:
        raise APIError(400, f"reasoning.effort: must be one of {', '.join(EFFORT_BUDGETS)}, got {effort!r}",
                       "reasoning")
    if reasoning.get("summary") not in SUMMARIES:
        raise APIError(400, "reasoning.summary: must be auto or detailed (the summary is the thinking itself, "
                            "verbatim: there is no summariser to make a concise one)", "reasoning")
    return effort


def renamed(problem: APIError) -> APIError:
    """A chat reader's error worded with the Responses field that set what it names."""
    if problem.param in RENAMED:
        new = RENAMED[problem.param]
        if problem.message.startswith(problem.param):
            problem.message = new + problem.message[len(problem.param):]
        problem.param = new
    return problem


def conversation(fields: dict[str, Any], store: Store) -> list[Any]:
    """The input items a body asks for: its previous response's conversation (previous_response_id), then its
    `input` (a string: one user message)."""
    value = fields.get("input")
    items = [{"role": "user", "content": value}] if isinstance(value, str) else value
    if not isinstance(items, list) or not items:
        raise APIError(400, "input: must be a string or a non-empty list of items", "input")
    previous = fields.get("previous_response_id")
    return items if previous is None else [*store.get(previous), *items]


def read_responses(fields: dict[str, Any], limits: Limits, items: list[Any]) -> ChatBody:
    """A Responses body's fields (its input: `items`, conversation()) read into the chat body they ask for
    (bodies.read_chat checks them further; its errors name the Responses fields)."""
    if fields.get("store") not in (None, True, False):
        raise APIError(400, "store: must be true or false", "store")
    if fields.get("include") not in (None, []):          # what it could add (logprobs, encrypted reasoning): none
        raise APIError(400, "include: not supported by this server (only an empty list)", "include")
    if fields.get("truncation") not in (None, "disabled"):
        raise APIError(400, "truncation: only \"disabled\" (a conversation too long for the context is refused)",
                       "truncation")
    effort = chat_effort(fields.get("reasoning"))
    chat = {"model": fields.get("model"), "stream": fields.get("stream"),
            "messages": input_messages(items, fields.get("instructions")),
            "tools": chat_tools(fields.get("tools")), "tool_choice": chat_tool_choice(fields.get("tool_choice")),
            "parallel_tool_calls": fields.get("parallel_tool_calls"), "response_format": chat_format(fields.get("text")),
            "max_tokens": fields.get("max_output_tokens"), "temperature": fields.get("temperature"),
            "top_p": fields.get("top_p"), "reasoning_effort": effort}
    try:
        return read_chat({key: value for key, value in chat.items() if value is not None}, limits)
    except APIError as problem:
        raise renamed(problem) from None


class Answer:
    """One Responses request's reply (a responses.Reply of its chat body), shaped as a Response object,
    whole or as its stream of events."""

    def __init__(self, service: Service, body: ChatBody, fields: dict[str, Any], reply: Reply, store: Store,
                 items: list[Any]) -> None:
        self.service, self.body, self.fields, self.reply = service, body, fields, reply
        self.store, self.items = store, items          # where it is kept (unless store: false), its input items
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.sequence = 0

    def _item_id(self, kind: str) -> str:
        return f"{kind}_{uuid.uuid4().hex}"

    def response(self, output: list[dict[str, Any]], status: str) -> dict[str, Any]:
        """The Response object, its echo fields as the request set them."""
        fields = self.fields
        tools = [{"type": "function", "name": t["name"], "description": t.get("description"),
                  "parameters": t.get("parameters"), "strict": t.get("strict")} for t in fields.get("tools") or []]
        reasoning = fields.get("reasoning") or {}
        text = fields.get("text") or {"format": {"type": "text"}}
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "error": None, "background": False,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": fields.get("instructions"), "max_output_tokens": fields.get("max_output_tokens"),
                "metadata": fields.get("metadata") or {}, "model": self.service.name_of(self.reply.request.adapter),
                "output": output, "parallel_tool_calls": fields.get("parallel_tool_calls") is not False,
                "previous_response_id": fields.get("previous_response_id"),
                "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
                "store": fields.get("store") is not False, "temperature": fields.get("temperature"), "text": text,
                "tool_choice": fields.get("tool_choice") or "auto", "tools": tools, "top_p": fields.get("top_p"),
                "truncation": "disabled", "user": fields.get("user"),
                "usage": self.usage() if status in ("completed", "incomplete") else None}

    def usage(self) -> dict[str, Any]:
        usage = self.reply.usage()
        return {"input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                                         "cache_write_tokens": 0},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens()},
                "total_tokens": usage["total_tokens"]}

    def reasoning_tokens(self) -> int:
        """The reply's tokens up to and with its </think> (all of them, when it never closed); 0 if it did not think."""
        row = self.reply.row
        generated = list(row.generated) if row is not None else []
        opened = self.service.tokenizer.token_to_id("<think>")
        if not self.service.split_reasoning or not generated or generated[0] != opened:
            return 0
        close = self.service.tokenizer.token_to_id(THINK_CLOSE)
        return generated.index(close) + 1 if close in generated else len(generated)

    async def whole(self, http: Any) -> dict[str, Any]:
        """The whole response: its items built from the chat message as its stream would build them (Output), so
        that a reply gives the same items whole and streamed, a cut one included."""
        answer = await self.reply.whole(http)
        choice = answer["choices"][0]
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        output = Output(self)
        for delta in message_deltas(choice["message"]):
            output.add(delta)
        output.end(status)
        return self.kept(self.response(output.items, status))

    def kept(self, response: dict[str, Any]) -> dict[str, Any]:
        """`response`, stored (unless the request said store: false) for a later previous_response_id."""
        if self.fields.get("store") is not False:
            self.store.put(self.id, [*self.items, *response["output"]])
        return response

    @property
    def summarised(self) -> bool:
        """Whether the request asked for a summary of the thinking (reasoning.summary): the thinking, verbatim."""
        return (self.fields.get("reasoning") or {}).get("summary") is not None

    def _reasoning(self, text: str, status: str = "completed") -> dict[str, Any]:
        """A reasoning item: the thinking as its content (reasoning_text, as vLLM gives an open model's), and as
        its summary only when one was asked for (an empty summary otherwise, as OpenAI's)."""
        return {"type": "reasoning", "id": self._item_id("rs"), "content": [{"type": "reasoning_text", "text": text}],
                "summary": [{"type": "summary_text", "text": text}] if self.summarised else [], "status": status}

    def _message(self, text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
        return {"type": "message", "id": item_id or self._item_id("msg"), "role": "assistant", "status": status,
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    def _call(self, item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
        return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
                "status": status}

    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    async def stream(self) -> AsyncIterator[str]:
        """The documented events: response.created and .in_progress, each output item added, its deltas, done,
        then response.completed (or .incomplete) with the whole response; an error as an `error` event."""
        yield self._event("response.created", response=self.response([], "in_progress"))
        yield self._event("response.in_progress", response=self.response([], "in_progress"))
        output = Output(self)
        finish = None
        async for chunk in self.reply.chunks(False):
            if "error" in chunk:
                error = chunk["error"]
                yield self._event("error", code=error.get("code"), message=error.get("message"),
                                  param=error.get("param"), error=error)
                return
            choice = chunk["choices"][0]
            finish = choice.get("finish_reason") or finish
            for event in output.add(choice.get("delta") or {}):
                yield event
        status = "incomplete" if finish == "length" else "completed"
        for event in output.end(status):
            yield event
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        yield self._event(kind, response=self.kept(self.response(output.items, status)))


def message_deltas(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A whole chat message as the stream deltas that build its items: its thinking, its text, its calls, and of
    each block that is no call (one cut by max_output_tokens; listed without its <tool_call>) what the stream's
    parser had announced of it (the call's name and the arguments written), as the stream gave it before the cut."""
    deltas: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        deltas.append({"reasoning_content": message["reasoning_content"]})
    if message.get("content"):
        deltas.append({"content": message["content"]})
    deltas += [{"tool_calls": [call]} for call in message.get("tool_calls") or []]
    for raw in message.get("malformed_tool_calls") or []:
        parser = ChatDeltas(split_reasoning=False, calls=True)
        deltas += [delta for delta in parser.feed(TOOL_CALL_OPEN + raw) + parser.finish() if "tool_calls" in delta]
    return deltas


class Output:
    """A response's output items, built from a chat reply's deltas (whole or streamed alike), and the events
    that build them: a reasoning item for the thinking, a message for text, a function_call per call; the
    last item takes the response's status (a cut reply's last item is incomplete)."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.items: list[dict[str, Any]] = []
        self.current: dict[str, Any] | None = None        # the item being written

    def _open(self, item: dict[str, Any]) -> list[str]:
        event = self.answer._event
        self.current = item
        self.items.append(item)
        index = len(self.items) - 1
        events = [event("response.output_item.added", output_index=index, item=_in_progress(item))]
        if item["type"] == "reasoning" and item["summary"]:
            events.append(event("response.reasoning_summary_part.added", item_id=item["id"], output_index=index,
                                summary_index=0, part={"type": "summary_text", "text": ""}))
        elif item["type"] == "message":
            events.append(event("response.content_part.added", item_id=item["id"], output_index=index,
                                content_index=0, part={**item["content"][0], "text": ""}))
        return events

    def _close(self, status: str = "completed") -> list[str]:
        event = self.answer._event
        item, self.current = self.current, None
        if item is None:
            return []
        index, events = self.items.index(item), []
        item["status"] = status
        if item["type"] == "reasoning":
            events.append(event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                content_index=0, text=item["content"][0]["text"]))
            for part in item["summary"]:
                events += [event("response.reasoning_summary_text.done", item_id=item["id"], output_index=index,
                                 summary_index=0, text=part["text"]),
                           event("response.reasoning_summary_part.done", item_id=item["id"], output_index=index,
                                 summary_index=0, part=part)]
        elif item["type"] == "message":
            part = item["content"][0]
            events += [event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                             text=part["text"], logprobs=[]),
                       event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                             part=part)]
        else:
            events.append(event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                name=item["name"], arguments=item["arguments"]))
        events.append(event("response.output_item.done", output_index=index, item=item))
        return events

    def _writing(self, kind: str, new: Any) -> list[str]:
        """The events that make an item of `kind` the one being written (opening new() unless it is)."""
        if self.current is not None and self.current["type"] == kind:
            return []
        return self._close() + self._open(new())

    def add(self, delta: dict[str, Any]) -> list[str]:
        """The events of one chat delta (its thinking, text and call pieces) added to the items."""
        answer, event, events = self.answer, self.answer._event, []
        if delta.get("reasoning_content"):
            piece = delta["reasoning_content"]
            events += self._writing("reasoning", lambda: answer._reasoning("", "in_progress"))
            assert self.current is not None
            self.current["content"][0]["text"] += piece
            events.append(event("response.reasoning_text.delta", item_id=self.current["id"],
                                output_index=len(self.items) - 1, content_index=0, delta=piece))
            for part in self.current["summary"]:
                part["text"] += piece
                events.append(event("response.reasoning_summary_text.delta", item_id=self.current["id"],
                                    output_index=len(self.items) - 1, summary_index=0, delta=piece))
        if delta.get("content"):
            events += self._writing("message", lambda: answer._message("", "in_progress"))
            assert self.current is not None
            self.current["content"][0]["text"] += delta["content"]
            events.append(event("response.output_text.delta", item_id=self.current["id"],
                                output_index=len(self.items) - 1, content_index=0, delta=delta["content"],
                                logprobs=[]))
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if call.get("id"):
                events += self._close() + self._open(answer._call(answer._item_id("fc"), call["id"],
                                                                  function.get("name", ""), "", "in_progress"))
            if function.get("arguments") and self.current is not None and self.current["type"] == "function_call":
                self.current["arguments"] += function["arguments"]
                events.append(event("response.function_call_arguments.delta", item_id=self.current["id"],
                                    output_index=len(self.items) - 1, delta=function["arguments"]))
        return events

    def end(self, status: str) -> list[str]:
        """The events that close the last item with the response's status (an empty message if none was written)."""
        opened = [] if self.items else self._open(self.answer._message("", "in_progress"))
        return opened + self._close(status)


def _in_progress(item: dict[str, Any]) -> dict[str, Any]:
    """An item as output_item.added shows it: nothing written yet."""
    item = json.loads(json.dumps(item))
    item["status"] = "in_progress"
    if item["type"] == "reasoning":
        item["summary"], item["content"] = [], []
    elif item["type"] == "message":
        item["content"] = []
    return item
