"""Preference pairs for DPO (`train --dpo`, `eval --prefs`): TRL's preference format read, tokenised as TRL's
DPOTrainer tokenises it, batched, and scored.

A line is {"prompt": ..., "chosen": ..., "rejected": ...}, plain (three strings) or conversational (`prompt` a
list of messages, `chosen` and `rejected` lists of assistant messages), TRL's two "preference" types. Plain: the
prompt's tokens, then the reply's with the end-of-text token appended (TRL's add_eos). Conversational: the
prompt rendered by the model's chat template with the generation prompt, the reply as prompt + reply rendered
whole (as chats.py renders an SFT chat: a message's text is text); as in TRL, the reply starts where the two
renderings' tokens part (Qwen3's template gives the last turn an empty think block, which is the reply's).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from . import chats, objectives
from ..errors import QwenNPError
from ..files.messages import MessageError, chat_message
from ..files.tokenizer import Tokenizer, common_prefix

if TYPE_CHECKING:
    from ..core.model import Qwen3Model

FIELDS = ("prompt", "chosen", "rejected")


@dataclass
class Pair:
    """One preference pair as the model reads it: the prompt and each reply's token ids."""

    prompt: np.ndarray              # int64 [Np]
    chosen: np.ndarray              # int64 [Nc]
    rejected: np.ndarray            # int64 [Nr]

    @property
    def longest(self) -> int:
        return len(self.prompt) + max(len(self.chosen), len(self.rejected))


def read_pairs(path: Path) -> list[dict[str, Any]]:
    """The pairs of a preference file, each line checked (pair_line); a QwenNPError names FILE:LINE: field."""
    return chats.read_lines(path, pair_line, "preference file", "preference pairs")


def pair_line(line: str, where: str) -> dict[str, Any]:
    """One line: three strings, or a prompt of messages and two replies of assistant messages (each checked as
    the server checks a message); `where` (FILE:LINE) starts each error."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise QwenNPError(f"{where}: not JSON ({exc.msg})") from exc
    if not isinstance(row, dict):
        raise QwenNPError(f'{where}: expected {{"prompt": ..., "chosen": ..., "rejected": ...}}')
    for field in FIELDS:
        if field not in row:
            raise QwenNPError(f"{where}: {field}: missing (a preference line has {', '.join(FIELDS)})")
    unknown = next((key for key in row if key not in FIELDS), None)
    if unknown is not None:
        raise QwenNPError(f"{where}: {unknown}: not a field of a preference line ({', '.join(FIELDS)})")
    if all(isinstance(row[field], str) for field in FIELDS):
        return {field: row[field] for field in FIELDS}
    read: dict[str, Any] = {}
    for field in FIELDS:
        value = row[field]
        if not isinstance(value, list) or not value:
            raise QwenNPError(f"{where}: {field}: expected a list of messages (a conversational line) or, with the "
                              "others, a string (a plain one)")
        try:
            read[field] = [chat_message(message, index) for index, message in enumerate(value)]
        except MessageError as bad:
            raise QwenNPError(f"{where}: {field}: {bad}") from None
        if field != "prompt" and any(message["role"] != "assistant" for message in read[field]):
            raise QwenNPError(f"{where}: {field}: holds the reply, assistant messages only")
    return read


def encoded_pair(tokenizer: Tokenizer, row: dict[str, Any]) -> Pair:
    """A line's tokens as DPOTrainer's tokenize_fn makes them (the reply from where prompt and prompt + reply part)."""
    if isinstance(row["prompt"], str):
        eos = tokenizer.eos_token
        prompt = tokenizer.encode(row["prompt"])
        whole = [tokenizer.encode(row["prompt"] + reply + ("" if reply.endswith(eos) else eos))
                 for reply in (row["chosen"], row["rejected"])]
    else:
        if not tokenizer.has_chat_template:
            raise QwenNPError("conversational preference pairs need a model with a chat template", "data")
        prompt = tokenizer.encode_chat(row["prompt"], add_generation_prompt=True)
        whole = [tokenizer.encode_chat(row["prompt"] + row[field], add_generation_prompt=False)
                 for field in ("chosen", "rejected")]
    start = min(common_prefix(prompt, ids) for ids in whole)
    return Pair(*(np.asarray(ids, dtype=np.int64) for ids in (prompt[:start], whole[0][start:], whole[1][start:])))


def encoded_pairs(tokenizer: Tokenizer, path: Path) -> list[Pair]:
    return [encoded_pair(tokenizer, row) for row in read_pairs(path)]


def pair_rows(pairs: list[Pair], context: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """P pairs as one batch: ids [2P, W] (the chosen rows, then the rejected) and the reply's mask [2P, W],
    padded at the end as chats.padded_rows pads, cut at context + 1 tokens."""
    rows = [chats.Chat(np.concatenate([pair.prompt, reply]),
                       np.concatenate([np.zeros(len(pair.prompt), dtype=bool), np.ones(len(reply), dtype=bool)]), 0)
            for replies in ((pair.chosen for pair in pairs), (pair.rejected for pair in pairs))
            for pair, reply in zip(pairs, replies)]
    return chats.padded_rows(rows, context, pad_id)


@dataclass
class PreferenceScore:
    """How a model ranks pairs' replies: each reply's summed log-probability under it, and with a reference,
    DPO's loss and rewards."""

    chosen: np.ndarray              # [P]
    rejected: np.ndarray            # [P]

    def summary(self) -> dict[str, Any]:
        """The pairs, the share whose chosen reply the model finds likelier than the rejected one, and the mean of
        log p(chosen) - log p(rejected) (nats)."""
        accuracy, margin = objectives.ranked(self.chosen, self.rejected)
        return {"pairs": len(self.chosen), "preference_accuracy": accuracy, "margin": margin}


