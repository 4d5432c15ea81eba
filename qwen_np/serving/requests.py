"""Requests to batch rows: an OpenAI body checked field by field and made into a batching.Request
(`Service`), refused with a 4xx naming the field otherwise.

The request fields are OpenAI's (its API reference for chat completions and completions); Qwen3's
thinking switch comes as vLLM takes it, `chat_template_kwargs: {"enable_thinking": false}`, and the
sampling fields vLLM adds (top_k, min_p, repetition_penalty) are accepted too. Defaults come from the
checkpoint's generation_config.json, as in vLLM; max_tokens defaults to the server's default_max_tokens
(DEFAULT_MAX_TOKENS: a client that forgets it cannot keep a row busy for an hour), or what the context has
left if less. vLLM's stop_token_ids, ignore_eos and min_tokens are read with vLLM's meaning (Ending). Every
field is in one catalogue (REQUEST_FIELDS, IGNORED, UNSUPPORTED; README lists it): a field that is not is
refused by name, so that no client gets a silently different answer than it asked for.

One request cannot hurt another: its sampling settings are checked before it joins the batch, every
string's length is bounded, every integer's digits, and a prompt that cannot fit the context is refused by
what it costs at least (its characters, and the template's tokens for each message) before anything
renders or tokenises it. A chat's messages are text (Tokenizer.encode_chat: a special token comes only
from the template); a completion's prompt parses special tokens as transformers and vLLM do, unless it
asks for text with parse_special_tokens: false. A chat's tools and response_format become the grammar its
reply is held to (structured.py); log-probabilities are the model's raw ones (generation/logprobs.py).

Imports structured.py of serving/ (and the layers below it).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

from ..core.defaults import DEFAULT_MAX_TOKENS   # defined there for --help, which loads no NumPy
from ..core.adapters import Adapter
from ..core.model import Qwen3Model
from ..errors import APIError, QwenNPError
from ..files.messages import MessageError, chat_message
from ..files.model_files import GenerationDefaults
from ..files.tokenizer import Tokenizer
from ..generation.batching import BatchGenerator, BatchRunner, Request
from ..generation.constraints import Vocabulary
from ..generation.generate import Ending, resolve_sampling
from ..generation.logprobs import MAX_TOP_LOGPROBS
from .structured import grammar, read_tools

# max_tokens of a request that gives none: 2,048 tokens are ~30 minutes of Qwen3-8B decode on two cores,
# where "what the context has left" (32,768 - prompt) would keep a row busy for hours.
# The request fields, one catalogue (README's "Request fields" shows it; a test holds the two together):
# what each endpoint reads, what every endpoint reads and leaves alone (it changes no answer), and what it
# refuses unless "off". Any other field is refused by name.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "seed")
GENERATION_FIELDS = ("model", "stream", "stream_options", "n", "max_tokens", "max_completion_tokens", *SAMPLING_FIELDS,
                     "frequency_penalty", "logit_bias", "logprobs", "stop", "stop_token_ids", "ignore_eos", "min_tokens")
REQUEST_FIELDS = {"/v1/chat/completions": ("messages", "chat_template_kwargs", "tools", "tool_choice",
                                           "parallel_tool_calls", "response_format", "top_logprobs",
                                           *GENERATION_FIELDS),
                  "/v1/completions": ("prompt", "parse_special_tokens", "echo", "best_of", *GENERATION_FIELDS),
                  "/v1/embeddings": ("model", "input", "encoding_format", "dimensions"),
                  "/explorer/": ("model", "prompt", "parse_special_tokens", "layer", *SAMPLING_FIELDS)}
IGNORED = ("user", "metadata", "service_tier")
# Not implemented: refused when set to anything but their "off" value. (functions and function_call: OpenAI's
# deprecated names for tools and tool_choice; vLLM's guided_* : response_format says it.)
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": (None, []), "function_call": (None, "none"), "guided_json": (None,), "guided_regex": (None,),
    "guided_choice": (None,), "guided_grammar": (None,), "reasoning_effort": (None,),
    "suffix": (None, ""),
    "store": (None, False), "prediction": (None,), "audio": (None,), "modalities": (None, ["text"]),
    "web_search_options": (None,)}
# Why a refused field cannot be served, where that is the model's doing rather than this server's.
UNSUPPORTED_WHY = {"suffix": "Qwen3 was not trained for fill-in-the-middle (it has no FIM tokens), so no text can be "
                             "generated to fit before a suffix"}
# The request field of each library parameter an error may be about (QwenNPError.param): the library says
# "max_new_tokens: ...", a client reads "max_tokens: ..." (api_error words every library error with it).
FIELDS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty", "seed": "seed",
          "frequency_penalty": "frequency_penalty", "logit_bias": "logit_bias", "max_new_tokens": "max_tokens",
          "min_tokens": "min_tokens", "ignore_eos": "ignore_eos"}
# OpenAI's limit on stop strings, and a bound on each: stop strings are matched against the text at
# every token, in time that grows with their number and the square of their length.
MAX_STOPS, MAX_STOP_CHARS = 4, 256
# Qwen's tokenizer normalises text to NFC first, which merges at most 4 code points into one (e.g.
# Greek alpha with three marks); so a text of n tokens has at most n x 4 x (the longest token's
# characters) characters. Twice that is a generous bound: a longer prompt cannot fit the context,
# and is refused by its length before anything tokenises it.
LENGTH_FACTOR = 8
# An integer's digits at most: Python's own limit on parsing them (sys.int_info.default_max_str_digits); a
# longer one is refused naming its field, not parsed into a ValueError.
MAX_INT_DIGITS = 4300
# How a lone surrogate (\ud800), which no UTF-8 text (tokenizer, reply, log) can hold, gets into a UTF-8
# body: escaped, or encoded as its three bytes (json.loads decodes with surrogatepass). A body with neither
# (nor an integer too long) is not walked string by string: 250,000 messages would take seconds.
SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
MAX_STOP_TOKEN_IDS = 256


def is_token_id(value: Any, vocab: int) -> bool:
    """The one rule of every field that takes token ids (a prompt's, logit_bias's keys, stop_token_ids, an
    embedding's input): an integer in [0, vocab), vocab the tokenizer's (Service.vocab). bool is an int in
    Python, and no id. The model's embedding table may have more rows (Qwen3 pads its 151,669 ids to 151,936,
    a multiple of 128): no text has those, they decode to nothing, and no field takes them."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab


