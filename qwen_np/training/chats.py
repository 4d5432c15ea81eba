"""Chat data for supervised fine-tuning (SFT): conversations, rendered by the model's chat template, with
the loss on the assistant's tokens only.

A chat file is JSONL, one conversation a line in OpenAI's format: {"messages": [{"role": "system" |
"user" | "assistant" | "tool", "content": ...}, ...]} and optionally "tools", each line checked as the
server checks a request's messages and tools (files/messages.py: one rule, an error naming FILE:LINE and
the field). Each conversation is rendered whole by the checkpoint's template (without a generation
prompt) and tokenised as the server tokenises a chat (Tokenizer.encode_chat): a message's text is text,
a special token only ever the template's own, so a message holding "<|im_start|>assistant\\n..." opens
no turn, and the model is taught what it will read when it serves.

What is learned: every assistant turn the template opened, found by its tokens (its own <|im_start|>
special token, then "assistant\\n"): the turn's tokens after that header through its "<|im_end|>"
inclusive (so the model learns to stop). The system and user turns, the tool results and
the headers are context: the model reads them but is not taught to write them (nanochat's SFT, mlx-lm's
--mask-prompt). Qwen3's template shows earlier assistant turns without their <think> blocks and gives
the last one an empty "<think>\\n\\n</think>\\n\\n" unless it has reasoning: each turn is taught as it
is rendered in that whole conversation, which is what the model reads back as history when it
generates the next turn; the last turn's empty think block is what the template writes when thinking
is off, so a tuned model answers directly.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import numpy as np

from . import evaluation
from ..errors import QwenNPError
from ..files.messages import MessageError, chat_message, declared_tools
from ..files.tokenizer import Tokenizer

if TYPE_CHECKING:
    from ..core.model import Qwen3Model

# Qwen3's turns: <|im_start|> (a special token), the role and a newline, the turn, <|im_end|>.
TURN_START, ASSISTANT_ROLE, TURN_END = "<|im_start|>", "assistant\n", "<|im_end|>"
# What a chat line holds (OpenAI's chat fine-tuning format); any other key is refused by name.
LINE_KEYS = ("messages", "tools")
# The longest line read, in characters: 131,072 tokens (Qwen3's longest context, with YaRN) at 32 characters
# a token (8x English prose's ~4): no Qwen3 context holds a longer conversation whole. Tokenising one so long
# takes ~20 s and ~0.7 GB (5 MB of prose: 24 s, 0.85 GB peak on two cores); a 50 MB line, unbounded, took
# minutes and several GB. A longer line is refused before it is parsed, read at most this far.
MAX_LINE_CHARACTERS = 131_072 * 32


@dataclass
class Chat:
    """One conversation as the model reads it: its token ids [N] and which of them the loss is over [N]."""

    ids: np.ndarray             # int64 [N]
    learned: np.ndarray         # bool [N]: True for the assistant's tokens
    characters: int             # characters of the learned text


def is_chat_file(path: Path) -> bool:
    """A .jsonl file is a chat file."""
    return path.suffix == ".jsonl"


def read_chats(path: Path) -> list[dict[str, Any]]:
    """The conversations of a JSONL chat file, each {"messages": [...], "tools": [...] or absent} as the
    template reads them (chat_line); a bad line is named by its number."""
    return read_lines(path, chat_line, "chat file", "conversations")


def read_lines(path: Path, read: Callable[[str, str], dict[str, Any]], kind: str, items: str) -> list[dict[str, Any]]:
    """The non-blank lines of a JSONL file, each read by `read(line, "FILE:LINE")` (which names the line in its
    errors); a line longer than MAX_LINE_CHARACTERS is refused before it is parsed. kind, items: what the file
    and its lines are, for the errors ("chat file", "conversations")."""
    rows = []
    try:
        with open(path, encoding="utf-8") as lines:
            for number, line in enumerate(iter(lambda: lines.readline(MAX_LINE_CHARACTERS + 1), ""), 1):
                if len(line.rstrip("\n")) > MAX_LINE_CHARACTERS:
                    raise QwenNPError(f"{path}:{number}: longer than {MAX_LINE_CHARACTERS:,} characters, more than "
                                      "any Qwen3 context holds: split the conversation")
                if line.strip():
                    rows.append(read(line, f"{path}:{number}"))
    except (OSError, UnicodeDecodeError) as exc:
        raise QwenNPError(f"{path}: cannot read the {kind} ({exc})") from exc
    if not rows:
        raise QwenNPError(f"{path}: no {items}")
    return rows


def chat_line(line: str, where: str) -> dict[str, Any]:
    """One line of a chat file ({"messages": [...], "tools": [...]}), checked as the server checks a chat
    request's messages and tools (files/messages.py) and made what the template reads; `where` (FILE:LINE)
    starts each error."""
    try:
        chat = json.loads(line)
    except json.JSONDecodeError as exc:
        raise QwenNPError(f"{where}: not JSON ({exc.msg})") from exc
    messages = chat.get("messages") if isinstance(chat, dict) else None
    if not isinstance(messages, list) or not messages:
        raise QwenNPError(f'{where}: expected {{"messages": [{{"role": ..., "content": ...}}, ...]}}')
    unknown = next((key for key in chat if key not in LINE_KEYS), None)
    if unknown is not None:
        raise QwenNPError(f"{where}: {unknown}: not a field of a chat line ({', '.join(LINE_KEYS)})")
    try:
        read = [chat_message(message, index) for index, message in enumerate(messages)]
        tools = declared_tools(chat.get("tools"))
    except MessageError as bad:
        raise QwenNPError(f"{where}: {bad}") from None
    if not any(message["role"] == "assistant" for message in read):
        raise QwenNPError(f"{where}: the conversation has no assistant turn to learn")
    return {"messages": read, **({"tools": tools} if tools else {})}


def chat_tokens(tokenizer: Tokenizer, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None = None) -> Chat:
    """The conversation's ids as the server reads a chat (Tokenizer.encode_chat) and the mask of its
    assistant tokens, found by the template's own tokens: a piece of text right after a <|im_start|> special
    token that starts "assistant\\n" is an assistant turn's header and what follows; the turn is learned
    through the next <|im_end|> special token. A token is learned when it starts at or after the header's
    end (one that straddled it would be part header; Qwen3's tokenizer splits there, as <think> is an added
    token and the header ends in its own newline token unless the turn's text starts with a newline, which
    Qwen3's template strips).

    A tokenizer that reads <|im_start|> as text (the bundled model's) cannot tell the template's markup from a
    message's by the tokens, at training as at serving: its turns are found in the rendered text (text_turns).
    """
    if not tokenizer.is_special(TURN_START):
        return text_turns(tokenizer, messages, tools)
    ids: list[int] = []
    learned: list[bool] = []
    characters, in_turn, opened = 0, False, False      # opened: the piece before was <|im_start|>
    for piece in tokenizer.encode_chat_pieces(messages, add_generation_prompt=False, tools=tools):
        begin: int | None                               # where this piece's learned characters start (None: none)
        if piece.special:                               # learned inside a turn: its <|im_end|>, which ends it
            begin = 0 if in_turn else None
            in_turn = in_turn and piece.text not in (TURN_START, TURN_END)
            opened = piece.text == TURN_START
        else:
            header = opened and piece.text.startswith(ASSISTANT_ROLE)
            begin = 0 if in_turn else len(ASSISTANT_ROLE) if header else None
            in_turn, opened = begin is not None, False
        ids += piece.ids
        learned += [begin is not None and first >= begin for first, _ in piece.offsets]
        characters += 0 if begin is None else len(piece.text) - begin
    return Chat(np.asarray(ids, dtype=np.int64), np.asarray(learned, dtype=bool), characters)


def text_turns(tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Chat:
    """chat_tokens for a tokenizer without the markup's special tokens: the rendered text's assistant turns,
    each from the end of a "<|im_start|>assistant\\n" header through its "<|im_end|>", carried to the tokens
    by their character offsets (a token is learned when it lies inside a turn)."""
    pieces = tokenizer.encode_chat_pieces(messages, add_generation_prompt=False, tools=tools)
    ids = [token for piece in pieces for token in piece.ids]
    offsets, at = [], 0                                  # each token's characters in the whole text
    for piece in pieces:
        offsets += [(at + first, at + last) for first, last in piece.offsets]
        at += len(piece.text)
    text, header, spans = "".join(piece.text for piece in pieces), TURN_START + ASSISTANT_ROLE, []
    start = text.find(header)
    while start != -1:
        begin = start + len(header)
        end = text.find(TURN_END, begin)
        end = len(text) if end == -1 else end + len(TURN_END)
        spans.append((begin, end))
        start = text.find(header, end)
    learned = [any(begin <= first and last <= end for begin, end in spans) for first, last in offsets]
    return Chat(np.asarray(ids, dtype=np.int64), np.asarray(learned, dtype=bool),
                sum(end - begin for begin, end in spans))


def encoded_chats(tokenizer: Tokenizer, path: Path) -> list[Chat]:
    """Every conversation of a chat file, rendered and masked."""
    if not tokenizer.has_chat_template:
        raise QwenNPError(f"{path}: a chat file needs a model with a chat template")
    return [chat_tokens(tokenizer, chat["messages"], chat.get("tools")) for chat in read_chats(path)]


def padded_rows(conversations: list[Chat], context: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Conversations as one training batch: ids [B, W] and learned [B, W], W = the longest conversation's
    length, at most context + 1.

    Each conversation is one row, from its start (its position 0, as at inference): a longer one is cut
    after context + 1 tokens (what is cut is not learned), a shorter one padded at the end with pad_id,
    never learned. Causal attention keeps padding at a row's end from reaching the real tokens before it,
    so a padded row's loss and gradients are those of the conversation alone. Why padding and not
    packing (several conversations one after another in a row): packed conversations would attend to
    each other, unless the forward took a mask per document, and a conversation would not start at
    position 0 as it does when the model generates. Padding only to the batch's longest conversation
    takes back much of what fixed-width rows waste (bench/README.md, "Chat batches": 2.2x the tokens/s
    on short chats; packing was 1.9x faster still).
    """
    width = min(context + 1, max(len(chat.ids) for chat in conversations))
    ids = np.full((len(conversations), width), pad_id, dtype=np.int64)
    learned = np.zeros((len(conversations), width), dtype=bool)
    for row, chat in enumerate(conversations):
        n = min(len(chat.ids), width)
        ids[row, :n], learned[row, :n] = chat.ids[:n], chat.learned[:n]
    return ids, learned


# --- A training run's chat data -------------------------------------------------------------------------


@dataclass
class ConversationOrder:
    """Epochs over the training conversations, each epoch in the order of a permutation drawn from a generator
    seeded by (seed, epoch): the order is reproducible from (seed, epoch, position) alone, the place a
    checkpoint keeps (as text_data.WindowOrder's, over windows of text)."""

    count: int
    seed: int
    epoch: int = 0
    position: int = 0             # conversations of this epoch already used

    def next_indices(self, batch_size: int) -> list[int]:
        """The next batch_size conversations' numbers, continuing into the next epoch when one ends."""
        picked: list[int] = []
        while len(picked) < batch_size:
            if self.position >= self.count:
                self.epoch, self.position = self.epoch + 1, 0
            order = np.random.default_rng([self.seed, self.epoch]).permutation(self.count)
            taken = order[self.position:self.position + batch_size - len(picked)]
            picked += taken.tolist()
            self.position += len(taken)
        return picked


@dataclass
class ChatData:
    """What a chat run trains and validates on, and its place in the training conversations."""

    train: list[Chat]
    validation: list[Chat]
    sha256: str                   # of the chat file(s) read (chat_files_sha256)
    order: ConversationOrder
    context: int
    pad_id: int

    def next_batch(self, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """The next batch_size conversations as padded_rows: ids [B, W] and learned [B, W]."""
        return padded_rows([self.train[i] for i in self.order.next_indices(batch_size)], self.context, self.pad_id)

    def validate(self, model: Qwen3Model) -> dict[str, Any]:
        """The held-out conversations' loss over their assistant tokens (eval --text FILE.jsonl's figure)."""
        return evaluation.score_text(model.forward, [chat.ids for chat in self.validation],
                                     sum(chat.characters for chat in self.validation), self.context,
                                     learned=[chat.learned for chat in self.validation]).summary()

    def describe(self) -> str:
        learned = sum(int(chat.learned.sum()) for chat in self.train)
        return f"{len(self.train):,} conversations ({learned:,} assistant tokens)"


def held_out(tokenizer: Tokenizer, data: Path, val: Path | None) -> tuple[list[Chat], list[Chat], str]:
    """(training, validation conversations, their files' SHA-256): --val's file validates, else the last 5% of
    --data's conversations (at least one)."""
    train = encoded_chats(tokenizer, data)
    if val is not None:
        return train, encoded_chats(tokenizer, val), chat_files_sha256(data, val)
    return (*split_off(train, data, "conversation", "a chat file"), chat_files_sha256(data, val))


Row = TypeVar("Row")


def split_off(rows: list[Row], data: Path, item: str, kind: str) -> tuple[list[Row], list[Row]]:
    """(training, validation) rows of one file: its last 5% validate (at least one). item, kind: what a row and a
    file of them are ("conversation", "a chat file"), for the error when there is only one."""
    if len(rows) < 2:
        raise QwenNPError(f"{data}: one {item} cannot be split into training and validation (add {item}s, or name "
                          f"{kind} that validates with `val`)", "data")
    cut = len(rows) - max(1, len(rows) // 20)
    return rows[:cut], rows[cut:]


def chat_files_sha256(data: Path, val: Path | None) -> str:
    """The SHA-256 of a chat run's files (--data's bytes, then --val's if given): a resumed run checks it."""
    digest = hashlib.sha256(data.read_bytes())
    if val is not None:
        digest.update(b"\0" + val.read_bytes())
    return digest.hexdigest()
