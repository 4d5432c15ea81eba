"""`python -m qwen_np serve`: an OpenAI-compatible HTTP API, every request's decode steps batched together.

    python -m qwen_np serve --model Qwen/Qwen3-0.6B          # http://127.0.0.1:8000/v1

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
    client.chat.completions.create(model="Qwen/Qwen3-0.6B", messages=[{"role": "user", "content": "Hi"}])

Endpoints: GET /v1/models, POST /v1/chat/completions, POST /v1/completions (streamed as Server-Sent
Events or not), GET /health (with the number of running and waiting requests), GET /metrics (those,
the KV cache's blocks, prefix cache hits, tokens and preemptions, in Prometheus' text format), and a
web page at / with an explorer of the forward pass and a playground (explorer.py, its endpoints under
/explorer/). The request fields and the response shapes are OpenAI's (OpenAI's API reference for chat
completions and completions); Qwen3's
thinking switch comes as vLLM takes it, `chat_template_kwargs: {"enable_thinking": false}`, and the
sampling fields vLLM adds (top_k, min_p, repetition_penalty) are accepted too. Defaults come from the
checkpoint's generation_config.json, as in vLLM; max_tokens defaults to --default-max-tokens (2,048:
a client that forgets it cannot keep a row busy for an hour), or what the context has left if less.
--served-model-name gives the model the names clients ask for (several: aliases, as vLLM's; the
first answers in responses); a request without `model` gets the served one.
A model whose tokenizer has no chat template (the bundled Shakespeare model) serves completions, and
answers chat requests with a 400 that says so.

Every request becomes a row of one batching.BatchGenerator, run by a BatchRunner on its own thread:
concurrent requests share decode steps, a new one starts its prefill at the next step, and a client
that disconnects frees its row. Every row's keys and values are blocks of one pool of --kv-memory
bytes (kv_cache.py): a request joins while blocks are free, one that could never fit is refused
with a 400, and a prompt reuses the blocks of a prefix seen before (the response's
usage.prompt_tokens_details.cached_tokens says how many tokens). Bad requests get OpenAI's error
JSON with a 4xx status; nothing answers with a traceback. One request cannot hurt another: its
sampling settings are checked before it joins the batch, a row whose sampling fails anyway ends
alone, the body's size and every string's length are bounded, and tokenising runs on worker
threads, never on the event loop.

Any web page can send requests to a server on loopback, so POSTs must be `application/json` (a form
or `text/plain` POST, which a browser sends cross-site without asking, is refused), a loopback server
answers only Host headers naming loopback (against DNS rebinding), and `--api-key` asks every client
but /health and the page's files for `Authorization: Bearer KEY` (the page asks for the key). Each request
is logged in one line on stderr.

The HTTP stack is Starlette on uvicorn (the `serve` extra): both small and well kept (Encode's; the
ASGI stack FastAPI and vLLM's server stand on), Starlette needs only anyio and uvicorn only h11 and
click. They give us HTTP/1.1 keep-alive, streaming responses, and a disconnect signal that cancels a
stream, which the standard library's http.server would leave to hand-written code.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import re
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator, Sequence

from ..generation.batching import BatchGenerator, BatchRunner, Request, Row
from ..errors import APIError, QwenNPError
from .explorer import Explorer, is_page
from ..engine.finite import check_weights_finite
from ..files.model_files import GenerationDefaults
from ..generation.generate import TokenEvent, resolve_sampling
from ..core.kv_cache import BlockPool, PagedKVCache, block_bytes, blocks_for
from ..generation.speculative import check_draft_folder, load_draft
from ..engine.loading import load_model
from ..files.model_files import read_config, read_generation_defaults, read_tokenizer
from ..core.model import Qwen3Model
from ..engine.memory import DEFAULT_CONTEXT, PREFILL_CHUNK, format_size
from .metrics import PROMETHEUS_TYPE, prometheus_text
from ..generation.speculative import DEFAULT_DRAFT_TOKENS, Speculation, draft_speculation, lookup_speculation, usage_fields
from ..files.tokenizer import THINK_OPEN, Message, ThinkingSplitter, Tokenizer, split_thinking

DEFAULT_HOST, DEFAULT_PORT, DEFAULT_MAX_BATCH = "127.0.0.1", 8000, 8
# max_tokens of a request that gives none: 2,048 tokens are ~30 minutes of Qwen3-8B decode on two cores,
# where "what the context has left" (32,768 - prompt) would keep a row busy for hours.
DEFAULT_MAX_TOKENS = 2048
# Our finish reasons -> OpenAI's: the model ended or a stop string was met -> "stop"; a token limit -> "length".
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}
ROLES = ("system", "developer", "user", "assistant", "tool")
# Fields we do not implement: refused when set to anything but their "off" value, so nobody gets a
# silently different answer than they asked for.
UNSUPPORTED = {"logprobs": (None, False), "top_logprobs": (None, 0), "tools": (None, []), "tool_choice": (None, "none"),
               "response_format": (None, {"type": "text"}), "frequency_penalty": (None, 0), "logit_bias": (None, {}),
               "echo": (None, False), "suffix": (None, ""), "best_of": (None, 1)}
DISCONNECT_POLL_SECONDS = 0.5
# A request body above this is refused (413) unread: a prompt that fills even a 40960-token context
# with the longest tokens (128 characters) takes about 5 MiB of JSON.
MAX_BODY_BYTES = 8 * 2**20
# OpenAI's limit on stop strings, and a bound on each: stop strings are matched against the text at
# every token, in time that grows with their number and the square of their length.
MAX_STOPS, MAX_STOP_CHARS = 4, 256
# Qwen's tokenizer normalises text to NFC first, which merges at most 4 code points into one (e.g.
# Greek alpha with three marks); so a text of n tokens has at most n x 4 x (the longest token's
# characters) characters. Twice that is a generous bound: a longer prompt cannot fit the context,
# and is refused by its length before anything tokenises it.
LENGTH_FACTOR = 8
# A client must send its whole body within this (408 otherwise), so a half-sent request does not hold
# its connection and handler open forever. Between requests, uvicorn closes a kept-alive connection
# that stays idle for timeout_keep_alive seconds; and a connection gets HEADER_SECONDS for each request's
# headers, from its opening or its last response (header_deadline_protocol), so none is held half-open.
BODY_SECONDS, KEEP_ALIVE_SECONDS, HEADER_SECONDS = 10.0, 5, 10.0
API_KEY_ENV = "QWEN_NP_API_KEY"
# The request field of each library parameter an error may be about (QwenNPError.param): the library says
# "max_new_tokens: ...", a client reads "max_tokens: ..." (api_error words every library error with it).
FIELDS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty", "seed": "seed",
          "max_new_tokens": "max_tokens"}
LOOPBACK_HOST = re.compile(r"(localhost|127\.0\.0\.1|\[::1\])(:\d{1,5})?", re.IGNORECASE)


# --- running the server ----------------------------------------------------------------------------

def serve(names: Sequence[str], folder: Path, listener: socket.socket, *, max_batch: int = DEFAULT_MAX_BATCH,
          context: int = DEFAULT_CONTEXT, memory: str = "auto", kv_memory: int | None = None, kv_dtype: str = "fp32",
          api_key: str | None = None, log: bool = True, split_reasoning: bool = True,
          default_max_tokens: int | None = DEFAULT_MAX_TOKENS,
          draft: Path | None = None, lookup: int | None = None, draft_tokens: int = DEFAULT_DRAFT_TOKENS,
          announce: Callable[[str], None] = lambda line: None) -> None:
    """Load the model in `folder` (clients ask for it by any of `names`, the first its own) and serve it on
    `listener` until Ctrl-C or SIGTERM. context: prompt and reply together, at most the model's; kv_memory:
    bytes of the KV cache's block pool, shared by every request (None: what RAM has left after the weights,
    at most max_batch full contexts); kv_dtype: how it stores keys and values; default_max_tokens: a
    request's max_tokens when it gives none (None: what the context has left); draft (a checkpoint folder)
    or lookup (the n-gram size): every row decodes speculatively, draft_tokens drafted per step;
    announce(line) gets the start lines."""
    try:
        import uvicorn
    except ImportError:
        raise QwenNPError("serve: needs the `serve` extra (pip install 'qwen_np[serve]': starlette, uvicorn)") from None
    if isinstance(names, str) or not names:
        raise QwenNPError(f"serve: names must be a non-empty list of model names, got {names!r}")
    if default_max_tokens is not None and default_max_tokens < 1:
        raise QwenNPError(f"must be at least 1, got {default_max_tokens}", "default_max_tokens")
    config = read_config(folder)
    context = min(context, config.max_position_embeddings)
    tokenizer, defaults = read_tokenizer(folder), read_generation_defaults(folder, config)
    if draft is not None:
        check_draft_folder(draft, config, tokenizer)
    model = load_model(folder, memory=memory, max_tokens=context)
    check_weights_finite(model)                  # NaN/Inf weights: one line naming the layer, before listening
    drafter = load_draft(draft, memory, context + draft_tokens) if draft is not None else None
    # Every row's draft cache holds as many positions as its target cache (plus the drafted ones), so a
    # draft's block costs its bytes beside each target block: the budget buys pairs of blocks.
    per_block = block_bytes(config, kv_dtype)
    per_pair = per_block + (block_bytes(drafter.config, kv_dtype) if drafter is not None else 0)
    default = kv_memory is None
    budget = (default_kv_memory(model, max_batch * blocks_for(context) * per_pair, drafter) if kv_memory is None
              else kv_memory)
    pool = BlockPool(config, budget // per_pair, kv_dtype, prefix_caching=True)
    speculation = (speculation_over(pool, drafter, max_batch, draft_tokens) if drafter is not None
                   else lookup_speculation(lookup, draft_tokens) if lookup is not None else None)
    generator = BatchGenerator(model, tokenizer, eos_token_ids=defaults.eos_token_ids, max_batch=max_batch,
                               context=context, pool=pool, speculation=speculation)
    service = Service(tuple(names), tokenizer, defaults, BatchRunner(generator), context,
                      context * LENGTH_FACTOR * longest_token(tokenizer), split_reasoning, default_max_tokens)
    host, port = listener.getsockname()[:2]
    warning = exposure_warning(host, api_key)
    if warning:
        announce(warning)
    announce(f"KV cache: {format_size(pool.num_blocks * per_pair)} ({kv_dtype}), {pool.num_blocks} blocks of "
             f"{pool.block_size} positions, {generator.capacity} positions for all requests together"
             + (f" (the draft's {format_size(pool.num_blocks * (per_pair - per_block))} included)" if drafter else "")
             + (" (default: the RAM left after the weights, with a margin, at most --max-batch full contexts)"
                if default else ""))
    if speculation is not None:
        announce(f"speculative decoding: {speculation.describe}, {speculation.tokens} tokens drafted per step")
    address = f"{'[' + host + ']' if ':' in host else host}:{port}"
    announce(f"serving {', '.join(names)} on http://{address}/v1 (max batch {max_batch}, context {context}); "
             "Ctrl-C stops")
    app = create_app(service, api_key=api_key, loopback_only=_is_loopback(host), log=log)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2,
                                           timeout_keep_alive=KEEP_ALIVE_SECONDS, http=header_deadline_protocol()))
    service.runner.start()
    try:
        server.run(sockets=[listener])
    finally:
        service.runner.stop()


def header_deadline_protocol() -> type:
    """uvicorn's HTTP/1.1 protocol (h11), with a deadline for each request's headers: uvicorn times out a
    kept-alive connection only while it is idle, so one that sends nothing, or half a header, would hold
    its socket forever. Hand-written because uvicorn has no such setting (its `timeout_keep_alive` timer
    is cancelled by any byte received); this arms one timer of our own while headers are awaited."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadline(H11Protocol):
        deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:     # type: ignore[override]
            super().connection_made(transport)
            self._await_headers()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._await_headers()

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE and self.deadline is not None:     # the headers are in
                self.deadline.cancel()
                self.deadline = None

        def connection_lost(self, exc: Exception | None) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
            super().connection_lost(exc)

        def _await_headers(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
            waiting = self.conn.their_state is h11.IDLE       # not when a pipelined request's headers are in
            self.deadline = self.loop.call_later(HEADER_SECONDS, self._headers_late) if waiting else None

        def _headers_late(self) -> None:
            self.deadline = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadline


def speculation_over(pool: BlockPool, model: Qwen3Model, max_batch: int, tokens: int) -> Speculation:
    """Drafting with the draft `model` for a batch over `pool`: every row's draft cache comes from one
    pool of the draft's own, as many positions as `pool` has plus the k drafted ones of every row (a row's
    draft cache holds at most its sequence and k - 1 drafted tokens, and a row that leaves frees it). It
    caches prefixes as the target's pool does: a chat client resending its conversation, or rows sharing a
    system prompt, draft after reading only what is new."""
    blocks = pool.num_blocks + max_batch * (blocks_for(tokens) + 1)
    draft_pool = BlockPool(model.config, blocks, pool.dtype, prefix_caching=True)
    return draft_speculation(model, tokens, lambda positions: PagedKVCache(draft_pool, positions), PREFILL_CHUNK)


def default_kv_memory(model: Qwen3Model, full: int, draft: Qwen3Model | None = None) -> int:
    """The KV cache's bytes when --kv-memory is not given: what the memory plan leaves of the available RAM
    after the weights (the draft's too), with its margin, and no more than `full` (every row of the batch at
    its full context)."""
    if model.plan is None:
        return full
    drafts = draft.plan.held_weight_bytes if draft is not None and draft.plan is not None else 0
    return min(max(model.plan.room_for_kv_cache - drafts, 0), full)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The warning printed at start when the server listens beyond this machine, or None."""
    if _is_loopback(host):
        return None
    return (f"warning: listening on {host}: anyone who can reach this machine can use the server"
            + ("" if api_key else " (no --api-key is set)"))


def longest_token(tokenizer: Tokenizer) -> int:
    """Characters in the tokenizer's longest token."""
    return max(len(tokenizer.decode([i])) for i in range(tokenizer.vocab_size))


# --- requests -> batch rows -----------------------------------------------------------------------

@dataclass
class Service:
    """What every request needs: the model's name, its tokenizer and defaults, the batch runner, and the
    longest prompt text (in characters) that could still fit the context."""

    model_ids: tuple[str, ...]           # the names clients may ask for; the first answers in responses
    tokenizer: Tokenizer
    defaults: GenerationDefaults
    runner: BatchRunner
    context: int
    max_prompt_chars: int
    split_reasoning: bool = True         # a chat reply's <think> part apart, as reasoning_content and reasoning
    default_max_tokens: int | None = DEFAULT_MAX_TOKENS     # max_tokens of a request without one (None: no cap)
    created: int = int(time.time())

    @property
    def model_id(self) -> str:
        return self.model_ids[0]

    def request(self, body: dict[str, Any], prompt: list[int], enable_thinking: bool | None) -> Request:
        """The batch request for an OpenAI body whose prompt is already tokenised."""
        if body.get("n") not in (None, 1):
            raise APIError(400, "n: only n=1 is supported", "n")
        for name, off in UNSUPPORTED.items():
            if body.get(name) not in off:
                raise APIError(400, f"{name}: not supported by this server", name)
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
                    "seed": _number(body, "seed", int, 0)}
        if explicit["top_p"] == 0:
            raise APIError(400, "top_p: must be in (0, 1]", "top_p")
        try:
            params = resolve_sampling(self.defaults, enable_thinking, **explicit)
        except QwenNPError as bad:
            raise api_error(bad) from None
        generator = self.runner.generator
        fits = max(1, min(room, generator.capacity - len(prompt), self.default_max_tokens or room))
        request = Request(prompt, params, max_tokens or fits, _stops(body))
        try:
            generator.check(request)          # what is left to check: the KV cache's capacity; here, not at
                                              # submit, so that a stream's refusal is a 4xx too
        except QwenNPError as bad:
            problem = api_error(bad, "kv_cache_exceeded")
            problem.param = problem.param if max_tokens else None       # the client asked for no max_tokens
            raise problem from None
        return request

    def _too_long(self, body: dict[str, Any], why: str) -> APIError:
        return APIError(400, f"This model's maximum context length is {self.context} tokens. {why} Please reduce the "
                             "length of the messages or completion.", "messages" if "messages" in body else "prompt",
                        "context_length_exceeded")

    def _check_length(self, body: dict[str, Any], texts: list[str]) -> None:
        """Refuse texts too long to fit the context by their length alone, before tokenising them."""
        chars = sum(len(text) for text in texts)
        if chars > self.max_prompt_chars:
            raise self._too_long(body, f"However, your prompt has {chars} characters, more than any {self.context} "
                                       f"tokens can hold ({self.max_prompt_chars} characters at most).")

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
        chat = [_message(m, i) for i, m in enumerate(messages)]
        self._check_length(body, [text for m in chat for text in (m["content"], m.get("reasoning_content")) if text])
        try:
            text = self.tokenizer.apply_chat_template(chat, add_generation_prompt=True, enable_thinking=thinking)
        except QwenNPError as bad:
            raise APIError(400, f"messages: {bad}", "messages") from None
        return self.tokenizer.encode(text), thinking

    def completion_prompt(self, body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]                                  # a batch of one prompt
        if isinstance(prompt, str) and prompt:
            self._check_length(body, [prompt])
            return self.tokenizer.encode(prompt)
        vocab = self.tokenizer.vocab_size
        # bool is an int in Python: [true, false] is no list of token ids.
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                       for t in prompt):
            return list(prompt)                                 # token ids
        raise APIError(400, "prompt: must be a non-empty string or list of token ids (one prompt per request)", "prompt")


