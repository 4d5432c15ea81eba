"""`python -m qwen_np serve`: an OpenAI-compatible HTTP API, every request's decode steps batched together.

    python -m qwen_np serve --model Qwen/Qwen3-0.6B          # http://127.0.0.1:8000/v1

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
    client.chat.completions.create(model="Qwen/Qwen3-0.6B", messages=[{"role": "user", "content": "Hi"}])

Endpoints: GET /v1/models, POST /v1/chat/completions, POST /v1/completions (streamed as Server-Sent
Events or not), GET /health (with the number of running and waiting requests). The request fields
and the response shapes are OpenAI's (OpenAI's API reference for chat completions and completions); Qwen3's
thinking switch comes as vLLM takes it, `chat_template_kwargs: {"enable_thinking": false}`, and the
sampling fields vLLM adds (top_k, min_p, repetition_penalty) are accepted too. Defaults come from the
checkpoint's generation_config.json, as in vLLM; max_tokens defaults to what the context has left.
A model whose tokenizer has no chat template (the bundled Shakespeare model) serves completions, and
answers chat requests with a 400 that says so.

Every request becomes a row of one batching.BatchGenerator, run by a BatchRunner on its own thread:
concurrent requests share decode steps, a new one starts its prefill at the next step, and a client
that disconnects frees its row. Bad requests get OpenAI's error JSON with a 4xx status; nothing
answers with a traceback.

The HTTP stack is Starlette on uvicorn (the `serve` extra): both small and well kept (Encode's; the
ASGI stack FastAPI and vLLM's server stand on), Starlette needs only anyio and uvicorn only h11 and
click. They give us HTTP/1.1 keep-alive, streaming responses, and a disconnect signal that cancels a
stream, which the standard library's http.server would leave to hand-written code.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from . import runtime
from .batching import BatchGenerator, BatchRunner, Request, Row
from .checkpoint import resolve_model_path
from .config import load_config
from .errors import QwenNPError
from .finite import check_weights_finite
from .generate import GenerationDefaults, TokenEvent, read_generation_defaults, resolve_sampling
from .loading import load_model
from .memory import DEFAULT_CONTEXT, MODES
from .tokenizer import Message, Tokenizer

DEFAULT_HOST, DEFAULT_PORT, DEFAULT_MAX_BATCH = "127.0.0.1", 8000, 8
# Our finish reasons -> OpenAI's: the model ended or a stop string was met -> "stop"; a token limit -> "length".
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}
ROLES = ("system", "developer", "user", "assistant", "tool")
# Fields we do not implement: refused when set to anything but their "off" value, so nobody gets a
# silently different answer than they asked for.
UNSUPPORTED = {"logprobs": (None, False), "top_logprobs": (None, 0), "tools": (None, []), "tool_choice": (None, "none"),
               "response_format": (None, {"type": "text"}), "frequency_penalty": (None, 0), "logit_bias": (None, {}),
               "echo": (None, False), "suffix": (None, ""), "best_of": (None, 1)}
DISCONNECT_POLL_SECONDS = 0.5


# --- the command line ------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint folder or Hugging Face hub id, e.g. Qwen/Qwen3-0.6B; "
                                                       "clients ask for it by this name")
    parser.add_argument("--host", default=DEFAULT_HOST,
                        help=f"address to listen on (default: {DEFAULT_HOST}, this machine only; 0.0.0.0 opens it "
                             "to the network, with no authentication)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default: {DEFAULT_PORT}; 0 picks a free one)")
    parser.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH, metavar="N",
                        help=f"requests decoded together in one batch; more wait for a free row "
                             f"(default: {DEFAULT_MAX_BATCH})")
    parser.add_argument("-c", "--ctx-size", type=int, metavar="N",
                        help=f"context of each request, prompt and reply together (default: {DEFAULT_CONTEXT}, or "
                             "the model's if smaller)")
    parser.add_argument("--memory", choices=MODES, default="auto",
                        help="fp32 upcasts every weight at load (fastest), bf16 keeps them as stored (half the RAM), "
                             "auto picks fp32 when it fits (default: auto)")
    parser.add_argument("-t", "--threads", type=int, default=runtime.usable_cores(), metavar="N",
                        help=f"threads for the matrix products (default: all {runtime.usable_cores()} cores)")


def run(args: argparse.Namespace) -> int:
    """Load the model, listen, serve until Ctrl-C (or SIGTERM)."""
    try:
        import uvicorn
    except ImportError:
        raise QwenNPError("serve: needs the `serve` extra (pip install 'qwen_np[serve]': starlette, uvicorn)") from None
    if args.max_batch < 1:
        raise QwenNPError(f"--max-batch: must be >= 1, got {args.max_batch}")
    if not 0 <= args.port <= 65535:
        raise QwenNPError(f"--port: must be in 0..65535, got {args.port}")
    folder = resolve_model_path(args.model)
    config = load_config(folder)
    context = min(args.ctx_size or DEFAULT_CONTEXT, config.max_position_embeddings)
    if context < 2:
        raise QwenNPError(f"--ctx-size: must be >= 2, got {args.ctx_size}")
    tokenizer, defaults = Tokenizer.from_folder(folder), read_generation_defaults(folder, config)
    try:
        listener = socket.create_server((args.host, args.port))
    except OSError as error:
        raise QwenNPError(f"--host/--port: cannot listen on {args.host}:{args.port} ({error.strerror})") from None
    model = load_model(folder, memory=args.memory, max_tokens=context)
    check_weights_finite(model)
    generator = BatchGenerator(model, tokenizer, eos_token_ids=defaults.eos_token_ids, max_batch=args.max_batch,
                               context=context)
    service = Service(args.model, tokenizer, defaults, BatchRunner(generator), context)
    host, port = listener.getsockname()[:2]
    address = f"http://{'[' + host + ']' if ':' in host else host}:{port}/v1"
    print(f"serving {args.model} on {address} (max batch {args.max_batch}, context {context}); Ctrl-C stops",
          file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(create_app(service), log_level="warning", timeout_graceful_shutdown=2))
    service.runner.start()
    try:
        server.run(sockets=[listener])
    finally:
        service.runner.stop()
    return 0


# --- requests -> batch rows -----------------------------------------------------------------------

class APIError(Exception):
    """A request the server answers with OpenAI's error JSON: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Service:
    """What every request needs: the model's name, its tokenizer and defaults, the batch runner."""

    model_id: str
    tokenizer: Tokenizer
    defaults: GenerationDefaults
    runner: BatchRunner
    context: int
    created: int = int(time.time())

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
            raise APIError(400, f"This model's maximum context length is {self.context} tokens. However, you requested "
                                f"{len(prompt) + (max_tokens or 1)} tokens ({len(prompt)} in the messages, "
                                f"{max_tokens or 1} in the completion). Please reduce the length of the messages or "
                                "completion.", "messages" if "messages" in body else "prompt", "context_length_exceeded")
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
            raise APIError(400, str(bad).lstrip("-")) from None
        return Request(prompt, params, max_tokens or room, _stops(body))

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
        try:
            text = self.tokenizer.apply_chat_template([_message(m, i) for i, m in enumerate(messages)],
                                                      add_generation_prompt=True, enable_thinking=thinking)
        except QwenNPError as bad:
            raise APIError(400, f"messages: {bad}", "messages") from None
        return self.tokenizer.encode(text), thinking

    def completion_prompt(self, body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]                                  # a batch of one prompt
        if isinstance(prompt, str) and prompt:
            return self.tokenizer.encode(prompt)
        vocab = self.tokenizer.vocab_size
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
            return list(prompt)                                 # token ids
        raise APIError(400, "prompt: must be a non-empty string or list of token ids (one prompt per request)", "prompt")


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
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise APIError(400, "stop: must be a string or a list of strings", "stop")
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
    role = "system" if message["role"] == "developer" else message["role"]
    return {**{k: v for k, v in message.items() if k in ("name", "reasoning_content")}, "role": role, "content": content}


