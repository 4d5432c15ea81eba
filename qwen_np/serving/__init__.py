"""Serving: `python -m qwen_np serve`, an OpenAI-compatible HTTP API, every request's decode steps batched
together, and the web page that explores the forward pass.

    python -m qwen_np serve --model Qwen/Qwen3-0.6B          # http://127.0.0.1:8000/v1

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
    client.chat.completions.create(model="Qwen/Qwen3-0.6B", messages=[{"role": "user", "content": "Hi"}])

Endpoints: GET /v1/models, POST /v1/chat/completions, POST /v1/completions, POST /v1/responses (streamed as
Server-Sent Events or not), POST /v1/embeddings (a checkpoint without an LM head, such as Qwen3-Embedding,
serves only these), POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API), POST
/v1/rerank, POST /tokenize and /detokenize, GET /health (with the number of running and waiting requests),
GET /metrics (those, the KV cache's blocks, prefix cache hits, tokens and preemptions, in Prometheus' text
format), and a web page at / with an explorer of the forward pass and a playground (its endpoints under
/explorer/).
--served-model-name gives the model the names clients ask for (several: aliases, as vLLM's; the first
answers in responses); a request without `model` gets the served one. A model whose tokenizer has no
chat template (the bundled Shakespeare model) serves completions, and answers chat requests with a 400
that says so.

Every request becomes a row of one batching.BatchGenerator, run by a BatchRunner on its own thread:
concurrent requests share decode steps, a new one starts its prefill at the next step, and a client
that disconnects frees its row. Bad requests get OpenAI's error JSON with a 4xx status; nothing answers
with a traceback.

The modules, one job each, in the order they import one another (each only those before it):
    access.py     who may be served (Host, API key, JSON-only POSTs), the page's paths and headers, the log line
    protocol.py   the HTTP connection: uvicorn's h11 protocol with a deadline for each request's headers
    finite.py     a response's numbers finite, or the request refused (422) naming the token the model fails on
    structured.py a chat's tools, tool_choice and response_format as the grammar its reply follows
    bodies.py     a request body read once: JSON within limits, the field catalogue, each endpoint's
                  fields checked into a frozen object (ChatBody, CompletionBody, EmbeddingBody)
    requests.py   a body made into a batch row (Service): the room for max_tokens, sampling, the grammar
    responses.py  a row's token events shaped as OpenAI's objects and stream chunks (Reply), tool calls and
                  log-probabilities included
    choices.py    a request's rows as one response: n choices, best_of, a completion's echo (its prompt scored)
    messages.py   Anthropic's Messages API (/v1/messages, count_tokens): its body read into a chat's, the reply
                  shaped as Anthropic's message or stream events, its errors in Anthropic's shape
    openai_responses.py  /v1/responses, OpenAI's Responses API: its body read into a ChatBody, the reply shaped
                  as a Response object or its stream of events
    embeddings.py /v1/embeddings: inputs checked, their forward passes between the batch's steps
    rerank.py     /v1/rerank: Qwen3-Reranker's scores of documents for a query, run as embeddings are
    tokens.py     /tokenize and /detokenize, as vLLM and llama-server shape them
    metrics.py    GET /metrics in Prometheus' text format
    docs.py       the walkthrough and its glossary as HTML pages (markdown-it-py), and their figures
    explorer.py   the web page's endpoints (one traced forward pass as JSON) and files (web/)
    app.py        the ASGI application: routes behind the access checks, bodies read within limits
    launch.py     load the model, size the KV cache, run the app on uvicorn (commands/serve.py calls it)

The HTTP stack is Starlette on uvicorn (the `serve` extra): both small and well kept (Encode's; the
ASGI stack FastAPI and vLLM's server stand on), Starlette needs only anyio and uvicorn only h11 and
click. They give us HTTP/1.1 keep-alive, streaming responses, and a disconnect signal that cancels a
stream, which the standard library's http.server would leave to hand-written code.

May import: everything below the commands (generation/, inspection/, engine/, files/, core/, numbers/,
qwen_np.errors).
"""