def api_error(problem: QwenNPError, code: str | None = None) -> APIError:
    """A library error as a 400 of this API: its parameter worded as the request field that sets it (FIELDS)."""
    return APIError(400, problem.worded(FIELDS), FIELDS.get(problem.param or ""), code)


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


def _stops(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if (not isinstance(stops, list) or len(stops) > MAX_STOPS
            or not all(isinstance(s, str) and len(s) <= MAX_STOP_CHARS for s in stops)):
        raise APIError(400, f"stop: must be a string or a list of at most {MAX_STOPS} strings, each at most "
                            f"{MAX_STOP_CHARS} characters", "stop")
    return tuple(stops)


def _message(message: Any, index: int) -> Message:
    """A chat message as the template reads it: role and text content (text parts joined)."""
    where = f"messages[{index}]"
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise APIError(400, f"{where}: must be an object with a role among {', '.join(ROLES)}", "messages")
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                   for part in content):
            raise APIError(400, f"{where}.content: only text parts are supported", "messages")
        content = "".join(part["text"] for part in content)
    if not isinstance(content, str) and not (content is None and message["role"] == "assistant"):
        raise APIError(400, f"{where}.content: must be a string or a list of text parts", "messages")
    for name in ("name", "reasoning_content"):            # the template calls string methods on them
        if message.get(name) is not None and not isinstance(message[name], str):
            raise APIError(400, f"{where}.{name}: must be a string", "messages")
    role = "system" if message["role"] == "developer" else message["role"]
    return {**{k: v for k, v in message.items() if k in ("name", "reasoning_content")}, "role": role, "content": content}


