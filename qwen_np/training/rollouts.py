"""Prompts and a user's reward function, for rewards a program can check (`eval --prompts --reward`; GRPO's
inputs): the prompts file read, the reward function loaded from FILE.py:FUNCTION and called, and pass@k. Also
inference-time scaling's choice among N samples (`generate --samples N --vote` / `--best-of`): each reply's
answer, taken by the user's extractor `fn(completion) -> str | None` (or the last number), and the majority.

A prompts line is {"messages": [...]} (a chat, rendered with the generation prompt) or {"prompt": "..."} (text),
with any other fields: they are passed to the reward function, `fn(prompt, completion, **row) -> float`, as
TRL passes a dataset's other columns to its reward functions. A reward that raises or is not a finite number
is one error naming the prompt's line.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from . import chats, objectives
from ..errors import QwenNPError
from ..files.messages import MessageError, chat_message
from ..files.tokenizer import Tokenizer, split_thinking

if TYPE_CHECKING:
    from ..core.model import Qwen3Model

Reward = Callable[..., Any]
# The default extractor's number: "-3", "2.5" (a thousands comma splits one: "1,000" reads as 1 and 000).
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
# The step number a validation's samples are seeded with (a training step's never reaches it).
VALIDATION_STEP = 2 ** 40
# How a GRPO run samples (the command gives one built on qwen_np/generation, a floor training does not import):
# (model, tokenizer, prompt ids, how many, at most how many tokens each, temperature, seed) -> each completion's
# ids, its end-of-sequence token included where it ended so.
Sampler = Callable[["Qwen3Model", Tokenizer, list[int], int, int, float, int], list[list[int]]]


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


def load_function(spec: str, param: str = "reward") -> Reward:
    """The function FUNCTION of the Python file FILE.py, from "FILE.py:FUNCTION"; `param`: the parameter it came
    as (a reward function, an answer extractor), which its errors name."""
    file, _, name = spec.rpartition(":")
    if not file or not name or not file.endswith(".py"):
        raise QwenNPError(f"expected FILE.py:FUNCTION, got {spec!r}", param)
    if not Path(file).is_file():
        raise QwenNPError(f"{file}: not found", param)
    loaded = importlib.util.spec_from_file_location(f"qwen_np_user_{Path(file).stem}", file)
    if loaded is None or loaded.loader is None:
        raise QwenNPError(f"{file}: not a Python file", param)
    module = importlib.util.module_from_spec(loaded)
    try:
        loaded.loader.exec_module(module)
    except Exception as bad:                           # the user's file: whatever it raises is its error
        raise QwenNPError(f"{file}: raised {type(bad).__name__} when imported ({bad})", param) from None
    function = getattr(module, name, None)
    if not callable(function):
        raise QwenNPError(f"{file} defines no function {name}", param)
    return function


def _called(call: Callable[[], Any], message: str, param: str) -> Any:
    """call(), the user's function; whatever it raises is one error, `message` with "{}" as what it raised."""
    try:
        return call()
    except Exception as bad:                           # the user's function: whatever it raises is its error
        raise QwenNPError(message.format(f"{type(bad).__name__} ({bad})"), param) from None


def reward_of(reward: Reward, prompt: Prompt, completion: str, param: str = "reward") -> float:
    """reward(prompt, completion, **fields) as a float; a raise, a non-number or a NaN is one error naming the line."""
    value = _called(lambda: reward(prompt.prompt, completion, **prompt.fields),
                    f"{prompt.where}: the reward function raised {{}} on this prompt", param)
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number):
        raise QwenNPError(f"{prompt.where}: the reward function returned {value!r} on this prompt, not a finite "
                          "number", param)
    return number


def last_number(completion: str) -> str | None:
    """The default answer of a reply: the last number in its answer (the text after a think block), else that
    answer stripped of surrounding whitespace (None, no vote, when nothing is left)."""
    answer = split_thinking(completion)[1]
    numbers = NUMBER.findall(answer)
    return numbers[-1] if numbers else answer.strip() or None


def answer_of(extract: Reward, completion: str, where: str) -> str | None:
    """extract(completion): a string, or None (the reply gives no answer, and so no vote)."""
    value = _called(lambda: extract(completion), f"{where}: the extractor raised {{}}", "extract")
    if value is not None and not isinstance(value, str):
        raise QwenNPError(f"{where}: the extractor returned {value!r}, not a string or None", "extract")
    return value


def majority(answers: list[str | None]) -> tuple[str | None, dict[str, int]]:
    """Self-consistency's vote: the most common answer (a tie goes to the one seen first; None abstains, and
    with no answer at all the majority is None) and each answer's count, in the order first seen."""
    votes = Counter(answer for answer in answers if answer is not None)      # a dict: insertion order kept
    return max(votes, key=votes.__getitem__) if votes else None, dict(votes)   # max keeps the first of equals


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from n samples of which c are correct (Chen et al. 2021):
    1 - C(n - c, k) / C(n, k), as a running product (the binomials overflow a float for large n)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