def api_error(problem: QwenNPError, code: str | None = None) -> APIError:
    """A library error as a 400 of this API: its parameter worded as the request field that sets it (FIELDS)."""
    return APIError(400, problem.worded(FIELDS), FIELDS.get(problem.param or ""), code)


def longest_token(tokenizer: Tokenizer) -> int:
    """Characters in the tokenizer's longest token."""
    return max(len(tokenizer.decode([i])) for i in range(tokenizer.vocab_size))


def tokens_per_message(tokenizer: Tokenizer) -> int:
    """The fewest tokens the chat template adds for one more message, of any role (Qwen3's: 4 for a tool
    result after another, <tool_response> and its close; 5 for a turn, <|im_start|>, role, newline,
    <|im_end|>, newline), measured by rendering: a floor of what a body of many messages costs, known
    before rendering it. 0 without a template, or where a role cannot follow itself."""
    if not tokenizer.has_chat_template:
        return 0
    costs = []
    for role in ("system", "user", "assistant", "tool"):
        one = [{"role": "user", "content": "x"}, {"role": role, "content": ""}]
        try:
            costs.append(len(tokenizer.encode_chat(one + one[1:])) - len(tokenizer.encode_chat(one)))
        except QwenNPError:
            return 0
    return max(0, min(costs))