# --- the HTTP layer -------------------------------------------------------------------------------

def parse_body(raw: bytes, model_ids: Sequence[str]) -> dict[str, Any]:
    """The JSON object of a request body, checked as far as every endpoint needs (model: one of `model_ids`,
    or none, as vLLM takes it; stream)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as bad:
        raise APIError(400, f"request body: not valid JSON ({bad})") from None
    except RecursionError:
        raise APIError(400, "request body: JSON nested too deeply") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body: must be a JSON object")
    for name, value in body.items():
        # JSON may escape a lone surrogate (\ud800), which no UTF-8 text (tokenizer, reply, log) can hold.
        if not all(_encodable(text) for text in _strings([name, value])):
            field = name if _encodable(name) else None
            raise APIError(400, f"{field or 'a field name'}: not valid Unicode (a lone surrogate)", field)
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


def _strings(value: Any) -> Iterator[str]:
    """Every string in a JSON value, keys included; a loop, not recursion, however deep the nesting."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            pending.extend(item)
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def refusal(method: str, path: str, headers: dict[str, str], api_key: str | None,
            loopback_only: bool) -> APIError | None:
    """Why a request may not be served at all (before its body is read), or None."""
    if loopback_only and not LOOPBACK_HOST.fullmatch(headers.get("host", "")):
        # A page on a rebound DNS name reaches us under that name: only loopback names are ours.
        return APIError(400, "Host: this server answers only to localhost, 127.0.0.1 and [::1]", code="invalid_host")
    if api_key is not None and path != "/health" and not is_page(path):
        scheme, _, key = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), api_key.encode()):
            return APIError(401, "Incorrect API key provided: send `Authorization: Bearer KEY`",
                            code="invalid_api_key")
    if method == "POST" and headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
        # A page on any site may POST text/plain or a form here without the browser asking first.
        return APIError(415, "Content-Type: must be application/json")
    return None


