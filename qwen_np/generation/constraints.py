"""Constrained decoding: which tokens a grammar allows next, so that a JSON answer or a tool call is valid
by construction rather than by luck.

Before each token is sampled, every token whose bytes would break the grammar is masked out: its logit
becomes -inf (core.sampling.apply_mask, the one place that happens, called from processed_logits, so
generate(), the batcher and speculative decoding all mask the same way). The grammar's state then
consumes the token that was chosen. A Grammar is compiled once (a JSON schema, `json_object`, a Lark or
GBNF grammar, or the declared tools of a tool call) and shared; each sequence has a Constraint of its
own, made by Grammar.constraint().

    allowed = constraint.allowed()            # bool [V]: the tokens the grammar allows next
    token = pick(processed_logits(logits, params, context, generated, allowed), params, rng)
    constraint.consume(token)

Speculative decoding needs no rollback here: generate.Continuation.verify judges the drafted tokens one
position at a time, masking each position with the grammar's state after the tokens kept before it, and
consumes only the tokens it keeps. A drafted token the grammar forbids has probability 0 under the
masked target distribution p, so the rejection rule rejects it (greedy: it is never the argmax) and the
target's own, allowed, token replaces it; the grammar never sees the drafted tokens past it.

Which engine, and why (the package index, compared on Qwen3's 151,669-token vocabulary, this machine):
* llguidance (MIT; a Rust core in abi3 wheels, no Python dependencies): JSON Schema with $ref, anyOf,
  oneOf, allOf, enum/const, string lengths and patterns, number bounds, and it refuses a keyword it does
  not implement by name; Lark-style context-free grammars with JSON Schema inside them (`%json {...}`),
  GBNF (llama.cpp's format) through its converter, regexes, and special tokens by name (<tool_call>).
  It computes each step's mask lazily (an Earley parser over a derivative-based lexer, walking the
  token trie), so a new schema costs no pass over the vocabulary: a matcher for a three-property schema
  was built in 9 ms, a step's mask took 0.01-0.3 ms (the first one up to 12 ms); it writes an int32
  bitmask NumPy reads directly. llama.cpp (--llguidance) and vLLM ("guidance") use it.
* outlines-core (Apache-2.0, Rust, no dependencies): regular languages only (a JSON schema becomes a
  regex: no recursive schemas, no grammars); it indexes the whole vocabulary per grammar up front: 2.0 s
  for the same schema, to be paid for every new schema a server receives.
* xgrammar (Apache-2.0): fast, but its wheel requires torch, transformers and triton (gigabytes), for a
  NumPy project.
* lm-format-enforcer (MIT): a pure-Python character-level parser walking a token trie, with pydantic,
  interegular and pyyaml; its per-step work over 151,936 tokens runs in Python.
* transformers-cfg (MIT): requires torch and transformers.

llguidance is optional (the `constraints` and `serve` extras): it is imported only when a grammar is
compiled, and a missing package is one clear error.

JSON is generated in one style: ", " between items and ": " after keys (Python's json.dumps, and what
Qwen3's chat template writes for tool calls), no other whitespace. A grammar that allows free
whitespace lets a model emit newlines forever inside an object (a known failure of small models under
vLLM, which added a switch to turn it off); this one cannot.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from ..errors import QwenNPError
from ..files.messages import tool_function
from ..files.tokenizer import THINK_CLOSE, THINK_OPEN, Tokenizer
from .tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

if TYPE_CHECKING:
    import llguidance

INSTALL = "pip install 'qwen_np[constraints]'"
# The JSON style of every schema (see the module's docstring): llguidance's per-schema options.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
TOOL_CHOICES = ("auto", "required", "none")
# An integer a schema leaves unbounded is held to 16 digits at most, as llama.cpp's schema converter holds it
# ([1-9][0-9]{0,15}): otherwise a small model may write a 60-digit integer, which the schema accepts and no
# program wants.
INTEGER_BOUND = 10 ** 16 - 1
# Where a schema holds subschemas: one (`items`), a list of them (`anyOf`), or a name -> subschema map.
ONE_SCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
              "unevaluatedItems", "unevaluatedProperties", "additionalItems")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


def _engine() -> Any:
    try:
        import llguidance
    except ImportError:
        raise QwenNPError(f"constrained decoding needs the llguidance package ({INSTALL})") from None
    return llguidance


class Vocabulary:
    """A tokenizer as the grammar engine reads it: the bytes of every token id of the model's vocabulary
    (padded past the tokenizer's: those ids have no bytes and are never allowed), and the ids that end a
    sequence, which the grammar allows only where it is complete. Special and added tokens (<|im_end|>,
    <think>, <tool_call>) are tokens of their own to the engine, never text: a grammar names them, and
    free text never contains them."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        _engine()                            # a missing package is said at once
        self.tokenizer, self.size = tokenizer, vocab_size
        self.ends = list(dict.fromkeys(int(i) for i in eos_token_ids)) or [tokenizer.eos_token_id]
        self._tokens: llguidance.LLTokenizer | None = None
        self._building = threading.Lock()     # a server's request threads may all ask for it at once

    @property
    def engine(self) -> llguidance.LLTokenizer:
        """The engine's tokenizer, built on first use and only once (it reads every token: about 1.6 s for
        Qwen3's, so a server pays it when a request first asks for a grammar, never at start or for requests
        without one, and a grammar's own errors are found first); a thread that asks while another builds it
        waits for that build. It reads the tokenizers JSON itself: no transformers."""
        with self._building:
            if self._tokens is None:
                self._tokens = _engine().LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.size,
                                                     eos_token=self.ends)
            return self._tokens

    def has_token(self, text: str) -> bool:
        return self.tokenizer.backend.token_to_id(text) is not None


