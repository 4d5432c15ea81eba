"""A chat's messages and tools as the chat template reads them, checked field by field: the one rule for the
server's request messages (serving/bodies.py) and a chat file's lines (training/chats.py).

A message is OpenAI's: {"role", "content", ...}, content a string or a list of text parts (joined), an
assistant's content null beside its tool calls; tool calls in OpenAI's shape; "developer" read as "system".
What the template cannot read as sent (a role it has no turn for, content it would print as a Python list, a
tool call it would index into) is refused by its place, messages[i].FIELD, rather than rendered as something
else or failing inside the template.

May import: qwen_np.errors (a floor of files/).
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import QwenNPError

ROLES = ("system", "developer", "user", "assistant", "tool")
# A message's keys: what the template reads, what a client resending our own reply carries (its
# malformed_tool_calls are not rendered: the model wrote no call there), and (refused unless off) what
# qwen_np does not do.
MESSAGE_KEYS = ("role", "content", "name", "reasoning_content", "reasoning", "tool_call_id", "tool_calls",
                "malformed_tool_calls")
MESSAGE_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "function_call": (None,), "audio": (None,), "refusal": (None,), "annotations": (None, [])}
# A tool's name as OpenAI allows one.
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class MessageError(QwenNPError):
    """A message or tool the template cannot read: the message names its place (messages[1].content: ...);
    `code` says why where a client may act on it (OpenAI's "unknown_field", "unsupported_field")."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code

    def __reduce__(self) -> tuple[Any, ...]:          # a copy (pickle, copy.copy) keeps `code`
        return type(self), (self.detail, self.code)


def chat_message(message: Any, index: int) -> dict[str, Any]:
    """messages[index] as the template reads it: role, text content (text parts joined; an assistant's null
    content, valid OpenAI input beside tool calls, is empty), name, reasoning and tool calls."""
    where = f"messages[{index}]"
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise MessageError(f"{where}: must be an object with a role among {', '.join(ROLES)}")
    for key, value in message.items():
        if key in MESSAGE_UNSUPPORTED and value not in MESSAGE_UNSUPPORTED[key]:
            raise MessageError(f"{where}.{key}: not supported by qwen_np", "unsupported_field")
        if key not in MESSAGE_KEYS and key not in MESSAGE_UNSUPPORTED:
            raise MessageError(f"{where}.{key}: not a field of a message", "unknown_field")
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                   for part in content):
            raise MessageError(f"{where}.content: only text parts are supported")
        content = "".join(part["text"] for part in content)
    if not isinstance(content, str) and not (content is None and message["role"] == "assistant"):
        raise MessageError(f"{where}.content: must be a string or a list of text parts")
    for name in ("name", "reasoning_content", "reasoning", "tool_call_id"):    # the template calls string methods
        if message.get(name) is not None and not isinstance(message[name], str):
            raise MessageError(f"{where}.{name}: must be a string")
    calls = tool_calls(message["tool_calls"], where) if message.get("tool_calls") is not None else []
    if calls and message["role"] != "assistant":
        raise MessageError(f"{where}.tool_calls: only an assistant message calls tools")
    role = "system" if message["role"] == "developer" else message["role"]
    # "reasoning": vLLM's name for it, which our replies carry too (a client may resend them as they came).
    reasoning = next((message[key] for key in ("reasoning_content", "reasoning") if message.get(key) is not None), None)
    return {**({"name": message["name"]} if message.get("name") is not None else {}),
            **({"reasoning_content": reasoning} if reasoning is not None else {}),
            **({"tool_calls": calls} if calls else {}),
            "role": role, "content": content if content is not None else ""}


def tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's tool_calls as the template reads them (OpenAI's shape, checked; `where` names the
    message): [{"id", "type": "function", "function": {"name", "arguments"}}], the arguments their JSON text
    (an object is accepted, and written as the template writes one)."""
    if not isinstance(value, list):
        raise MessageError(f"{where}.tool_calls: must be a list of tool calls")
    calls = []
    for i, call in enumerate(value):
        at = f"{where}.tool_calls[{i}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise MessageError(f'{at}: must be {{"id": ..., "type": "function", "function": {{"name": ..., '
                               '"arguments": ...}}}}')
        if not isinstance(call.get("id", ""), str):
            raise MessageError(f"{at}.id: must be a string")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise MessageError(f"{at}.function.name: must be a non-empty string")
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, (str, dict)):
            raise MessageError(f"{at}.function.arguments: must be a string of JSON (or an object)")
        calls.append({"id": call.get("id", ""), "type": "function",
                      "function": {"name": function["name"], "arguments": arguments}})
    return calls


def declared_tools(value: Any) -> list[Any] | None:
    """A chat's `tools` as the template renders them into the system turn: a list of OpenAI's tools, each
    checked (tool_function); None when it declares none."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise MessageError("tools: must be a list of tools")
    for i, tool in enumerate(value):
        tool_function(tool, i)
    return value or None


def tool_function(tool: Any, index: int) -> dict[str, Any]:
    """tools[index]'s function: {"type": "function", "function": {"name": NAME, ...}}, NAME as OpenAI allows
    one. (Its parameters are checked where their grammar is compiled: generation/constraints.py.)"""
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(tool.get("function"), dict):
        raise MessageError(f'{where}: must be {{"type": "function", "function": {{...}}}}')
    name = tool["function"].get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise MessageError(f"{where}.function.name: must be 1-64 letters, digits, _ or -, got {name!r}")
    return tool["function"]