@dataclass
class Service:
    """What every request needs: the model's name, its tokenizer and defaults, the batch runner, and what a
    prompt costs at least: chars_per_token (a token holds at most that many characters) and
    message_tokens (the template's fewest tokens a message, tokens_per_message). A request's `model` picks
    the base (any of model_ids) or one of the LoRA adapters (`adapters`, by name), as vLLM's --lora-modules."""

    model_ids: tuple[str, ...]           # the names clients may ask for; the first answers in responses
    tokenizer: Tokenizer
    defaults: GenerationDefaults
    runner: BatchRunner
    context: int
    chars_per_token: int
    message_tokens: int = 0
    split_reasoning: bool = True         # a chat reply's <think> part apart, as reasoning_content and reasoning
    default_max_tokens: int | None = DEFAULT_MAX_TOKENS     # max_tokens of a request without one (None: no cap)
    # The grammar engine's view of the tokenizer, for requests and the explorer (None: llguidance missing);
    # its costly part is built on the first request that asks for a grammar (Vocabulary.engine).
    vocabulary: Vocabulary | None = None
    adapters: Mapping[str, Adapter] = field(default_factory=dict)    # name -> adapter, over the one base
    created: int = int(time.time())

    @property
    def model_id(self) -> str:
        return self.model_ids[0]

    @property
    def served_names(self) -> tuple[str, ...]:
        """Every name a request's `model` may give: the base's, then each adapter's."""
        return (*self.model_ids, *self.adapters)

    def adapter_of(self, body: dict[str, Any]) -> Adapter | None:
        """The LoRA adapter a body's `model` names (parse_body checked it is served); None: the base, by any
        of its names, or no name. Every path that reads the prompt runs with it: generation, an echo's
        scores, embeddings, the explorer."""
        return self.adapters.get(body.get("model") or "")

    def name_of(self, adapter: Adapter | None) -> str:
        """The `model` a response names: the adapter asked for, or the base's first name."""
        return adapter.name if adapter is not None else self.model_id

    @property
    def vocab(self) -> int:
        """How many token ids a request may name (is_token_id): the tokenizer's, not the model's padded rows."""
        return self.tokenizer.vocab_size

    @property
    def generator(self) -> BatchGenerator:
        """The batch every request joins: the runner's (its thread steps it), reached through here only."""
        return self.runner.generator

    @property
    def model(self) -> Qwen3Model:
        return self.generator.model

    @property
    def speculating(self) -> bool:
        """Whether every row decodes speculatively (a reply's usage then counts drafted and accepted tokens)."""
        return self.generator.speculation is not None

    def health(self) -> dict[str, Any]:
        """GET /health: the server is up, and how many requests run and wait."""
        return {"status": "ok", "running": len(self.generator.rows), "waiting": self.generator.waiting}

    def check_generates(self) -> None:
        """Refuse chat and completions for a checkpoint without an LM head (an embedding model)."""
        if not self.model.has_head:
            raise APIError(400, "this model has no language-model head (lm_head: an embedding model such as "
                                "Qwen3-Embedding), so it cannot generate text: use /v1/embeddings", None, "no_lm_head")

    def request(self, body: dict[str, Any], prompt: list[int], enable_thinking: bool | None,
                chat: bool = False) -> Request:
        """The batch request for an OpenAI body whose prompt is already tokenised; chat: a chat body (its
        tools or response_format give the reply a grammar, and its logprobs are a switch, not a count)."""
        max_tokens = _number(body, "max_completion_tokens", int, 1) or _number(body, "max_tokens", int, 1)
        room = self.context - len(prompt)
        if room < 1 or (max_tokens is not None and max_tokens > room):
            raise self._too_long(body, f"However, you requested {len(prompt) + (max_tokens or 1)} tokens ({len(prompt)} "
                                       f"in the messages, {max_tokens or 1} in the completion).")
        top_k = _number(body, "top_k", int, -1)
        explicit = {"temperature": _number(body, "temperature", float, 0, 2), "top_p": _number(body, "top_p", float, 0, 1),
                    "top_k": 0 if top_k == -1 else top_k, "min_p": _number(body, "min_p", float, 0, 1),
                    "repetition_penalty": _number(body, "repetition_penalty", float, 0),
                    "presence_penalty": _number(body, "presence_penalty", float, -2, 2),
                    "frequency_penalty": _number(body, "frequency_penalty", float, -2, 2),
                    "logit_bias": self._logit_bias(body), "seed": _number(body, "seed", int, 0)}
        if explicit["top_p"] == 0:
            raise APIError(400, "top_p: must be in (0, 1]", "top_p")
        try:
            params = resolve_sampling(self.defaults, enable_thinking, **explicit)
        except QwenNPError as bad:
            raise api_error(bad) from None
        generator = self.generator
        fits = max(1, min(room, generator.capacity - len(prompt), self.default_max_tokens or room))
        constrained = grammar(body, read_tools(body), self.vocabulary, enable_thinking is not False) if chat else None
        request = Request(prompt, params, max_tokens or fits, _stops(body), grammar=constrained,
                          logprobs=_logprobs(body, chat), ending=self._ending(body, max_tokens or fits),
                          adapter=self.adapter_of(body))
        try:
            generator.check(request)          # what is left to check: the KV cache's capacity; here, not at
                                              # submit, so that a stream's refusal is a 4xx too
        except QwenNPError as bad:
            problem = api_error(bad, "kv_cache_exceeded")
            problem.param = problem.param if max_tokens else None       # the client asked for no max_tokens
            raise problem from None
        return request

    def _logit_bias(self, body: dict[str, Any]) -> dict[int, Any] | None:
        """OpenAI's logit_bias, {"token id": bias} (JSON keys are strings), keyed by the model's token ids; the
        biases are SamplingParams' to check (numbers in [-100, 100])."""
        bias = body.get("logit_bias")
        if bias is None:
            return None
        vocab = self.vocab
        if not isinstance(bias, dict):
            raise APIError(400, 'logit_bias: must be an object of token ids and biases, {"198": -100}', "logit_bias")
        for key in bias:           # digits first: int() would take " 1", "+1", "1_0" and thousands of digits
            if not (key.isascii() and key.isdigit() and len(key) <= len(str(vocab)) and is_token_id(int(key), vocab)):
                raise APIError(400, f"logit_bias: keys must be token ids in [0, {vocab}), got {key!r}", "logit_bias")
        return {int(key): value for key, value in bias.items()}

    def _ending(self, body: dict[str, Any], max_tokens: int) -> Ending:
        """vLLM's stop_token_ids, ignore_eos and min_tokens of `body`, checked."""
        ids = body.get("stop_token_ids")
        vocab = self.vocab
        if ids is not None and (not isinstance(ids, list) or len(ids) > MAX_STOP_TOKEN_IDS
                                or not all(is_token_id(t, vocab) for t in ids)):
            raise APIError(400, f"stop_token_ids: must be a list of at most {MAX_STOP_TOKEN_IDS} token ids in "
                                f"[0, {vocab})", "stop_token_ids")
        ignore_eos = body.get("ignore_eos")
        if ignore_eos not in (None, True, False):
            raise APIError(400, "ignore_eos: must be true or false", "ignore_eos")
        min_tokens = _number(body, "min_tokens", int, 0, max_tokens)
        return Ending(tuple(ids or ()), bool(ignore_eos), min_tokens or 0)

    def _too_long(self, body: dict[str, Any], why: str) -> APIError:
        return APIError(400, f"This model's maximum context length is {self.context} tokens. {why} Please reduce the "
                             "length of the messages or completion.", "messages" if "messages" in body else "prompt",
                        "context_length_exceeded")

    def _check_length(self, body: dict[str, Any], texts: list[str], messages: int = 0) -> None:
        """Refuse a prompt that cannot fit the context by what it costs at least, before rendering or
        tokenising it: `messages` x the template's tokens for each, and its texts' characters."""
        template = messages * self.message_tokens
        if template >= self.context:
            raise self._too_long(body, f"However, your {messages} messages take at least {template} tokens of "
                                       f"the chat template alone ({self.message_tokens} each).")
        chars, room = sum(len(text) for text in texts), self.context - template
        if chars > room * self.chars_per_token:
            raise self._too_long(body, f"However, your prompt has {chars} characters, more than any {room} tokens "
                                       f"can hold ({room * self.chars_per_token} characters at most)"
                                 + (f", beside the {template} tokens of the template for {messages} messages."
                                    if messages else "."))

    def chat_prompt(self, body: dict[str, Any]) -> tuple[list[int], bool | None]:
        """The chat's token ids (rendered with the checkpoint's template) and the thinking switch."""
        if not self.tokenizer.has_chat_template:
            raise APIError(400, "this model has no chat template, so it cannot chat: use /v1/completions, which "
                                "continues text", "messages", "no_chat_template")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "messages: must be a non-empty list of messages", "messages")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict) or set(kwargs) - {"enable_thinking"}:
            raise APIError(400, "chat_template_kwargs: only {\"enable_thinking\": true|false} is supported",
                           "chat_template_kwargs")
        thinking = kwargs.get("enable_thinking")
        if thinking is not None and not isinstance(thinking, bool):
            raise APIError(400, "chat_template_kwargs.enable_thinking: must be true or false", "chat_template_kwargs")
        self._check_length(body, [], len(messages))          # 250,000 empty messages: refused unread
        try:
            chat = [chat_message(m, i) for i, m in enumerate(messages)]     # files/messages.py: the one rule
        except MessageError as bad:
            raise APIError(400, str(bad), "messages", bad.code) from None
        tools = read_tools(body)
        texts = [text for m in chat for text in (m["content"], m.get("reasoning_content")) if text]
        texts += [json.dumps(call["function"]) for m in chat for call in m.get("tool_calls", [])]
        self._check_length(body, texts + ([json.dumps(tools.declared)] if tools else []), len(chat))
        try:
            ids = self.tokenizer.encode_chat(chat, add_generation_prompt=True, enable_thinking=thinking,
                                             tools=tools.declared if tools else None)
        except QwenNPError as bad:
            raise APIError(400, f"messages: {bad}", "messages") from None
        return ids, thinking

    def completion_prompt(self, body: dict[str, Any]) -> list[int]:
        prompt = sent_prompt(body)
        parse = body.get("parse_special_tokens", True)
        if parse not in (True, False):
            raise APIError(400, "parse_special_tokens: must be true or false", "parse_special_tokens")
        if isinstance(prompt, str) and prompt:
            self._check_length(body, [prompt])
            return self.tokenizer.encode(prompt, parse_special=parse)
        if isinstance(prompt, list) and prompt and all(is_token_id(t, self.vocab) for t in prompt):
            return list(prompt)                                 # token ids
        raise APIError(400, f"prompt: must be a non-empty string or list of token ids in [0, {self.vocab}) (one prompt "
                            "per request)", "prompt")