# One Vocabulary per tokenizer, vocabulary size and end ids (its engine tokenizer is costly to build).
_VOCABULARIES: weakref.WeakKeyDictionary[Tokenizer, dict[tuple[int, tuple[int, ...]], Vocabulary]] = \
    weakref.WeakKeyDictionary()


_KNOWING = threading.Lock()                   # two threads asking at once get the one Vocabulary


def vocabulary(tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> Vocabulary:
    """The engine's view of `tokenizer` over a model's `vocab_size` ids, made once and kept while the
    tokenizer lives (its engine tokenizer is built on first use: Vocabulary.engine)."""
    key = (vocab_size, tuple(eos_token_ids))
    with _KNOWING:
        known = _VOCABULARIES.setdefault(tokenizer, {})
        if key not in known:
            known[key] = Vocabulary(tokenizer, vocab_size, eos_token_ids)
        return known[key]


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar over one Vocabulary, shared by every sequence that follows it. `source` is the
    engine's grammar (JSON text); `describe` says what it came from ("json_schema", "tool_calls:auto")."""

    vocabulary: Vocabulary
    source: str
    describe: str

    def constraint(self) -> Constraint:
        """A new sequence's state: at the start of the grammar."""
        return Constraint(self)


class Constraint:
    """One sequence's place in its grammar: `allowed()` gives the tokens that may come next, `consume(token)`
    moves past the chosen one, `done` says that nothing but the end of the sequence may follow, `accepting`
    that the sequence could end here (outside a value: where a stop may apply)."""

    def __init__(self, grammar: Grammar) -> None:
        llg = _engine()
        self.grammar = grammar
        self._matcher: llguidance.LLMatcher = llg.LLMatcher(grammar.vocabulary.engine, grammar.source, log_level=0)
        self._check(grammar.describe)
        size = grammar.vocabulary.size
        self._bitmask = np.full((1, (size + 31) // 32), -1, dtype=np.int32)   # bit j of word w: token 32w + j
        self._allowed: np.ndarray | None = None      # this place's mask, once computed (accepting asks for it too)

    @property
    def ends(self) -> list[int]:
        """The ids that end the sequence, which the grammar allows only where it could end."""
        return self.grammar.vocabulary.ends

    def allowed(self) -> np.ndarray:
        """The tokens the grammar allows next, as bool [V] (computed once per place: do not write to it)."""
        if self._allowed is None:
            self._allowed = self._mask()
        return self._allowed

    @property
    def accepting(self) -> bool:
        """Whether the sequence could end here: the grammar is complete, or allows an end id next."""
        return self.done or bool(self.allowed()[self.ends].any())

    def _mask(self) -> np.ndarray:
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self._matcher, self._bitmask)
        self._check("grammar")
        # On a little-endian machine (x86, ARM) the int32 words' bytes come lowest first, so unpacking each
        # byte's bits lowest first gives token 0, 1, 2, ... in order.
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[:self.grammar.vocabulary.size]
        allowed = bits.view(np.bool_)
        allowed.flags.writeable = False               # shared by every use of this place's mask
        if not allowed.any():
            raise QwenNPError(f"{self.grammar.describe}: the grammar allows no next token")
        return allowed

    def consume(self, token: int) -> None:
        """Move past the chosen token; raises if the grammar forbids it (a bug: it was masked out)."""
        self._allowed = None
        if not self._matcher.consume_token(int(token)):
            raise QwenNPError(f"{self.grammar.describe}: token {token} breaks the grammar "
                              f"({_first_line(self._matcher.get_error())})")

    @property
    def done(self) -> bool:
        """Whether the grammar is complete and only an end-of-sequence token may follow."""
        return self._matcher.is_stopped()

    def _check(self, where: str) -> None:
        if self._matcher.is_error():
            raise QwenNPError(f"{where}: {_first_line(self._matcher.get_error())}")


# --- Grammars ---------------------------------------------------------------------------------------

# Qwen3's thinking: a reply may open with <think> ... </think> (free text, no special tokens inside:
# so no tool call can hide in the reasoning) and the newlines after it; the constrained part follows.
THINKING_RULES = f"thinking: {THINK_OPEN} THINK {THINK_CLOSE} \"\\n\"*\nTHINK: /(.|\\n)*/\n"


def json_schema_grammar(schema: Any, vocab: Vocabulary, *, thinking: bool = False,
                        where: str = "json_schema") -> Grammar:
    """Replies that are one JSON value valid against `schema` (a dict, or its JSON text). thinking: the reply
    may open with a Qwen3 think block (the prompt asked the model to think). A keyword the engine does not
    implement raises QwenNPError naming it, `where` naming the parameter."""
    checked = _checked_schema(schema, where)
    return _with_thinking(f"%json {json.dumps(checked)}", [], vocab, thinking, "json_schema")


def json_object_grammar(vocab: Vocabulary, *, thinking: bool = False) -> Grammar:
    """Replies that are one JSON object, any object (OpenAI's response_format `json_object`)."""
    return json_schema_grammar({"type": "object"}, vocab, thinking=thinking, where="json_object")


def text_grammar(text: str, vocab: Vocabulary, *, thinking: bool = False, where: str = "grammar") -> Grammar:
    """Replies in the language of a Lark grammar (llguidance's dialect: `start: ...`) or a GBNF grammar
    (llama.cpp's: `root ::= ...`), whichever `text` is."""
    from llguidance.gbnf_to_lark import any_to_lark

    llg = _engine()
    try:
        lark = any_to_lark(text)
    except Exception as bad:              # the converter raises plain exceptions for syntax errors
        raise QwenNPError(f"{where}: not a valid GBNF grammar ({_first_line(str(bad))})") from None
    _validate(llg.LLMatcher.grammar_from_lark(lark), vocab.engine, where)
    return _with_thinking("@user", [{"name": "user", "lark_grammar": lark}], vocab, thinking, "grammar")


def tool_call_grammar(tools: Sequence[Any], vocab: Vocabulary, choice: str = "auto", *, tool: str | None = None,
                      parallel: bool = True, thinking: bool = False, answer: Any = None) -> Grammar:
    """Replies whose tool calls are Qwen3's, each valid against its tool's declared parameters:

        <tool_call>\\n{"name": "NAME", "arguments": {...}}\\n</tool_call>

    tools: OpenAI's [{"type": "function", "function": {"name", "parameters"}}, ...]. choice "auto": free text
    with calls anywhere in it (llama.cpp's "lazy" grammar: unconstrained until the model opens <tool_call>,
    then held to the declared tools until </tool_call>); "required": only calls, at least one; "none": free
    text and no call (OpenAI's "the model will not call a tool": the tools stay in the prompt, so the model
    knows them, but <tool_call> is never allowed). tool: a declared tool's name, one call of that tool
    (OpenAI's named choice, whatever the name: a tool may be called "auto"); a choice that is not one of
    the three is read as a tool's name too. parallel False: at most one call. answer: a JSON schema the reply
    is held to when it does not call (OpenAI's response_format beside tools, as the openai-agents SDK sends
    an agent's output_type with its tools): with "auto" the reply is that one value or calls, never free
    text; with "required" or a named tool it is calls, as without it."""
    calls = _tool_alternatives(tools)
    named = tool if tool is not None else None if choice in TOOL_CHOICES else choice
    if named is not None and named not in calls:
        raise QwenNPError(f"tool_choice: must be 'auto', 'required', 'none' or the name of a declared tool, "
                          f"got {named!r}")
    for token in (TOOL_CALL_OPEN, TOOL_CALL_CLOSE):
        if not vocab.has_token(token):
            raise QwenNPError(f"tools: this tokenizer has no {token} token (the model was not trained to call tools)")
    chosen = calls if named is None else {named: calls[named]}
    rules = [f"call: {TOOL_CALL_OPEN} \"\\n\" ({' | '.join(f'call_{i}' for i in range(len(chosen)))}) \"\\n\" {TOOL_CALL_CLOSE}"]
    rules += [f"call_{i}: {rule}" for i, rule in enumerate(chosen.values())]
    mode = "named" if named is not None else choice
    calls_only = "call (\"\\n\" call)*" if parallel and mode != "named" else "call"
    if answer is not None and mode == "auto":
        schema = _checked_schema(answer, "response_format")
        body = f"answer | {calls_only}"
        rules.append(f"answer: %json {json.dumps(schema)}")
    elif mode in ("auto", "none"):
        body = "TEXT" if mode == "none" else "TEXT (call TEXT)*" if parallel else "TEXT (call TEXT)?"
        rules.append("TEXT: /(.|\\n)*/")          # text holds no special token: <tool_call> opens only a call
    else:
        body = calls_only
    return _with_thinking(body, [], vocab, thinking, f"tool_calls:{mode}", extra_rules="\n".join(rules) + "\n")


def _tool_alternatives(tools: Sequence[Any]) -> dict[str, str]:
    """Each declared tool's name -> the Lark rule of its call's JSON: its name, then arguments valid against
    its parameters (a tool without parameters takes {}). Every field is checked, named as in the request."""
    if not isinstance(tools, (list, tuple)) or not tools:
        raise QwenNPError("tools: must be a non-empty list of tools")
    alternatives: dict[str, str] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        function = tool_function(tool, i)
        name = function["name"]
        if name in alternatives:
            raise QwenNPError(f"{where}.function.name: {name!r} is declared twice")
        parameters = function.get("parameters", {"type": "object", "properties": {}, "additionalProperties": False})
        schema = _checked_schema(parameters, f"{where}.function.parameters")
        # The name as fixed text and the arguments as their own schema (not nested in a wrapper schema,
        # where their "#/$defs/..." references would no longer point at their own root).
        head = json.dumps(f'{{"name": {json.dumps(name)}, "arguments": ')
        alternatives[name] = f"{head} %json {json.dumps(schema)} \"}}\""
    return alternatives


def closed(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` as the grammar holds a reply to it: every object that lists its properties closed
    (additionalProperties false) unless the schema says otherwise, and every unbounded integer bounded
    (INTEGER_BOUND), as llama.cpp's schema converter and XGrammar's strict mode read a schema. Without it a
    model may open a new key forever where the schema (a pydantic model's, instructor's, langchain's tools)
    only forgot to say "no other keys". What the grammar allows still validates against the schema as given:
    it leaves out only what the schema allows but does not describe. An object beside allOf or $ref, inside
    allOf, or a definition allOf refers to stays open: its keys and the other branches' combine, and closing
    one would forbid the rest. Returns a copy."""
    copy = json.loads(json.dumps(schema))
    nodes = _subschemas(copy)
    combined = {branch.get("$ref") for node, _ in nodes if isinstance(node.get("allOf"), list)
                for branch in node["allOf"] if isinstance(branch, dict)}        # definitions allOf combines
    for node, where in nodes:
        opened = {"additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "$ref"} & node.keys()
        if "properties" in node and not opened and where != "allOf" and where not in combined:
            node["additionalProperties"] = False
        kind = node.get("type")
        types: list[Any] = kind if isinstance(kind, list) else [kind]
        if "integer" in types and "number" not in types and not {"enum", "const"} & node.keys():
            if not {"minimum", "exclusiveMinimum"} & node.keys():
                node["minimum"] = -INTEGER_BOUND
            if not {"maximum", "exclusiveMaximum"} & node.keys():
                node["maximum"] = INTEGER_BOUND
    return copy


def _subschemas(schema: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
    """Every subschema of `schema` (itself included: the places ONE_SCHEMA, SCHEMA_LISTS and SCHEMA_MAPS name)
    with where it sits: "allOf" for a branch of one, its reference ("#/$defs/Name") for a definition of the
    root, "" otherwise. A stack, not recursion, however deep the nesting."""
    found: list[tuple[dict[str, Any], str]] = []
    pending: list[tuple[Any, str]] = [(schema, "")]
    while pending:
        node, where = pending.pop()
        if not isinstance(node, dict):
            continue
        found.append((node, where))
        pending += [(node.get(key), "") for key in ONE_SCHEMA]
        pending += [(branch, key if key == "allOf" else "") for key in SCHEMA_LISTS if isinstance(node.get(key), list)
                    for branch in node[key]]
        pending += [(sub, f"#/{key}/{name}" if node is schema else "") for key in SCHEMA_MAPS
                    if isinstance(node.get(key), dict) for name, sub in node[key].items()]
    return found


def _checked_schema(schema: Any, where: str) -> dict[str, Any]:
    """`schema` as a dict with the JSON style set, after the engine has compiled it on its own (so that an
    error names the schema's problem, not a place in a composed grammar)."""
    llg = _engine()
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as bad:
            raise QwenNPError(f"{where}: not valid JSON ({bad})") from None
    if schema is True:                    # JSON Schema's "anything"
        schema = {}
    if not isinstance(schema, dict):
        raise QwenNPError(f"{where}: a JSON schema must be an object, got {type(schema).__name__}")
    styled = {**closed(schema), "x-guidance": JSON_STYLE}
    _validate(llg.LLMatcher.grammar_from_json_schema(styled), None, where)     # no tokens needed to check it
    return styled


def _with_thinking(body: str, side: list[dict[str, str]], vocab: Vocabulary, thinking: bool, describe: str,
                   extra_rules: str = "") -> Grammar:
    """The grammar `start: [thinking] body`, with its extra Lark rules and side grammars (referenced as @name)."""
    llg = _engine()
    thinking = thinking and vocab.has_token(THINK_OPEN) and vocab.has_token(THINK_CLOSE)
    lark = f"start: {'thinking? ' if thinking else ''}{body}\n{THINKING_RULES if thinking else ''}{extra_rules}"
    source = (json.dumps({"grammars": [{"name": "reply", "lark_grammar": lark}, *side]}) if side
              else llg.LLMatcher.grammar_from_lark(lark))
    _validate(source, vocab.engine, describe)
    return Grammar(vocab, source, describe)


def _validate(source: str, tokens: llguidance.LLTokenizer | None, where: str) -> None:
    """Raise QwenNPError (naming `where`) if the engine cannot compile `source` (over `tokens`, when the
    grammar names special tokens)."""
    failed, messages = _engine().LLMatcher.validate_grammar_with_warnings(source, tokens)
    if failed:
        raise QwenNPError(f"{where}: {_readable(messages[0])}")


def _readable(message: str) -> str:
    """The engine's error in one line; an unimplemented JSON Schema keyword said as such."""
    keys = re.search(r"Unimplemented keys: \[([^\]]*)\]", message)
    if keys:
        return f"unsupported JSON Schema keyword {keys[1]}"
    return _first_line(re.sub(r"^at \d+\(\d+\): ", "", message))


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "unknown error"
