"""What a chat request asks of its reply's form: the tools it may call (`tools`, `tool_choice`,
`parallel_tool_calls`) and the form of its answer (`response_format`), each read as OpenAI defines it and
made into the grammar that constrained decoding holds the reply to (generation/constraints.py). The tools'
shape is files/messages.py's rule, as a chat file's (training) is read.

    tools + tool_choice "auto"      the tools in the system turn (Qwen3's template); free text, and a call
                                    once the model opens <tool_call>, held to a declared tool's schema
    tools + "required" / a name     only calls (of that tool), each valid against its schema
    tools + "none"                  the tools stay in the prompt (as OpenAI: the model knows them), but the
                                    grammar never allows <tool_call>, so no call can be made
    response_format json_object     one JSON object; json_schema: one JSON value valid against the schema
                                    (enforced whatever `strict` says: a grammar cannot be half-kept)
    tools "auto" + response_format  that one value, or calls (an agent's output type beside its tools)

A reply that is all value (response_format, tool_choice "required" or a named tool) ends where its value is
complete (finish "stop", or "tool_calls"), or is cut by max_tokens (finish "length"): `stop` and
`stop_token_ids`, which could only cut the value, are refused by name. With tool_choice "auto" or "none" they
apply to the reply's free text, never inside a call (generate.Ending).

With thinking on, each grammar lets the reply open with its <think> block. A schema keyword the engine does
not implement is a 400 naming it. The readers (read_tools, read_response_format) run once a request,
from bodies.py; grammar() compiles what they read. Imports nothing of serving/.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import APIError, QwenNPError
from ..files.messages import declared_tools
from ..generation.constraints import (INSTALL, Grammar, Vocabulary, json_object_grammar, json_schema_grammar,
                                      tool_call_grammar)

TOOL_CHOICES = ("auto", "none", "required")
# The keys each response_format reads, and those of its json_schema (OpenAI's; json_object's `schema` is
# llama.cpp's and vLLM's).
RESPONSE_KEYS = {"text": ("type",), "json_object": ("type", "schema"), "json_schema": ("type", "json_schema")}
JSON_SCHEMA_KEYS = ("name", "description", "schema", "strict")


@dataclass(frozen=True)
class Tools:
    """A request's declared tools (as the template renders them), which it may call (`choice`: "auto",
    "none", "required"; or `tool`, a named choice: that tool's name) and whether several calls at once
    (`parallel`)."""

    declared: list[Any]
    choice: str
    parallel: bool
    tool: str | None = None

    @property
    def callable(self) -> bool:
        """Whether the reply may hold calls (and is read for them: responses.Reply)."""
        return self.tool is not None or self.choice != "none"


def read_tools(body: dict[str, Any]) -> Tools | None:
    """The tools of a chat body, or None when it declares none. Each tool's own fields are checked where its
    grammar is compiled (grammar()), naming the field: tools[i].function.name, ...parameters."""
    declared, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel not in (None, True, False):
        raise APIError(400, "parallel_tool_calls: must be true or false", "parallel_tool_calls")
    try:
        declared = declared_tools(declared)
    except QwenNPError as bad:                   # its message names the field: tools[0].function.name: ...
        raise APIError(400, str(bad), "tools") from None
    if not declared:
        if choice not in (None, "none", "auto"):             # OpenAI's: a call needs a tool to call
            raise APIError(400, "tool_choice: calls a tool, but the request declares no tools", "tool_choice")
        return None
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise APIError(400, 'tool_choice: a named choice must be {"type": "function", "function": {"name": ...}}',
                           "tool_choice")
        return Tools(declared, "required", parallel is not False, tool=name)
    elif choice is None:
        choice = "auto"                                     # OpenAI's default when tools are present
    elif choice not in TOOL_CHOICES:
        raise APIError(400, f"tool_choice: must be one of {', '.join(TOOL_CHOICES)} or a named function, "
                            f"got {choice!r}", "tool_choice")
    return Tools(declared, choice, parallel is not False)


@dataclass(frozen=True)
class ResponseFormat:
    """A chat's response_format other than text: "json_object" (one JSON object), or "json_schema" and the
    schema its one JSON value must be valid against."""

    kind: str
    schema: Any = None
    where: str = "response_format.json_schema.schema"        # the field the schema came in, for its errors


def read_response_format(body: dict[str, Any], tools: Tools | None) -> ResponseFormat | None:
    """A chat body's response_format (None: text), refused beside tools the model may call, and beside `stop`
    or `stop_token_ids` wherever the reply is all value (response_format, tool_choice "required" or a named
    tool)."""
    response = _response_format(body)
    if response is not None:
        _refuse_stops(body, "response_format")
    elif tools is not None and (tools.tool is not None or tools.choice == "required"):
        _refuse_stops(body, "a named tool_choice" if tools.tool is not None else "tool_choice 'required'")
    return response


def grammar(tools: Tools | None, response: ResponseFormat | None, vocabulary: Vocabulary | None,
            thinking: bool) -> Grammar | None:
    """The grammar a chat reply follows (None: unconstrained): its tools' (a reply that may call them and
    has a response_format is that value or calls, as OpenAI's model answers with an agent's output type or
    calls its tools), else its response_format's (tools that cannot be called are in the prompt, and the
    grammar keeps <tool_call> out of the reply).
    thinking: the prompt lets the model think first (the grammar then allows the think block)."""
    if response is None and tools is None:
        return None
    calls = tools is not None and tools.callable
    field = "tools" if calls or response is None else "response_format"
    vocabulary = grammar_vocabulary(vocabulary, field)
    try:
        if calls or response is None:
            assert tools is not None
            answer = None if response is None else {"type": "object"} if response.kind == "json_object" else response.schema
            return tool_call_grammar(tools.declared, vocabulary, tools.choice, tool=tools.tool, parallel=tools.parallel,
                                     thinking=thinking, answer=answer)
        return (json_object_grammar(vocabulary, thinking=thinking) if response.kind == "json_object" else
                json_schema_grammar(response.schema, vocabulary, thinking=thinking, where=response.where))
    except QwenNPError as bad:        # its message names the field: tools[0].function.name: ..., tool_choice: ...
        message = str(bad)
        named = "tool_choice" if message.startswith("tool_choice") else "response_format" if message.startswith(
            "response_format") else field
        raise APIError(400, message, named) from None


def _refuse_stops(body: dict[str, Any], what: str) -> None:
    """A 400 naming `stop` or `stop_token_ids` when a reply that is all value (`what` asks for one) sets them:
    a stop could apply only inside the value, and would cut it."""
    for name in ("stop", "stop_token_ids"):
        if body.get(name) not in (None, "", []):
            raise APIError(400, f"{name}: cannot be combined with {what}: the reply is one value, which ends where "
                                "it is complete (a stop could only cut it)", name)


def grammar_vocabulary(vocabulary: Vocabulary | None, field: str) -> Vocabulary:
    """The server's grammar vocabulary for a request whose `field` asks for a grammar; a 400 naming the field
    when the server has none (llguidance is not installed)."""
    if vocabulary is None:
        raise APIError(400, f"{field}: needs constrained decoding, and the server lacks the llguidance package "
                            f"({INSTALL})", field)
    return vocabulary


def _response_format(body: dict[str, Any]) -> ResponseFormat | None:
    """A body's response_format, its form checked, every key of it read (one it does not know is refused by
    name, never ignored); None for text. json_object with a `schema` is llama.cpp's and vLLM's form of
    json_schema (instructor's JSON_SCHEMA mode sends it): held to the schema."""
    value = body.get("response_format")
    if value is None:
        return None
    kind = tagged(value, RESPONSE_KEYS, "response_format", '{"type": "text"}, {"type": "json_object"} or '
                                                           '{"type": "json_schema", "json_schema": {...}}')
    if kind == "text":
        return None
    if kind == "json_object":
        schema = value.get("schema")
        return ResponseFormat(kind) if schema is None else ResponseFormat("json_schema", schema, "response_format.schema")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or spec.get("strict") not in (None, True, False):
        raise APIError(400, "response_format.json_schema: must be an object with a name, a schema and optionally "
                            "strict (true or false)", "response_format")
    refuse_unknown(spec, JSON_SCHEMA_KEYS, "response_format.json_schema")
    return ResponseFormat(kind, spec.get("schema", True))       # no schema: any JSON value (JSON Schema's `true`)


def refuse_unknown(value: dict[str, Any], known: tuple[str, ...], where: str) -> None:
    """A 400 naming the first key of the object at `where` (response_format.json_schema, tools[0], ...) that is
    not among the keys it reads (`known`): no nested key of a body is silently ignored. Its param is the
    body's top-level field."""
    unknown = next((key for key in value if key not in known), None)
    if unknown is not None:
        raise APIError(400, f"{where}.{unknown}: not a field of {where} (it reads {', '.join(known)})",
                       field_of(where), "unknown_field")


def tagged(value: Any, kinds: dict[str, tuple[str, ...]], where: str, shapes: str) -> str:
    """The kind of the tagged object at `where` (its `type`: a key of `kinds`, text.format's, thinking's,
    response_format's ...), every key of it one that kind reads (refuse_unknown); a 400 saying the `shapes` it
    may take otherwise."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in kinds:
        raise APIError(400, f"{where}: must be {shapes}", field_of(where))
    refuse_unknown(value, kinds[kind], where)
    return kind


def field_of(where: str) -> str:
    """The body's top-level field a place in it (tools[0].function, response_format.json_schema) is under."""
    return where.split(".")[0].split("[")[0]
