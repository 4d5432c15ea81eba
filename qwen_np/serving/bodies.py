"""A request body read once: its JSON object parsed within limits (parse_body), its fields checked against
one catalogue (check_fields), and each endpoint's fields read into a frozen object (ChatBody, CompletionBody,
EmbeddingBody, RerankBody) that the app, requests.Service, choices, embeddings and rerank read; nothing after this module looks
at the JSON again. Every field is checked as it is read: a 400 names it otherwise.

The request fields are OpenAI's (its API reference for chat completions and completions); Qwen3's
thinking switch comes as vLLM takes it, `chat_template_kwargs: {"enable_thinking": false}`, and the
sampling fields vLLM adds (top_k, min_p, repetition_penalty) are accepted too, as are vLLM's
stop_token_ids, ignore_eos and min_tokens (generate.Ending). Every field is in one catalogue
(REQUEST_FIELDS, IGNORED, UNSUPPORTED; README lists it): a field that is not is refused by name, so that
no client gets a silently different answer than it asked for.

One request cannot hurt another: every string's length is bounded, every integer's digits, and a prompt
that cannot fit the context is refused by what it costs at least (its characters, and the template's
tokens for each message) before anything renders or tokenises it (Limits: what the server allows). What
needs the prompt's tokens (the room left for max_tokens) or the model (the sampling settings resolved
against the checkpoint's defaults, a grammar compiled) is requests.Service's, after this.

Imports structured.py of serving/ (and files/ below it).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from ..errors import APIError
from ..files.messages import MessageError, chat_message
from ..generation.logprobs import MAX_TOP_LOGPROBS
from ..generation.thinking import EFFORT_BUDGETS
from .structured import ResponseFormat, Tools, read_response_format, read_tools

# The request fields, one catalogue (README's "Request fields" shows it; a test holds the two together):
# what each endpoint reads, what every endpoint reads and leaves alone (it changes no answer), and what it
# refuses unless "off". Any other field is refused by name.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "seed")
GENERATION_FIELDS = ("model", "stream", "stream_options", "n", "max_tokens", "max_completion_tokens", *SAMPLING_FIELDS,
                     "frequency_penalty", "logit_bias", "logprobs", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
                     "thinking_budget")
REQUEST_FIELDS = {"/v1/chat/completions": ("messages", "chat_template_kwargs", "tools", "tool_choice",
                                           "parallel_tool_calls", "response_format", "top_logprobs",
                                           "reasoning_effort", *GENERATION_FIELDS),
                  "/v1/completions": ("prompt", "parse_special_tokens", "echo", "best_of", *GENERATION_FIELDS),
                  "/v1/responses": ("model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls",
                                    "text", "max_output_tokens", "temperature", "top_p", "reasoning", "stream",
                                    "store", "previous_response_id", "include", "truncation"),
                  "/v1/embeddings": ("model", "input", "encoding_format", "dimensions"),
                  "/v1/rerank": ("model", "query", "documents", "top_n", "return_documents", "instruction"),
                  "/tokenize": ("model", "prompt", "content", "messages", "chat_template_kwargs", "tools",
                                "add_generation_prompt", "with_pieces"),
                  "/detokenize": ("model", "tokens"),
                  # Anthropic's Messages API (messages.py reads these into a ChatBody)
                  "/v1/messages": ("model", "max_tokens", "messages", "system", "tools", "tool_choice", "stop_sequences",
                                   "temperature", "top_p", "top_k", "stream", "thinking", "cache_control"),
                  "/v1/messages/count_tokens": ("model", "messages", "system", "tools", "tool_choice", "thinking",
                                                "cache_control"),
                  "/explorer/": ("model", "prompt", "parse_special_tokens", "layer", *SAMPLING_FIELDS)}
IGNORED = ("user", "metadata", "service_tier")
# Not implemented: refused when set to anything but their "off" value. (functions and function_call: OpenAI's
# deprecated names for tools and tool_choice; vLLM's guided_* : response_format says it.)
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": (None, []), "function_call": (None, "none"), "guided_json": (None,), "guided_regex": (None,),
    "guided_choice": (None,), "guided_grammar": (None,),
    "suffix": (None, ""),
    "store": (None, False), "prediction": (None,), "audio": (None,), "modalities": (None, ["text"]),
    "web_search_options": (None,)}
# Why a refused field cannot be served, where that is the model's doing rather than this server's.
UNSUPPORTED_WHY = {"suffix": "Qwen3 was not trained for fill-in-the-middle (it has no FIM tokens), so no text can be "
                             "generated to fit before a suffix"}
# OpenAI's limit on stop strings, and a bound on each: stop strings are matched against the text at
# every token, in time that grows with their number and the square of their length.
MAX_STOPS, MAX_STOP_CHARS = 4, 256
MAX_STOP_TOKEN_IDS = 256
# An integer's digits at most: Python's own limit on parsing them (sys.int_info.default_max_str_digits); a
# longer one is refused naming its field, not parsed into a ValueError.
MAX_INT_DIGITS = 4300
# How a lone surrogate (\ud800), which no UTF-8 text (tokenizer, reply, log) can hold, gets into a UTF-8
# body: escaped, or encoded as its three bytes (json.loads decodes with surrogatepass). A body with neither
# (nor an integer too long) is not walked string by string: 250,000 messages would take seconds.
SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
MAX_INPUTS = 2048                    # OpenAI's limit on embedding inputs in one request
ENCODINGS = ("float", "base64")


@dataclass(frozen=True)
class Limits:
    """What reading a body needs of the server (requests.Service.limits): the token ids a field may name
    (vocab: the tokenizer's), the context, a token's most characters (chars_per_token) and the template's
    fewest tokens a message (message_tokens), the batch's rows (n, best_of) and whether it can chat at all."""

    vocab: int
    context: int
    chars_per_token: int
    message_tokens: int
    rows: int
    chat_template: bool


@dataclass(frozen=True)
class Sampling:
    """The sampling settings a body sets (None: not given, the checkpoint's default then applies); top_k 0 is
    off (a client's -1, vLLM's), logit_bias keyed by token id."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, Any] | None = None
    seed: int | None = None


@dataclass(frozen=True, kw_only=True)
class GenerationBody:
    """What a chat and a completion body both set: the model asked for (None: the base), streaming, how many
    tokens (max_tokens, None: what fits), the sampling settings, the stops and vLLM's ending fields, how
    many top log-probabilities each token reports (None: none), and n choices of best_of candidates."""

    model: str | None
    stream: bool
    include_usage: bool
    max_tokens: int | None
    sampling: Sampling
    stops: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    min_tokens: int
    logprobs: int | None
    n: int
    best_of: int
    thinking_budget: int | None          # the thinking's most tokens (generation/thinking.py; None: unbounded)


@dataclass(frozen=True)
class Conversation:
    """A body's messages as the template reads them (files/messages.chat_message), its thinking switch
    (chat_template_kwargs.enable_thinking; None: the template's default) and its tools (structured.py)."""

    messages: tuple[dict[str, Any], ...]
    thinking: bool | None
    tools: Tools | None


@dataclass(frozen=True, kw_only=True)
class ChatBody(GenerationBody):
    """A /v1/chat/completions body: its messages as the template reads them (files/messages.chat_message),
    the thinking switch, its tools and response_format (structured.py)."""

    messages: tuple[dict[str, Any], ...]
    thinking: bool | None
    tools: Tools | None
    response_format: ResponseFormat | None

    @property
    def calls(self) -> bool:
        """Whether the reply may hold tool calls (and is read for them)."""
        return self.tools is not None and self.tools.callable


@dataclass(frozen=True, kw_only=True)
class CompletionBody(GenerationBody):
    """A /v1/completions body: its prompt (a text, special tokens parsed unless parse_special is False, or
    token ids), whether it is echoed, and scores_only: an echo that generates nothing (max_tokens 0), read
    as a one-token request so that its prompt is checked as any other."""

    prompt: str | tuple[int, ...]
    parse_special: bool
    echo: bool
    scores_only: bool


@dataclass(frozen=True)
class EmbeddingBody:
    """A /v1/embeddings body: the model asked for, its inputs (texts, or one list of token ids, or lists of
    them: as generation.embedding.input_ids reads them), the dimensions kept (None: all) and whether the
    vectors come as base64."""

    model: str | None
    inputs: tuple[Any, ...]
    dimensions: int | None
    base64: bool


@dataclass(frozen=True)
class RerankBody:
    """A /v1/rerank body (Jina's and Cohere's shape, as llama-server and vLLM take it): the model asked for, the
    query, the documents, how many of the best to return (top_n: all when None), whether with their text, and
    the task's instruction (Qwen3-Reranker's; generation/rerank.DEFAULT_INSTRUCTION when None)."""

    model: str | None
    query: str
    documents: tuple[str, ...]
    top_n: int | None
    return_documents: bool
    instruction: str | None


@dataclass(frozen=True)
class TokenizeBody:
    """A /tokenize body, vLLM's or llama-server's: a text (`prompt`, or llama-server's `content`: special
    tokens parsed, as a completion's prompt) or a conversation rendered by the template (with its
    generation prompt unless add_generation_prompt is false); with_pieces: each id with its text."""

    model: str | None
    text: str | None
    conversation: Conversation | None
    add_generation_prompt: bool
    with_pieces: bool


def is_token_id(value: Any, vocab: int) -> bool:
    """The one rule of every field that takes token ids (a prompt's, logit_bias's keys, stop_token_ids, an
    embedding's input): an integer in [0, vocab), vocab the tokenizer's (Limits.vocab). bool is an int in
    Python, and no id. The model's embedding table may have more rows (Qwen3 pads its 151,669 ids to 151,936,
    a multiple of 128): no text has those, they decode to nothing, and no field takes them."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab


def too_long(context: int, field: str, why: str) -> APIError:
    """OpenAI's refusal of a prompt that cannot fit the context, naming its field (messages or prompt)."""
    return APIError(400, f"This model's maximum context length is {context} tokens. {why} Please reduce the "
                         "length of the messages or completion.", field, "context_length_exceeded")


def input_too_long(context: int, index: int, what: str) -> APIError:
    """The refusal of an embedding input that cannot fit the context (`what` it holds: characters or tokens)."""
    return APIError(400, f"input[{index}]: {what}; this model's maximum context length is {context} tokens",
                    "input", "context_length_exceeded")


def read_conversation(fields: dict[str, Any], limits: Limits) -> Conversation:
    """A body's messages, thinking switch and tools, read and checked: the messages refused by what they cost at
    least before each is read (250,000 empty messages: refused unread) and again by their characters once read."""
    if not limits.chat_template:
        raise APIError(400, "this model has no chat template, so it cannot chat: use /v1/completions, which "
                            "continues text", "messages", "no_chat_template")
    messages = fields.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages: must be a non-empty list of messages", "messages")
    kwargs = fields.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict) or set(kwargs) - {"enable_thinking"}:
        raise APIError(400, "chat_template_kwargs: only {\"enable_thinking\": true|false} is supported",
                       "chat_template_kwargs")
    thinking = kwargs.get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise APIError(400, "chat_template_kwargs.enable_thinking: must be true or false", "chat_template_kwargs")
    _check_length(limits, "messages", [], len(messages))
    try:
        chat = tuple(chat_message(m, i) for i, m in enumerate(messages))     # files/messages.py: the one rule
    except MessageError as bad:
        raise APIError(400, str(bad), "messages", bad.code) from None
    tools = read_tools(fields)
    texts = [text for m in chat for text in (m["content"], m.get("reasoning_content")) if text]
    texts += [json.dumps(call["function"]) for m in chat for call in m.get("tool_calls", [])]
    _check_length(limits, "messages", texts + ([json.dumps(tools.declared)] if tools else []), len(chat))
    return Conversation(chat, thinking, tools)


def read_chat(fields: dict[str, Any], limits: Limits) -> ChatBody:
    """A chat body's fields read and checked (its conversation: read_conversation)."""
    conversation = read_conversation(fields, limits)
    common = _generation(fields, limits, chat=True)
    effort = fields.get("reasoning_effort")
    if effort is not None:
        if effort not in EFFORT_BUDGETS:
            raise APIError(400, f"reasoning_effort: must be one of {', '.join(EFFORT_BUDGETS)}, got {effort!r}",
                           "reasoning_effort")
        if common["thinking_budget"] is not None:
            raise APIError(400, "reasoning_effort: cannot be combined with thinking_budget (each sets the budget)",
                           "reasoning_effort")
        common["thinking_budget"] = EFFORT_BUDGETS[effort]
    return ChatBody(**common, messages=conversation.messages, thinking=conversation.thinking, tools=conversation.tools,
                    response_format=read_response_format(fields, conversation.tools))


def read_completion(fields: dict[str, Any], limits: Limits) -> CompletionBody:
    """A completion body's fields read and checked (the explorer's too: it reads a completion's prompt and
    sampling settings); a text prompt refused by its characters before it is tokenised."""
    parse = fields.get("parse_special_tokens", True)
    if parse not in (True, False):
        raise APIError(400, "parse_special_tokens: must be true or false", "parse_special_tokens")
    prompt = fields.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                                      # a batch of one prompt, out of its list
    if isinstance(prompt, str) and prompt:
        _check_length(limits, "prompt", [prompt])
        sent: str | tuple[int, ...] = prompt
    elif isinstance(prompt, list) and prompt and all(is_token_id(t, limits.vocab) for t in prompt):
        sent = tuple(prompt)                                    # token ids
    else:
        raise APIError(400, f"prompt: must be a non-empty string or list of token ids in [0, {limits.vocab}) (one "
                            "prompt per request)", "prompt")
    echo = fields.get("echo")
    if echo not in (None, True, False):
        raise APIError(400, "echo: must be true or false", "echo")
    tokens = fields.get("max_tokens")
    scores_only = bool(echo) and type(tokens) is int and tokens == 0 and fields.get("max_completion_tokens") is None
    common = _generation({**fields, "max_tokens": 1} if scores_only else fields, limits, chat=False)
    return CompletionBody(**common, prompt=sent, parse_special=parse, echo=bool(echo), scores_only=scores_only)


def read_embedding(fields: dict[str, Any], limits: Limits) -> EmbeddingBody:
    """An embeddings body's fields read and checked: at most MAX_INPUTS inputs, a text refused by its
    characters when no context could hold it (its tokens are counted when tokenised: embeddings.py)."""
    if fields.get("encoding_format", "float") not in ENCODINGS:
        raise APIError(400, f"encoding_format: must be one of {', '.join(ENCODINGS)}", "encoding_format")
    inputs = fields.get("input")
    items = [inputs] if isinstance(inputs, str) else inputs
    if not isinstance(items, list) or not items:
        raise APIError(400, "input: must be a text, a list of texts, a list of token ids or a list of such lists",
                       "input")
    count = 1 if all(isinstance(t, int) and not isinstance(t, bool) for t in items) else len(items)   # ids: one
    if count > MAX_INPUTS:
        raise APIError(400, f"input: {count} inputs, more than {MAX_INPUTS} in one request", "input")
    longest = limits.context * limits.chars_per_token            # a text longer cannot fit the context
    for i, item in enumerate(items):
        if isinstance(item, str) and len(item) > longest:
            raise input_too_long(limits.context, i, f"{len(item)} characters, more than any {limits.context} "
                                                    "tokens can hold")
    dimensions = fields.get("dimensions")
    if dimensions is not None and (not isinstance(dimensions, int) or isinstance(dimensions, bool)):
        raise APIError(400, f"dimensions: must be an integer, got {dimensions!r}", "dimensions")
    return EmbeddingBody(fields.get("model"), tuple(items), dimensions, fields.get("encoding_format") == "base64")


def read_rerank(fields: dict[str, Any], limits: Limits) -> RerankBody:
    """A rerank body's fields read and checked: a query and at most MAX_INPUTS documents, each pair refused by
    its characters when no context could hold it (its tokens are counted when tokenised: rerank.py)."""
    query, documents, instruction = fields.get("query"), fields.get("documents"), fields.get("instruction")
    if not isinstance(query, str) or not query:
        raise APIError(400, "query: must be a non-empty text", "query")
    if (not isinstance(documents, list) or not documents or len(documents) > MAX_INPUTS
            or not all(isinstance(document, str) for document in documents)):
        raise APIError(400, f"documents: must be a list of 1 to {MAX_INPUTS} texts", "documents")
    if instruction is not None and (not isinstance(instruction, str) or not instruction):
        raise APIError(400, "instruction: must be a non-empty text", "instruction")
    longest = limits.context * limits.chars_per_token            # a pair longer cannot fit the context
    for i, document in enumerate(documents):
        if len(query) + len(document) + len(instruction or "") > longest:
            raise APIError(400, f"documents[{i}]: with the query, more characters than any {limits.context} tokens "
                                f"can hold; this model's maximum context length is {limits.context} tokens",
                           "documents", "context_length_exceeded")
    returned = fields.get("return_documents", True)
    if returned not in (True, False):
        raise APIError(400, "return_documents: must be true or false", "return_documents")
    return RerankBody(fields.get("model"), query, tuple(documents), number(fields, "top_n", int, 1), returned,
                      instruction)


def read_tokenize(fields: dict[str, Any], limits: Limits) -> TokenizeBody:
    """A /tokenize body read and checked: one of prompt, content and messages."""
    given = [name for name in ("prompt", "content", "messages") if fields.get(name) is not None]
    if len(given) != 1:
        raise APIError(400, "prompt: give one of prompt (or llama-server's content), a text, and messages",
                       given[1] if len(given) > 1 else "prompt")
    flags = {name: fields.get(name, name == "add_generation_prompt") for name in ("add_generation_prompt", "with_pieces")}
    for name, value in flags.items():
        if value not in (True, False):
            raise APIError(400, f"{name}: must be true or false", name)
    text = fields.get(given[0]) if given[0] != "messages" else None
    if text is not None:
        if not isinstance(text, str):
            raise APIError(400, f"{given[0]}: must be a text", given[0])
        _check_length(limits, given[0], [text])
    conversation = read_conversation(fields, limits) if given[0] == "messages" else None
    return TokenizeBody(fields.get("model"), text, conversation, flags["add_generation_prompt"], flags["with_pieces"])


def read_token_ids(fields: dict[str, Any], limits: Limits) -> list[int]:
    """A /detokenize body's `tokens`: token ids of the tokenizer's."""
    tokens = fields.get("tokens")
    if not isinstance(tokens, list) or not all(is_token_id(t, limits.vocab) for t in tokens):
        raise APIError(400, f"tokens: must be a list of token ids in [0, {limits.vocab})", "tokens")
    if len(tokens) > limits.context:
        raise APIError(400, f"tokens: {len(tokens)} ids, more than the {limits.context}-token context", "tokens")
    return tokens


def _generation(fields: dict[str, Any], limits: Limits, chat: bool) -> dict[str, Any]:
    """GenerationBody's fields of a chat or completion body, checked."""
    top_k = number(fields, "top_k", int, -1)
    sampling = Sampling(temperature=number(fields, "temperature", float, 0, 2),
                        top_p=number(fields, "top_p", float, 0, 1), top_k=0 if top_k == -1 else top_k,
                        min_p=number(fields, "min_p", float, 0, 1),
                        repetition_penalty=number(fields, "repetition_penalty", float, 0),
                        presence_penalty=number(fields, "presence_penalty", float, -2, 2),
                        frequency_penalty=number(fields, "frequency_penalty", float, -2, 2),
                        logit_bias=_logit_bias(fields, limits.vocab), seed=number(fields, "seed", int, 0))
    if sampling.top_p == 0:
        raise APIError(400, "top_p: must be in (0, 1]", "top_p")
    n = number(fields, "n", int, 1, limits.rows) or 1
    best_of = n if chat else number(fields, "best_of", int, 1, limits.rows) or n
    if best_of < n:
        raise APIError(400, f"best_of: must be at least n ({n}), got {best_of}", "best_of")
    stream = bool(fields.get("stream"))                  # parse_body checked it is a bool, and stream_options
    if best_of > n and stream:
        raise APIError(400, "best_of: cannot be used with stream (the best candidates are known only at the end)",
                       "best_of")
    ignore_eos = fields.get("ignore_eos")
    if ignore_eos not in (None, True, False):
        raise APIError(400, "ignore_eos: must be true or false", "ignore_eos")
    return {"model": fields.get("model"), "stream": stream,
            "include_usage": bool((fields.get("stream_options") or {}).get("include_usage")),
            "max_tokens": number(fields, "max_completion_tokens", int, 1) or number(fields, "max_tokens", int, 1),
            "sampling": sampling, "stops": _stops(fields), "stop_token_ids": _stop_token_ids(fields, limits.vocab),
            "ignore_eos": bool(ignore_eos), "min_tokens": number(fields, "min_tokens", int, 0) or 0,
            "logprobs": _logprobs(fields, chat), "n": n, "best_of": best_of,
            "thinking_budget": number(fields, "thinking_budget", int, 0)}


def in_range(name: str, value: Any, kind: type, low: float, high: float | None = None) -> Any:
    """`value` of field `name` (None stays None), checked to be a `kind` in [low, high]."""
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (kind is float or isinstance(value, int))
    if not ok or not low <= value <= (high if high is not None else float("inf")):
        rule = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise APIError(400, f"{name}: must be {'an integer' if kind is int else 'a number'} {rule}, got {value!r}", name)
    return kind(value)


def number(fields: dict[str, Any], name: str, kind: type, low: float, high: float | None = None) -> Any:
    """fields[name] (None when absent or null), checked to be a `kind` in [low, high]."""
    return in_range(name, fields.get(name), kind, low, high)


def _logit_bias(fields: dict[str, Any], vocab: int) -> dict[int, Any] | None:
    """OpenAI's logit_bias, {"token id": bias} (JSON keys are strings), keyed by the model's token ids; the
    biases are SamplingParams' to check (numbers in [-100, 100])."""
    bias = fields.get("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise APIError(400, 'logit_bias: must be an object of token ids and biases, {"198": -100}', "logit_bias")
    for key in bias:           # digits first: int() would take " 1", "+1", "1_0" and thousands of digits
        if not (key.isascii() and key.isdigit() and len(key) <= len(str(vocab)) and is_token_id(int(key), vocab)):
            raise APIError(400, f"logit_bias: keys must be token ids in [0, {vocab}), got {key!r}", "logit_bias")
    return {int(key): value for key, value in bias.items()}


def _stop_token_ids(fields: dict[str, Any], vocab: int) -> tuple[int, ...]:
    """vLLM's stop_token_ids: at most MAX_STOP_TOKEN_IDS token ids."""
    ids = fields.get("stop_token_ids")
    if ids is not None and (not isinstance(ids, list) or len(ids) > MAX_STOP_TOKEN_IDS
                            or not all(is_token_id(t, vocab) for t in ids)):
        raise APIError(400, f"stop_token_ids: must be a list of at most {MAX_STOP_TOKEN_IDS} token ids in "
                            f"[0, {vocab})", "stop_token_ids")
    return tuple(ids or ())


def _logprobs(fields: dict[str, Any], chat: bool) -> int | None:
    """How many top log-probabilities each token reports (None: no log-probabilities): a chat's `logprobs`
    is a switch and `top_logprobs` the count, a completion's `logprobs` the count (OpenAI's legacy field)."""
    if not chat:
        return number(fields, "logprobs", int, 0, MAX_TOP_LOGPROBS)
    switch, top = fields.get("logprobs"), number(fields, "top_logprobs", int, 0, MAX_TOP_LOGPROBS)
    if switch not in (None, True, False):
        raise APIError(400, "logprobs: must be true or false (top_logprobs gives how many alternatives)", "logprobs")
    if top and not switch:
        raise APIError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
    return (top or 0) if switch else None


def _stops(fields: dict[str, Any]) -> tuple[str, ...]:
    stop = fields.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if (not isinstance(stops, list) or len(stops) > MAX_STOPS
            or not all(isinstance(s, str) and len(s) <= MAX_STOP_CHARS for s in stops)):
        raise APIError(400, f"stop: must be a string or a list of at most {MAX_STOPS} strings, each at most "
                            f"{MAX_STOP_CHARS} characters", "stop")
    return tuple(stops)


def _check_length(limits: Limits, field: str, texts: list[str], messages: int = 0) -> None:
    """Refuse a prompt that cannot fit the context by what it costs at least, before rendering or
    tokenising it: `messages` x the template's tokens for each, and its texts' characters."""
    template = messages * limits.message_tokens
    if template >= limits.context:
        raise too_long(limits.context, field, f"However, your {messages} messages take at least {template} tokens "
                                              f"of the chat template alone ({limits.message_tokens} each).")
    chars, room = sum(len(text) for text in texts), limits.context - template
    if chars > room * limits.chars_per_token:
        raise too_long(limits.context, field, f"However, your prompt has {chars} characters, more than any {room} "
                                              f"tokens can hold ({room * limits.chars_per_token} characters at most)"
                       + (f", beside the {template} tokens of the template for {messages} messages."
                          if messages else "."))


def check_fields(fields: dict[str, Any], endpoint: str) -> None:
    """Refuse a field that `endpoint` does not read (REQUEST_FIELDS, IGNORED), or that asks for what this
    server does not do (UNSUPPORTED, unless off), by its name."""
    known = REQUEST_FIELDS[endpoint]
    for name, value in fields.items():
        if name in known:                       # /v1/responses reads `store` (true is its client's default)
            continue
        if name in UNSUPPORTED:
            if value not in UNSUPPORTED[name]:
                why = UNSUPPORTED_WHY.get(name, "not supported by this server")
                raise APIError(400, f"{name}: {why}", name, "unsupported_field")
        elif name not in known and name not in IGNORED:
            raise APIError(400, f"{name}: not a field of {endpoint} (README, Serving: the request fields)", name,
                           "unknown_field")


def parse_body(raw: bytes, model_ids: Sequence[str]) -> dict[str, Any]:
    """The JSON object of a request body, checked as far as every endpoint needs (model: one of `model_ids`,
    or none, as vLLM takes it; stream)."""
    huge: list[TooManyDigits] = []

    def integer(text: str) -> int | TooManyDigits:
        digits = len(text.lstrip("-"))
        if digits <= MAX_INT_DIGITS:
            return int(text)
        huge.append(TooManyDigits(digits))
        return huge[-1]

    try:
        body = json.loads(raw, parse_int=integer)
    except (json.JSONDecodeError, UnicodeDecodeError) as bad:
        raise APIError(400, f"request body: not valid JSON ({bad})") from None
    except RecursionError:
        raise APIError(400, "request body: JSON nested too deeply") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body: must be a JSON object")
    if huge or SURROGATE.search(raw) or json.detect_encoding(raw) != "utf-8":
        for name, value in body.items():          # which field holds it
            leaves = list(_leaves([name, value]))
            if not all(_encodable(leaf) for leaf in leaves if isinstance(leaf, str)):
                field = name if _encodable(name) else None
                raise APIError(400, f"{field or 'a field name'}: not valid Unicode (a lone surrogate)", field)
            long = next((leaf for leaf in leaves if isinstance(leaf, TooManyDigits)), None)
            if long is not None:
                raise APIError(400, f"{name}: an integer of {long.digits} digits, more than {MAX_INT_DIGITS}", name)
    if body.get("model") is not None and body.get("model") not in model_ids:
        raise APIError(404, f"The model `{body.get('model')}` does not exist (this server has "
                            f"{', '.join(f'`{name}`' for name in model_ids)}).", "model", "model_not_found")
    stream = body.get("stream")
    if stream not in (None, True, False):
        raise APIError(400, "stream: must be true or false", "stream")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)):
        raise APIError(400, "stream_options: only allowed with stream: true, as an object", "stream_options")
    return body


@dataclass(frozen=True)
class TooManyDigits:
    """A JSON integer longer than MAX_INT_DIGITS, left unparsed for parse_body to refuse by its field."""

    digits: int


def _leaves(value: Any) -> Iterator[Any]:
    """Every string and number in a JSON value, keys included; a loop, not recursion, however deep the nesting."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            pending.extend(item)
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
        else:
            yield item


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
