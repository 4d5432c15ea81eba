"""The ASGI application: Starlette's routes behind the access checks, the body read within its limits, each
request handled on worker threads where it tokenises, answered with OpenAI's JSON (errors too: nothing
answers with a traceback; Anthropic's error JSON on its routes), and logged in one line on stderr.

    GET  /v1/models            the served names
    POST /v1/chat/completions  bodies.read_chat -> requests.Service -> choices.Choices of responses.Reply (whole or streamed)
    POST /v1/completions       bodies.read_completion -> requests.Service -> choices.Choices of responses.Reply
    POST /v1/responses         openai_responses.read_responses -> requests.Service -> openai_responses.Answer of a Reply
    POST /v1/embeddings        bodies.read_embedding -> embeddings.embedding_job -> embeddings.embeddings
    POST /v1/rerank, /rerank   bodies.read_rerank -> rerank.rerank_job -> rerank.reranked
    POST /tokenize, /detokenize bodies.read_tokenize, read_token_ids -> tokens.tokenized, detokenized
    POST /v1/messages          messages.read_messages -> requests.Service -> messages.MessageReply (Anthropic's API)
    POST /v1/messages/count_tokens  messages.read_messages -> the prompt's tokens
    GET  /health               running and waiting requests
    GET  /metrics              metrics.prometheus_text
    GET  /  /web/...           the page, and its endpoints under /explorer/ (explorer.py)
    GET  /docs/walkthrough     the walkthrough as HTML, its figures under /docs/figures/ (docs.py)

Imports access, bodies, requests, responses, choices, openai_responses, messages, embeddings, rerank, tokens,
explorer and metrics of serving/ (above them all but launch.py).
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any, Callable

from ..errors import APIError, QwenNPError
from .access import PAGE_HEADERS, is_page, log_line, loggable, refusal
from .embeddings import embedding_job, embeddings
from .embeddings import usage as embedding_usage
from .explorer import Explorer
from .metrics import PROMETHEUS_TYPE, prometheus_text
from .rerank import rerank_job, reranked
from .tokens import detokenized, tokenized
from .bodies import (ChatBody, CompletionBody, check_fields, parse_body, read_chat, read_completion, read_embedding,
                     read_rerank, read_token_ids, read_tokenize)
from .requests import Service, api_error
from .choices import Choices, choice_requests, echo_of
from .messages import COUNT_PATH, PATH, MessageReply, count_tokens, error_body, is_messages, message_request, read_messages
from .openai_responses import Answer, Store, conversation, read_responses, renamed
from .responses import Reply

# A request body above this is refused (413) unread: a prompt that fills even a 40960-token context
# with the longest tokens (128 characters) takes about 5 MiB of JSON.
MAX_BODY_BYTES = 8 * 2**20
# A client must send its whole body within this (408 otherwise), so a half-sent request does not hold
# its connection and handler open forever (protocol.py bounds the headers and the idle time).
BODY_SECONDS = 10.0
PAGE_HEADER_LINES = [(name.lower().encode(), value.encode()) for name, value in PAGE_HEADERS.items()]


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

    stored = Store()                  # /v1/responses' last responses, for previous_response_id (in memory)

    def error(problem: APIError, anthropic: bool = False) -> Response:
        """OpenAI's error JSON, or Anthropic's on its routes (messages.is_messages)."""
        return JSONResponse(error_body(problem) if anthropic else problem.body(), status_code=problem.status)

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
        """The body, its `model` one of served_names: the base's, or an adapter's (each endpoint runs it)."""
        try:
            raw = await asyncio.wait_for(read_raw(http), BODY_SECONDS)
        except asyncio.TimeoutError:
            raise APIError(408, f"request body: not received within {BODY_SECONDS:g}s") from None
        return await run_in_threadpool(parse_body, raw, service.served_names)

    async def fields_for(http: HTTPRequest, path: str) -> dict[str, Any]:
        """The body's fields, each one `path` does not read refused by name (bodies.check_fields)."""
        fields = await read_body(http)
        check_fields(fields, path)
        return fields

    def guarded(respond: Callable[[HTTPRequest], Any], anthropic: bool = False) -> Callable[[HTTPRequest], Any]:
        """The handler answering with `respond`'s response, or OpenAI's error JSON for what it raised
        (Anthropic's, `anthropic`)."""
        async def handle(http: HTTPRequest) -> Response:
            try:
                return await respond(http)
            except APIError as problem:
                return error(problem, anthropic)
            except QwenNPError as problem:
                return error(api_error(problem), anthropic)
            except ClientDisconnect:
                return error(APIError(499, "client disconnected"), anthropic)
            except Exception as problem:        # a bug: say so in one line, keep serving
                print(loggable(f"serve: internal error: {type(problem).__name__}: {problem}"), file=sys.stderr)
                return error(APIError(500, f"internal error: {type(problem).__name__}", kind="server_error"), anthropic)
        return handle

    def endpoint(chat: bool) -> Callable[[HTTPRequest], Any]:
        path = "/v1/chat/completions" if chat else "/v1/completions"

        async def respond(http: HTTPRequest) -> Response:
            fields = await fields_for(http, path)
            service.check_generates()
            # Reading, tokenising and templating take time in proportion to the prompt: on worker threads,
            # they hold up no other client and no /health. So does a grammar, compiled in time that grows
            # with its schema (Service.request).
            body: ChatBody | CompletionBody
            if chat:
                body = await run_in_threadpool(read_chat, fields, service.limits)
                prompt = await run_in_threadpool(service.chat_prompt, body)
            else:
                body = await run_in_threadpool(read_completion, fields, service.limits)
                prompt = await run_in_threadpool(service.completion_prompt, body)
            request = await run_in_threadpool(service.request, body, prompt)
            echo = await echo_of(service, body, request, http) if isinstance(body, CompletionBody) else None
            reply = Choices(service, body, choice_requests(body, request), echo)
            http.state.usage = reply.usage
            if body.stream:
                return StreamingResponse(reply.stream(body.include_usage), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
            return JSONResponse(await reply.whole(http))
        return guarded(respond)

    async def respond_responses(http: HTTPRequest) -> Response:
        fields = await fields_for(http, "/v1/responses")
        service.check_generates()
        items = conversation(fields, stored)
        body = await run_in_threadpool(read_responses, fields, service.limits, items)
        try:
            prompt = await run_in_threadpool(service.chat_prompt, body)
            request = await run_in_threadpool(service.request, body, prompt)
        except APIError as problem:
            raise renamed(problem) from None
        answer = Answer(service, body, fields, Reply(service, request, chat=True, calls=body.calls), stored, items)
        http.state.usage = answer.reply.usage
        if body.stream:
            return StreamingResponse(answer.stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return JSONResponse(await answer.whole(http))

    async def embed(http: HTTPRequest) -> Response:
        fields = await fields_for(http, "/v1/embeddings")
        body = read_embedding(fields, service.limits)
        job = await run_in_threadpool(embedding_job, service, body)      # tokenising: off the event loop
        http.state.usage = lambda: {**embedding_usage(job), "completion_tokens": 0}
        return JSONResponse(await embeddings(service, job, body, http))

    async def rerank(http: HTTPRequest) -> Response:
        fields = await fields_for(http, "/v1/rerank")
        body = read_rerank(fields, service.limits)
        job = await run_in_threadpool(rerank_job, service, body)          # tokenising: off the event loop
        http.state.usage = lambda: {"prompt_tokens": job.tokens, "total_tokens": job.tokens, "completion_tokens": 0}
        return JSONResponse(await reranked(service, job, body, http))

    async def tokenize(http: HTTPRequest) -> Response:
        fields = await fields_for(http, "/tokenize")
        body = await run_in_threadpool(read_tokenize, fields, service.limits)
        return JSONResponse(await run_in_threadpool(tokenized, service, body))

    async def detokenize(http: HTTPRequest) -> Response:
        fields = await fields_for(http, "/detokenize")
        return JSONResponse(detokenized(service, read_token_ids(fields, service.limits)))

    async def messages(http: HTTPRequest) -> Response:
        """Anthropic's Messages API (messages.py): its body read into a chat's, its reply shaped as Anthropic's."""
        fields = await fields_for(http, PATH)
        service.check_generates()
        body = await run_in_threadpool(read_messages, fields, service.limits)
        prompt = await run_in_threadpool(service.chat_prompt, body)
        request = await run_in_threadpool(message_request, service, body, prompt)
        reply = MessageReply(service, body, request)
        http.state.usage = reply.usage
        if body.stream:
            return StreamingResponse(reply.events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return JSONResponse(await reply.whole(http))

    async def count(http: HTTPRequest) -> Response:
        fields = await fields_for(http, COUNT_PATH)
        body = await run_in_threadpool(read_messages, fields, service.limits, True)
        return JSONResponse(await run_in_threadpool(count_tokens, service, body))

    async def models(http: HTTPRequest) -> Response:
        listed = [{"id": name, "object": "model", "created": service.created, "owned_by": "qwen_np"}
                  for name in service.model_ids]
        listed += [{"id": name, "object": "model", "created": service.created, "owned_by": "qwen_np",
                    "parent": service.model_id} for name in service.adapters]      # an adapter's base, as vLLM's
        return JSONResponse({"object": "list", "data": listed})

    async def health(http: HTTPRequest) -> Response:
        return JSONResponse(service.health())

    async def metrics(http: HTTPRequest) -> Response:
        return Response(prometheus_text(service.generator), media_type=PROMETHEUS_TYPE)

    async def http_error(http: HTTPRequest, problem: Exception) -> Response:
        status = problem.status_code if isinstance(problem, HTTPException) else 500
        what = {404: f"no route {http.url.path}", 405: f"{http.method} is not allowed on {http.url.path}"}
        return error(APIError(status, what.get(status, str(getattr(problem, "detail", "error")))),
                     is_messages(http.url.path))

    routes = Starlette(routes=[Route("/v1/models", models, methods=["GET"]), Route("/health", health, methods=["GET"]),
                               Route("/metrics", metrics, methods=["GET"]),
                               Route("/v1/chat/completions", endpoint(chat=True), methods=["POST"]),
                               Route("/v1/completions", endpoint(chat=False), methods=["POST"]),
                               Route("/v1/responses", guarded(respond_responses), methods=["POST"]),
                               Route("/v1/embeddings", guarded(embed), methods=["POST"]),
                               *(Route(path, guarded(rerank), methods=["POST"]) for path in ("/v1/rerank", "/rerank")),
                               Route("/tokenize", guarded(tokenize), methods=["POST"]),
                               Route("/detokenize", guarded(detokenize), methods=["POST"]),
                               Route(PATH, guarded(messages, anthropic=True), methods=["POST"]),
                               Route(COUNT_PATH, guarded(count, anthropic=True), methods=["POST"]),
                               *Explorer(service).routes(read_body, error)],      # the page at / (explorer.py)
                       exception_handlers={HTTPException: http_error})

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await routes(scope, receive, send)
        started, status = time.perf_counter(), 0
        page = is_page(scope["path"])

        async def sending(message: ASGIMessage) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if page:                # every response of the page, whichever route or file it comes from
                    message = {**message, "headers": [*message.get("headers", []), *PAGE_HEADER_LINES]}
            await send(message)

        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}
        problem = refusal(scope["method"], scope["path"], headers, api_key, loopback_only)
        try:
            await (error(problem, is_messages(scope["path"])) if problem is not None else routes)(scope, receive, sending)
        finally:
            if log:
                usage = scope.get("state", {}).get("usage")
                print(log_line(scope["method"], scope["path"], status, usage() if usage else None,
                               time.perf_counter() - started), file=sys.stderr, flush=True)

    return app
