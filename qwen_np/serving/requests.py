"""Requests to batch rows: a body read by bodies.py made into a batching.Request (`Service`), against what
needs the prompt's tokens and the model: the room the context leaves for max_tokens, the sampling settings
resolved against the checkpoint's defaults, the grammar of a chat's tools or response_format compiled
(structured.py), the KV cache's capacity checked; refused with a 4xx naming the field otherwise.

Defaults come from the checkpoint's generation_config.json, as in vLLM; max_tokens defaults to the
server's default_max_tokens (DEFAULT_MAX_TOKENS: a client that forgets it cannot keep a row busy for an
hour), or what the context has left if less. A chat's messages are text (Tokenizer.encode_chat: a special
token comes only from the template); a completion's prompt parses special tokens as transformers and vLLM
do, unless it asks for text with parse_special_tokens: false. Log-probabilities are the model's raw ones
(generation/logprobs.py).

Imports bodies.py and structured.py of serving/ (and the layers below them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..core.defaults import DEFAULT_MAX_TOKENS   # defined there for --help, which loads no NumPy
from ..core.adapters import Adapter
from ..core.model import Qwen3Model
from ..errors import APIError, QwenNPError
from ..files.model_files import GenerationDefaults
from ..files.tokenizer import Tokenizer
from ..generation.batching import BatchGenerator, BatchRunner, Request
from ..generation.constraints import Vocabulary
from ..generation.generate import Ending, resolve_sampling
from .bodies import ChatBody, CompletionBody, GenerationBody, Limits, in_range, too_long
from .structured import grammar

# The request field of each library parameter an error may be about (QwenNPError.param): the library says
# "max_new_tokens: ...", a client reads "max_tokens: ..." (api_error words every library error with it).
FIELDS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty", "seed": "seed",
          "frequency_penalty": "frequency_penalty", "logit_bias": "logit_bias", "max_new_tokens": "max_tokens",
          "min_tokens": "min_tokens", "ignore_eos": "ignore_eos", "thinking_budget": "thinking_budget"}
# Qwen's tokenizer normalises text to NFC first, which merges at most 4 code points into one (e.g.
# Greek alpha with three marks); so a text of n tokens has at most n x 4 x (the longest token's
# characters) characters. Twice that is a generous bound: a longer prompt cannot fit the context,
# and is refused by its length before anything tokenises it.
LENGTH_FACTOR = 8


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

    def adapter_of(self, model: str | None) -> Adapter | None:
        """The LoRA adapter a body's `model` names (parse_body checked it is served); None: the base, by any
        of its names, or no name. Every path that reads the prompt runs with it: generation, an echo's
        scores, embeddings, the explorer."""
        return self.adapters.get(model or "")

    def name_of(self, adapter: Adapter | None) -> str:
        """The `model` a response names: the adapter asked for, or the base's first name."""
        return adapter.name if adapter is not None else self.model_id

    @property
    def vocab(self) -> int:
        """How many token ids a request may name (bodies.is_token_id): the tokenizer's, not the model's padded rows."""
        return self.tokenizer.vocab_size

    @property
    def limits(self) -> Limits:
        """What reading a body needs of this server (bodies.py)."""
        return Limits(self.vocab, self.context, self.chars_per_token, self.message_tokens, self.generator.max_batch,
                      self.tokenizer.has_chat_template)

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

    def request(self, body: GenerationBody, prompt: list[int]) -> Request:
        """The batch request for a chat or completion body whose prompt is already tokenised (a chat's tools
        or response_format give the reply a grammar)."""
        max_tokens = body.max_tokens
        room = self.context - len(prompt)
        if room < 1 or (max_tokens is not None and max_tokens > room):
            field = "messages" if isinstance(body, ChatBody) else "prompt"
            raise too_long(self.context, field, f"However, you requested {len(prompt) + (max_tokens or 1)} tokens "
                                                f"({len(prompt)} in the messages, {max_tokens or 1} in the completion).")
        thinking = body.thinking if isinstance(body, ChatBody) else None
        try:
            params = resolve_sampling(self.defaults, thinking, **vars(body.sampling))
        except QwenNPError as bad:
            raise api_error(bad) from None
        generator = self.generator
        fits = max(1, min(room, generator.capacity - len(prompt), self.default_max_tokens or room))
        tokens = max_tokens or fits
        ending = Ending(body.stop_token_ids, body.ignore_eos, in_range("min_tokens", body.min_tokens, int, 0, tokens))
        constrained = (grammar(body.tools, body.response_format, self.vocabulary, thinking is not False)
                       if isinstance(body, ChatBody) else None)
        request = Request(prompt, params, tokens, body.stops, grammar=constrained, logprobs=body.logprobs,
                          ending=ending, adapter=self.adapter_of(body.model), thinking_budget=body.thinking_budget)
        try:
            generator.check(request)          # what is left to check: the KV cache's capacity; here, not at
                                              # submit, so that a stream's refusal is a 4xx too
        except QwenNPError as bad:
            if bad.param == "thinking_budget":                        # the model has no thinking to budget
                raise api_error(bad) from None
            problem = api_error(bad, "kv_cache_exceeded")
            problem.param = problem.param if max_tokens else None       # the client asked for no max_tokens
            raise problem from None
        return request

    def chat_prompt(self, body: ChatBody) -> list[int]:
        """The chat's token ids, rendered with the checkpoint's template."""
        tools = body.tools.declared if body.tools else None
        try:
            return self.tokenizer.encode_chat(list(body.messages), add_generation_prompt=True,
                                              enable_thinking=body.thinking, tools=tools)
        except QwenNPError as bad:
            raise APIError(400, f"messages: {bad}", "messages") from None

    def completion_prompt(self, body: CompletionBody) -> list[int]:
        """The completion's token ids: its text tokenised, or the ids it sent."""
        if isinstance(body.prompt, str):
            return self.tokenizer.encode(body.prompt, parse_special=body.parse_special)
        return list(body.prompt)