# --- the HTTP layer -------------------------------------------------------------------------------

def create_app(service: Service) -> Any:
    """The Starlette application serving `service`."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request as HTTPRequest
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    def error(problem: APIError) -> Response:
        return JSONResponse(problem.body(), status_code=problem.status)

    async def read_body(http: HTTPRequest) -> dict[str, Any]:
        try:
            body = json.loads(await http.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as bad:
            raise APIError(400, f"request body: not valid JSON ({bad})") from None
        if not isinstance(body, dict):
            raise APIError(400, "request body: must be a JSON object")
        if body.get("model") != service.model_id:
            raise APIError(404, f"The model `{body.get('model')}` does not exist (this server has `{service.model_id}`).",
                           "model", "model_not_found")
        stream = body.get("stream")
        if stream not in (None, True, False):
            raise APIError(400, "stream: must be true or false", "stream")
        options = body.get("stream_options")
        if options is not None and (not stream or not isinstance(options, dict)):
            raise APIError(400, "stream_options: only allowed with stream: true, as an object", "stream_options")
        return body

    def endpoint(chat: bool) -> Callable[[HTTPRequest], Any]:
        async def handle(http: HTTPRequest) -> Response:
            try:
                body = await read_body(http)
                if chat:
                    prompt, thinking = service.chat_prompt(body)
                else:
                    prompt, thinking = service.completion_prompt(body), None
                request = service.request(body, prompt, thinking)
                reply = Reply(service, request, chat)
                if body.get("stream"):
                    usage = bool((body.get("stream_options") or {}).get("include_usage"))
                    return StreamingResponse(reply.stream(usage), media_type="text/event-stream",
                                             headers={"Cache-Control": "no-cache"})
                return JSONResponse(await reply.whole(http))
            except APIError as problem:
                return error(problem)
            except QwenNPError as problem:
                return error(APIError(400, str(problem)))
            except Exception as problem:        # a bug: say so in one line, keep serving
                print(f"serve: internal error: {type(problem).__name__}: {problem}", file=sys.stderr)
                return error(APIError(500, f"internal error: {type(problem).__name__}", kind="server_error"))
        return handle

    async def models(http: HTTPRequest) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": service.model_id, "object": "model",
                                                         "created": service.created, "owned_by": "qwen_np"}]})

    async def health(http: HTTPRequest) -> Response:
        generator = service.runner.generator
        return JSONResponse({"status": "ok", "running": len(generator.rows), "waiting": generator.waiting})

    async def http_error(http: HTTPRequest, problem: Exception) -> Response:
        status = problem.status_code if isinstance(problem, HTTPException) else 500
        what = {404: f"no route {http.url.path}", 405: f"{http.method} is not allowed on {http.url.path}"}
        return error(APIError(status, what.get(status, str(getattr(problem, "detail", "error")))))

    return Starlette(routes=[Route("/v1/models", models, methods=["GET"]), Route("/health", health, methods=["GET"]),
                             Route("/v1/chat/completions", endpoint(chat=True), methods=["POST"]),
                             Route("/v1/completions", endpoint(chat=False), methods=["POST"])],
                     exception_handlers={HTTPException: http_error})


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

    def usage(self) -> dict[str, int]:
        prompt = len(self.request.prompt)
        return {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt + self.completion_tokens}

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
        choice = ({"message": {"role": "assistant", "content": text}, "finish_reason": reason} if self.chat
                  else {"text": text, "finish_reason": reason})
        return self._object("chat.completion" if self.chat else "text_completion", choice, usage=self.usage())

    async def stream(self, include_usage: bool) -> AsyncIterator[str]:
        """Server-Sent Events: one chunk per piece of text, the finish reason, [usage], [DONE]."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        extra = {"usage": None} if include_usage else {}

        def chunk(text: str | None, finish: str | None = None, role: bool = False) -> str:
            if self.chat:
                delta = {"role": "assistant", "content": ""} if role else {"content": text} if text else {}
                choice = {"delta": delta, "finish_reason": finish}
            else:
                choice = {"text": text or "", "finish_reason": finish}
            return _sse(self._object(kind, choice, **extra))

        try:
            if self.chat:
                yield chunk(None, role=True)
            async for event in self._events():
                if event.text:
                    yield chunk(event.text)
                if event.finish_reason:
                    yield chunk(None, FINISH[event.finish_reason])
            if include_usage:
                yield _sse(self._object(kind, {}, usage=self.usage()))
        except APIError as problem:            # the stream has begun: the error goes in the stream
            yield _sse(problem.body())
        yield "data: [DONE]\n\n"


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