@dataclass
class GrpoSettings:
    """A GRPO run's rollouts and loss (train --grpo's flags), saved with its checkpoints: a resumed run keeps them."""

    prompts: str                            # the prompts file
    reward: str                             # FILE.py:FUNCTION
    group: int = 4                          # completions a prompt (G)
    beta: float = 0.0                       # the KL term's weight (TRL's default: none)
    loss: str = "dapo"                      # objectives.LOSS_TYPES (TRL's default)
    completion_tokens: int = 64             # at most this many tokens a completion (TRL's max_completion_length)
    temperature: float = 1.0                # sampling temperature (TRL's default)

    def check(self) -> "GrpoSettings":
        if self.group < 2:
            raise QwenNPError(f"must be at least 2, got {self.group} (advantages compare a prompt's completions with "
                              "each other: one alone has advantage 0)", "group")
        if self.loss not in objectives.LOSS_TYPES:
            raise QwenNPError(f"expected one of {', '.join(objectives.LOSS_TYPES)}, got {self.loss!r}", "loss")
        if not self.beta >= 0:
            raise QwenNPError(f"must be at least 0, got {self.beta:g}", "beta")
        if self.completion_tokens < 1:
            raise QwenNPError(f"must be at least 1, got {self.completion_tokens}", "completion_tokens")
        if not self.temperature > 0:
            raise QwenNPError(f"must be positive, got {self.temperature:g}", "temperature")
        return self


@dataclass
class Rollout:
    """G sampled completions of each of P prompts, as GRPO's batch: rows prompt + completion (the P groups one after
    another), the completion's mask, and the rewards."""

    ids: np.ndarray                 # [P*G, W]
    completion: np.ndarray          # bool [P*G, W]
    rewards: np.ndarray             # [P, G]
    lengths: np.ndarray             # [P*G] tokens of each completion

    def summary(self) -> dict[str, float]:
        """What GRPO's progress shows: the rewards' mean and std, the completions' mean length."""
        return {"reward_mean": float(self.rewards.mean()), "reward_std": float(self.rewards.std()),
                "completion_length": float(self.lengths.mean())}


@dataclass
class PromptData:
    """What a GRPO run samples from (training prompts) and validates on (held-out prompts' mean reward)."""

    train: list[Prompt]
    validation: list[Prompt]
    sha256: str
    order: chats.ConversationOrder
    context: int
    pad_id: int
    tokenizer: Tokenizer
    settings: GrpoSettings
    reward: Reward
    sample: Sampler
    seed: int

    def next_batch(self, batch_size: int) -> list[Prompt]:
        return [self.train[i] for i in self.order.next_indices(batch_size)]

    def rollout(self, model: Qwen3Model, prompts: list[Prompt], step: int, group: int | None = None) -> Rollout:
        """`group` (default: the run's) completions of each prompt, sampled with seeds from (the run's seed, step,
        the prompt's place), each rewarded by the user's function on its text (special tokens left out, as TRL's)."""
        group = group or self.settings.group
        rows, rewards, lengths = [], [], []
        for place, prompt in enumerate(prompts):
            ids = prompt.ids(self.tokenizer)
            seed = int(np.random.SeedSequence([self.seed, step, place]).generate_state(1)[0])
            completions = self.sample(model, self.tokenizer, ids, group, self.settings.completion_tokens,
                                      self.settings.temperature, seed)
            for completion in completions:
                text = self.tokenizer.decode(completion, skip_special_tokens=True)
                rewards.append(reward_of(self.reward, prompt, text))
                lengths.append(len(completion))
                rows.append(chats.Chat(np.asarray(ids + completion, dtype=np.int64),
                                       np.asarray([False] * len(ids) + [True] * len(completion)), 0))
        batch, completion_mask = chats.padded_rows(rows, self.context, self.pad_id)
        return Rollout(batch, completion_mask, np.asarray(rewards).reshape(len(prompts), group), np.asarray(lengths))

    def validate(self, model: Qwen3Model) -> dict[str, Any]:
        """The held-out prompts' mean reward over the run's group of samples each, seeded the same at every
        evaluation (`loss_per_token`, what best-keeping compares, is its negative)."""
        summary = self.rollout(model, self.validation, step=VALIDATION_STEP).summary()
        return {"loss_per_token": -summary["reward_mean"], **summary}

    def describe(self) -> str:
        s = self.settings
        return (f"{len(self.train):,} prompts (GRPO, {s.group} completions each of at most {s.completion_tokens} "
                f"tokens, loss {s.loss}, beta {s.beta:g}, reward {s.reward})")


def prompt_data(tokenizer: Tokenizer, settings: GrpoSettings, val: Path | None, order: chats.ConversationOrder,
                context: int, pad_id: int, sample: Sampler, seed: int) -> PromptData:
    """A GRPO run's prompts (--val's validate, else the last 5%) and reward function, loaded."""
    data = Path(settings.prompts)
    train = read_prompts(data)
    train, validation = (train, read_prompts(val)) if val is not None else chats.split_off(train, data, "prompt",
                                                                                          "a prompts file")
    order.count = len(train)
    return PromptData(train, validation, chats.chat_files_sha256(data, val), order, context, pad_id, tokenizer,
                      settings, load_function(settings.reward), sample, seed)
