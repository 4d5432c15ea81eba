"""Exercise 1 (section 1): the token ids of a chat prompt.

A chat model reads its conversation in the layout of its chat template. Write `chat_prompt_ids`: the ids
Qwen3's tokenizer gives one user turn `message` written with the template, Qwen3's thinking switched off
(`tokenizer.apply_chat_template(messages, enable_thinking=False)`, then `tokenizer.encode`). The check
compares your ids with the template's on several messages (the real Qwen3 tokenizer: `--model`), and
says how many of them are the message itself.
"""

from __future__ import annotations

from typing import Any


def chat_prompt_ids(tokenizer: Any, message: str) -> list[int]:
    """The ids of [{"role": "user", "content": message}] in the chat template, thinking off."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": message}], enable_thinking=False)
    return list(tokenizer.encode(text))
