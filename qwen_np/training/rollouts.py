"""Prompts and a user's reward function, for rewards a program can check (`eval --prompts --reward`; GRPO's
inputs): the prompts file read, the reward function loaded from FILE.py:FUNCTION and called, and pass@k.

A prompts line is {"messages": [...]} (a chat, rendered with the generation prompt) or {"prompt": "..."} (text),
with any other fields: they are passed to the reward function, `fn(prompt, completion, **row) -> float`, as
TRL passes a dataset's other columns to its reward functions. A reward that raises or is not a finite number
is one error naming the prompt's line.
"""

from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from . import chats
from ..errors import QwenNPError
from ..files.messages import MessageError, chat_message
from ..files.tokenizer import Tokenizer

Reward = Callable[..., Any]


@dataclass
class Prompt:
    """One prompts line: where it is, what the reward function is given as `prompt`, and the other fields."""

    where: str                      # FILE:LINE
    prompt: str | list[dict[str, Any]]
    fields: dict[str, Any]

    def ids(self, tokenizer: Tokenizer) -> list[int]:
        """The tokens the model continues: a chat rendered with the generation prompt, or the text."""
        if isinstance(self.prompt, str):
            return tokenizer.encode(self.prompt)
        if not tokenizer.has_chat_template:
            raise QwenNPError(f"{self.where}: messages: a chat prompt needs a model with a chat template")
        return tokenizer.encode_chat(self.prompt, add_generation_prompt=True)


def prompt_line(line: str, where: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise QwenNPError(f"{where}: not JSON ({exc.msg})") from exc
    if not isinstance(row, dict) or ("messages" in row) == ("prompt" in row):
        raise QwenNPError(f'{where}: expected {{"messages": [...]}} or {{"prompt": "..."}} (and any other fields)')
    if "prompt" in row and not isinstance(row["prompt"], str):
        raise QwenNPError(f"{where}: prompt: must be a string (a chat is \"messages\")")
    if "messages" in row:
        if not isinstance(row["messages"], list) or not row["messages"]:
            raise QwenNPError(f"{where}: messages: expected a list of messages")
        try:
            row["messages"] = [chat_message(message, index) for index, message in enumerate(row["messages"])]
        except MessageError as bad:
            raise QwenNPError(f"{where}: messages: {bad}") from None
    return {"where": where, **row}


def read_prompts(path: Path) -> list[Prompt]:
    rows = chats.read_lines(path, prompt_line, "prompts file", "prompts")
    return [Prompt(row.pop("where"), row.pop("prompt") if "prompt" in row else row.pop("messages"), row)
            for row in rows]


def load_reward(spec: str) -> Reward:
    """The function FUNCTION of the Python file FILE.py, from "FILE.py:FUNCTION"."""
    file, _, name = spec.rpartition(":")
    if not file or not name or not file.endswith(".py"):
        raise QwenNPError(f"expected FILE.py:FUNCTION, got {spec!r}", "reward")
    if not Path(file).is_file():
        raise QwenNPError(f"{file}: not found", "reward")
    loaded = importlib.util.spec_from_file_location(f"qwen_np_reward_{Path(file).stem}", file)
    if loaded is None or loaded.loader is None:
        raise QwenNPError(f"{file}: not a Python file", "reward")
    module = importlib.util.module_from_spec(loaded)
    try:
        loaded.loader.exec_module(module)
    except Exception as bad:                           # the user's file: whatever it raises is its error
        raise QwenNPError(f"{file}: raised {type(bad).__name__} when imported ({bad})", "reward") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise QwenNPError(f"{file} defines no function {name}", "reward")
    return function


def reward_of(reward: Reward, prompt: Prompt, completion: str) -> float:
    """reward(prompt, completion, **fields) as a float; a raise, a non-number or a NaN is one error naming the line."""
    try:
        value = reward(prompt.prompt, completion, **prompt.fields)
    except Exception as bad:                           # the user's function: whatever it raises is its error
        raise QwenNPError(f"{prompt.where}: the reward function raised {type(bad).__name__} ({bad}) on this "
                          "prompt", "reward") from None
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number):
        raise QwenNPError(f"{prompt.where}: the reward function returned {value!r} on this prompt, not a finite "
                          "number", "reward")
    return number


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from n samples of which c are correct (Chen et al. 2021):
    1 - C(n - c, k) / C(n, k), as a running product (the binomials overflow a float for large n)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))
