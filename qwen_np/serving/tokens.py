"""POST /tokenize and /detokenize, as vLLM and llama-server shape them (one route serves both: their bodies
differ by field, and the answer carries both's keys):

    /tokenize   {"prompt" | "content": text} or {"messages": [...]}  -> {"tokens", "count", "max_model_len"}
                (with_pieces: llama-server's [{"id", "piece"}] as tokens)
    /detokenize {"tokens": [ids]}                                    -> {"prompt", "content"}: the text

A text's special-token strings are those tokens, as a completion's prompt reads them; messages are rendered
by the checkpoint's template, as a chat's are (Tokenizer.encode_chat). Tokenising runs on a worker thread,
as every request's does.

Imports bodies.py and requests.py of serving/.
"""

from __future__ import annotations

from typing import Any

from .bodies import TokenizeBody
from .requests import Service


def tokenized(service: Service, body: TokenizeBody) -> dict[str, Any]:
    """The /tokenize answer: the ids of the body's text or conversation."""
    tokenizer = service.tokenizer
    if body.conversation is not None:
        tools = body.conversation.tools.declared if body.conversation.tools else None
        ids = tokenizer.encode_chat(list(body.conversation.messages), add_generation_prompt=body.add_generation_prompt,
                                    enable_thinking=body.conversation.thinking, tools=tools)
    else:
        ids = tokenizer.encode(body.text or "", parse_special=True)
    tokens: list[Any] = ([{"id": i, "piece": tokenizer.decode([i])} for i in ids] if body.with_pieces else ids)
    return {"tokens": tokens, "count": len(ids), "max_model_len": service.context}


def detokenized(service: Service, ids: list[int]) -> dict[str, str]:
    """The /detokenize answer: the ids' text, under vLLM's key and llama-server's."""
    text = service.tokenizer.decode(ids)
    return {"prompt": text, "content": text}