def log_line(method: str, path: str, status: int, usage: dict[str, int] | None, seconds: float) -> str:
    """One request's line in the log: what was asked, the answer's status, tokens, time."""
    tokens = (f" prompt_tokens={usage['prompt_tokens']} completion_tokens={usage['completion_tokens']}"
              if usage is not None else "")
    return f"{method} {path} {status}{tokens} {seconds:.3f}s"


def create_app(service: Service, *, api_key: str | None = None, loopback_only: bool = True,
               log: bool = True) -> Any:
    """The ASGI application serving `service`: Starlette's routes behind the checks of `refusal`, each
    request logged on stderr when `log`."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect
    from starlette.requests import Request as HTTPRequest
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route
    from starlette.types import Message as ASGIMessage
    from starlette.types import Receive, Scope, Send

    def error(problem: APIError) -> Response:
        return JSONResponse(problem.body(), status_code=problem.status)

    async def read_raw(http: HTTPRequest) -> bytes:
        """The body, refused (413) as soon as it is known to pass MAX_BODY_BYTES."""
        declared = http.headers.get("content-length", "")
        chunks: list[bytes] = []
        size = int(declared) if declared.isdigit() else 0
        if size <= MAX_BODY_BYTES:
            size = 0
            async for chunk in http.stream():
                chunks.append(chunk)
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    break
        if size > MAX_BODY_BYTES:
            raise APIError(413, f"request body: larger than {MAX_BODY_BYTES} bytes", code="request_too_large")
        return b"".join(chunks)

    async def read_body(http: HTTPRequest) -> dict[str, Any]:
        try:
            raw = await asyncio.wait_for(read_raw(http), BODY_SECONDS)
        except asyncio.TimeoutError:
            raise APIError(408, f"request body: not received within {BODY_SECONDS:g}s") from None
        return await run_in_threadpool(parse_body, raw, service.model_ids)

    def endpoint(chat: bool) -> Callable[[HTTPRequest], Any]:
        async def handle(http: HTTPRequest) -> Response:
            try:
                body = await read_body(http)
                # Tokenising and templating take time in proportion to the prompt: on worker threads,
                # they hold up no other client and no /health.
                if chat:
                    prompt, thinking = await run_in_threadpool(service.chat_prompt, body)
                else:
                    prompt, thinking = await run_in_threadpool(service.completion_prompt, body), None
                request = service.request(body, prompt, thinking)
                reply = Reply(service, request, chat)
                http.state.usage = reply.usage
                if body.get("stream"):
                    usage = bool((body.get("stream_options") or {}).get("include_usage"))
                    return StreamingResponse(reply.stream(usage), media_type="text/event-stream",
                                             headers={"Cache-Control": "no-cache"})
                return JSONResponse(await reply.whole(http))
            except APIError as problem:
                return error(problem)
            except QwenNPError as problem:
                return error(api_error(problem))
            except ClientDisconnect:
                return error(APIError(499, "client disconnected"))
            except Exception as problem:        # a bug: say so in one line, keep serving
                print(f"serve: internal error: {type(problem).__name__}: {problem}", file=sys.stderr)
                return error(APIError(500, f"internal error: {type(problem).__name__}", kind="server_error"))
        return handle

    async def models(http: HTTPRequest) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "created": service.created,
                                                         "owned_by": "qwen_np"} for name in service.model_ids]})

    async def health(http: HTTPRequest) -> Response:
        generator = service.runner.generator
        return JSONResponse({"status": "ok", "running": len(generator.rows), "waiting": generator.waiting})

    async def metrics(http: HTTPRequest) -> Response:
        return Response(prometheus_text(service.runner.generator), media_type=PROMETHEUS_TYPE)

    async def http_error(http: HTTPRequest, problem: Exception) -> Response:
        status = problem.status_code if isinstance(problem, HTTPException) else 500
        what = {404: f"no route {http.url.path}", 405: f"{http.method} is not allowed on {http.url.path}"}
        return error(APIError(status, what.get(status, str(getattr(problem, "detail", "error")))))

    routes = Starlette(routes=[Route("/v1/models", models, methods=["GET"]), Route("/health", health, methods=["GET"]),
                               Route("/metrics", metrics, methods=["GET"]),
                               Route("/v1/chat/completions", endpoint(chat=True), methods=["POST"]),
                               Route("/v1/completions", endpoint(chat=False), methods=["POST"]),
                               *Explorer(service).routes(read_body, error)],      # the page at / (explorer.py)
                       exception_handlers={HTTPException: http_error})

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await routes(scope, receive, send)
        started, status = time.perf_counter(), 0

        async def sending(message: ASGIMessage) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}
        problem = refusal(scope["method"], scope["path"], headers, api_key, loopback_only)
        try:
            await (error(problem) if problem is not None else routes)(scope, receive, sending)
        finally:
            if log:
                usage = scope.get("state", {}).get("usage")
                print(log_line(scope["method"], scope["path"], status, usage() if usage else None,
                               time.perf_counter() - started), file=sys.stderr, flush=True)

    return app


class Reply:
    """One request's row in the batch, its events arriving on this event loop, shaped as OpenAI's
    chat.completion / text_completion objects or their stream chunks."""

    def __init__(self, service: Service, request: Request, chat: bool) -> None:
        self.service, self.request, self.chat = service, request, chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.events: asyncio.Queue[TokenEvent | BaseException] = asyncio.Queue()
        self.row: Row | None = None
        self.completion_tokens = 0

    def _submit(self) -> None:
        loop = asyncio.get_running_loop()

        def hand_over(event: TokenEvent | BaseException) -> None:      # on the batching thread
            with contextlib.suppress(RuntimeError):                      # the loop closed: server shutting down
                loop.call_soon_threadsafe(self.events.put_nowait, event)

        self.row = self.service.runner.submit(self.request, hand_over)

    async def _next(self) -> TokenEvent:
        event = await self.events.get()
        if isinstance(event, QwenNPError):      # this request's own sampling failed (batching ends it alone)
            raise api_error(event)
        if isinstance(event, BaseException):
            raise APIError(500, f"generation failed: {type(event).__name__}: {event}", kind="server_error")
        self.completion_tokens += 1
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
        if self.service.runner.generator.speculation is not None and sequence is not None:
            usage |= usage_fields(sequence.target_steps, sequence.drafted_tokens, sequence.accepted_tokens,
                                  self.completion_tokens)
        return usage

    def _object(self, kind: str, choice: dict[str, Any], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.service.model_id,
                "choices": [{"index": 0, **choice, "logprobs": None}] if choice else [], **extra}

    async def whole(self, http: Any) -> dict[str, Any]:
        """The non-streamed response. Nothing cancels a plain request when its client leaves, so the
        wait looks for a disconnect now and then, and cancels the row then."""
        self._submit()
        pieces, finish = [], None
        try:
            while finish is None:
                try:
                    event = await asyncio.wait_for(self._next(), DISCONNECT_POLL_SECONDS)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        raise APIError(499, "client disconnected") from None
                    continue
                pieces.append(event.text)
                finish = event.finish_reason
        finally:
            if finish is None and self.row is not None:
                self.service.runner.cancel(self.row)
        text, reason = "".join(pieces), FINISH[finish]
        choice = ({"message": assistant_message(text, self.service.split_reasoning), "finish_reason": reason} if self.chat
                  else {"text": text, "finish_reason": reason})
        return self._object("chat.completion" if self.chat else "text_completion", choice, usage=self.usage())

    async def stream(self, include_usage: bool) -> AsyncIterator[str]:
        """Server-Sent Events: one chunk per piece of text, the finish reason, [usage], [DONE]."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        extra = {"usage": None} if include_usage else {}

        splitter = ThinkingSplitter() if self.chat and self.service.split_reasoning else None

        def chunk(text: str | None, finish: str | None = None, role: bool = False, field: str = "content") -> str:
            if self.chat:
                names = ("reasoning_content", "reasoning") if field == "reasoning" else ("content",)
                delta = {"role": "assistant", "content": ""} if role else dict.fromkeys(names, text) if text else {}
                choice = {"delta": delta, "finish_reason": finish}
            else:
                choice = {"text": text or "", "finish_reason": finish}
            return _sse(self._object(kind, choice, **extra))

        try:
            if self.chat:
                yield chunk(None, role=True)
            async for event in self._events():
                if event.text and splitter is not None:
                    for field, text in splitter.feed(event.text):
                        yield chunk(text, field=field)
                elif event.text:
                    yield chunk(event.text)
                if event.finish_reason:
                    yield chunk(None, FINISH[event.finish_reason])
            if include_usage:
                yield _sse(self._object(kind, {}, usage=self.usage()))
        except APIError as problem:            # the stream has begun: the error goes in the stream
            yield _sse(problem.body())
        yield "data: [DONE]\n\n"


def assistant_message(text: str, split_reasoning: bool) -> dict[str, Any]:
    """The assistant message of a whole chat reply: Qwen3's thinking apart from its answer, under both names
    clients read (reasoning_content: llama-server's and DeepSeek's; reasoning: vLLM's), unless the server
    leaves replies as generated (--reasoning-format raw). Streamed replies split alike (ThinkingSplitter)."""
    if not split_reasoning or not text.startswith(THINK_OPEN):
        return {"role": "assistant", "content": text}
    reasoning, answer = split_thinking(text)
    return {"role": "assistant", "content": answer, "reasoning_content": reasoning, "reasoning": reasoning}


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