def sequence_log_probs(model: Qwen3Model, pairs: list[Pair], context: int, pad_id: int,
                       batch: int = 4) -> PreferenceScore:
    """Each pair's two replies' summed log-probabilities under `model`, `batch` pairs a forward."""
    from .step import completion_log_probs

    chosen, rejected = [], []
    for start in range(0, len(pairs), batch):
        part = pairs[start:start + batch]
        ids, completion = pair_rows(part, context, pad_id)
        sums = completion_log_probs(model, ids, completion).sum(axis=1, dtype=np.float64)    # [2P]
        chosen.append(sums[:len(part)])
        rejected.append(sums[len(part):])
    return PreferenceScore(np.concatenate(chosen), np.concatenate(rejected))


@dataclass
class PreferenceData:
    """What a DPO run trains and validates on: pairs, each row's reference log-probability (set once the
    reference is known: with_reference), and the place in the training pairs (chats.ConversationOrder)."""

    train: list[Pair]
    validation: list[Pair]
    sha256: str
    order: chats.ConversationOrder
    context: int
    pad_id: int
    beta: float
    reference: PreferenceScore | None = None            # of the training pairs
    reference_validation: PreferenceScore | None = None

    def with_reference(self, model: Qwen3Model) -> None:
        """The reference's log-probabilities of every pair, computed once (the reference does not change)."""
        self.reference = sequence_log_probs(model, self.train, self.context, self.pad_id)
        self.reference_validation = sequence_log_probs(model, self.validation, self.context, self.pad_id)

    def next_batch(self, batch_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The next batch_size pairs: ids [2P, W], completion [2P, W] (pair_rows) and their reference log-probs [2P]."""
        if self.reference is None:
            raise QwenNPError("the reference log-probabilities are not computed (with_reference)")
        picked = self.order.next_indices(batch_size)
        ids, completion = pair_rows([self.train[i] for i in picked], self.context, self.pad_id)
        return ids, completion, np.concatenate([self.reference.chosen[picked], self.reference.rejected[picked]])

    def validate(self, model: Qwen3Model) -> dict[str, Any]:
        """The held-out pairs' DPO loss (`loss_per_token`: what best-keeping and --patience compare), preference
        accuracy and margin (eval --prefs's figures), and TRL's reward accuracy and margin."""
        score = sequence_log_probs(model, self.validation, self.context, self.pad_id)
        reference = self.reference_validation
        assert reference is not None
        dpo = objectives.dpo_loss(score.chosen, score.rejected, reference.chosen, reference.rejected, self.beta)
        return {"loss_per_token": dpo.loss, "dpo_loss": dpo.loss, **score.summary(),
                "reward_accuracy": dpo.accuracy, "reward_margin": dpo.margin}

    def describe(self) -> str:
        return f"{len(self.train):,} preference pairs (DPO, beta {self.beta:g})"


def held_out(tokenizer: Tokenizer, data: Path, val: Path | None) -> tuple[list[Pair], list[Pair], str]:
    """(training, validation pairs, the files' SHA-256): --val's pairs validate, else the last 5% of --data's."""
    train = encoded_pairs(tokenizer, data)
    if val is not None:
        return train, encoded_pairs(tokenizer, val), chats.chat_files_sha256(data, val)
    return (*chats.split_off(train, data, "pair", "a preference file"), chats.chat_files_sha256(data, val))