def sent_prompt(body: dict[str, Any]) -> Any:
    """A completion body's prompt as sent: a text or token ids (a batch of one prompt taken out of its list)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return prompt[0]
    return prompt


def check_fields(body: dict[str, Any], endpoint: str) -> None:
    """Refuse a field that `endpoint` does not read (REQUEST_FIELDS, IGNORED), or that asks for what this
    server does not do (UNSUPPORTED, unless off), by its name."""
    known = REQUEST_FIELDS[endpoint]
    for name, value in body.items():
        if name in UNSUPPORTED:
            if value not in UNSUPPORTED[name]:
                why = UNSUPPORTED_WHY.get(name, "not supported by this server")
                raise APIError(400, f"{name}: {why}", name, "unsupported_field")
        elif name not in known and name not in IGNORED:
            raise APIError(400, f"{name}: not a field of {endpoint} (README, Serving: the request fields)", name,
                           "unknown_field")


def _number(body: dict[str, Any], name: str, kind: type, low: float, high: float | None = None) -> Any:
    """body[name] (None when absent or null), checked to be a `kind` in [low, high]."""
    value = body.get(name)
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (kind is float or isinstance(value, int))
    if not ok or not low <= value <= (high if high is not None else float("inf")):
        rule = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise APIError(400, f"{name}: must be {'an integer' if kind is int else 'a number'} {rule}, got {value!r}", name)
    return kind(value)


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """How many top log-probabilities each token reports (None: no log-probabilities): a chat's `logprobs`
    is a switch and `top_logprobs` the count, a completion's `logprobs` the count (OpenAI's legacy field)."""
    if not chat:
        return _number(body, "logprobs", int, 0, MAX_TOP_LOGPROBS)
    switch, top = body.get("logprobs"), _number(body, "top_logprobs", int, 0, MAX_TOP_LOGPROBS)
    if switch not in (None, True, False):
        raise APIError(400, "logprobs: must be true or false (top_logprobs gives how many alternatives)", "logprobs")
    if top and not switch:
        raise APIError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
    return (top or 0) if switch else None


def _stops(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if (not isinstance(stops, list) or len(stops) > MAX_STOPS
            or not all(isinstance(s, str) and len(s) <= MAX_STOP_CHARS for s in stops)):
        raise APIError(400, f"stop: must be a string or a list of at most {MAX_STOPS} strings, each at most "
                            f"{MAX_STOP_CHARS} characters", "stop")
    return tuple(stops)


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
