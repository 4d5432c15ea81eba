"""Qwen3 tokenizer: text <-> token ids, the checkpoint's chat template, and streaming detokenisation.

A checkpoint folder holds ``tokenizer.json`` (byte-level BPE, loaded with the ``tokenizers``
library) and ``tokenizer_config.json`` (chat template, eos/pad tokens). ``tools/build_tokenizer.py``
builds both offline for Qwen3.

* ``Tokenizer`` encodes and decodes like transformers' fast tokenizer (no BOS/EOS ever added;
  added-token strings such as ``<|im_end|>`` or ``<think>`` in the text become their single ids)
  and renders the chat template exactly like transformers' ``apply_chat_template``. A chat's ids
  (``encode_chat``) read the messages' text as text: a special token comes only from the template.
* ``StreamDecoder`` turns generated ids into text one token at a time without ever emitting
  half a UTF-8 character.
* ``chat_delta`` and ``split_thinking`` support multi-turn chat that keeps its KV cache.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..core.config import read_json_object
from ..errors import QwenNPError

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
# transformers gives a standalone template file priority over the one inside tokenizer_config.json.
TEMPLATE_FILE = "chat_template.jinja"

# The named special tokens transformers passes to every chat template (its SPECIAL_TOKENS_ATTRIBUTES).
TEMPLATE_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Names a message's reasoning may come under; transformers copies it to the first and to "thinking".
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# Where encode_chat looks for a character that no message holds, to mark the special-token strings in them.
PRIVATE_USE = range(0xE000, 0xF900)
REPLACEMENT_CHAR = "\ufffd"  # what decoding yields for an incomplete UTF-8 sequence

Message = dict[str, Any]


def _byte_level_alphabet() -> dict[str, int]:
    """The character byte-level BPE writes for each byte (GPT-2's bytes_to_unicode, which Qwen's
    tokenizer.json uses): printable Latin-1 bytes stand for themselves, the other 68 are shifted to
    U+0100 on, in byte order. The tokenizers binding maps bytes this way internally but exposes no table."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(shifted)}}


_BYTE_OF_CHARACTER = _byte_level_alphabet()


@dataclass(frozen=True)
class ChatPiece:
    """A stretch of a chat's ids as encode_chat makes them: one of the template's own special tokens
    (`special`), or the text between two, a message's special-token strings in it read as text."""

    text: str
    ids: list[int]
    offsets: list[tuple[int, int]]      # each id's [start, end) characters in `text`
    special: bool


class Tokenizer:
    """Qwen3's tokenizer, loaded from a checkpoint folder with ``Tokenizer.from_folder``."""

    def __init__(self, backend: tokenizers.Tokenizer, config: dict[str, Any], chat_template: str | None) -> None:
        self._backend = backend
        self._config = config
        self.chat_template = chat_template       # the template's source (export writes it into a GGUF)
        self._template = _compile_template(chat_template) if chat_template is not None else None
        # The special tokens (<|im_start|>, <|im_end|>, <|endoftext|>, ...: control tokens, not the tags
        # <think> or <tool_call>, which are added tokens too), longest first, and what finds them in a text.
        self._special = {token.content: token_id for token_id, token in sorted(
            backend.get_added_tokens_decoder().items(), key=lambda item: -len(item[1].content)) if token.special}
        self._special_split = (re.compile("(" + "|".join(map(re.escape, self._special)) + ")") if self._special
                               else None)
        self._literal: tokenizers.Tokenizer | None = None       # encode(parse_special=False)'s backend
        self._literal_lock = threading.Lock()

    @classmethod
    def from_folder(cls, folder: Path | str) -> Tokenizer:
        """The tokenizer of a checkpoint folder (loading.read_tokenizer also reads a GGUF file's)."""
        folder = Path(folder)
        backend = _load_backend(folder / TOKENIZER_FILE)
        config = _load_config(folder / CONFIG_FILE)
        template_path = folder / TEMPLATE_FILE
        template: str | None
        if template_path.is_file():
            source, template = template_path, _read_text(template_path)
        else:
            source, template = folder / CONFIG_FILE, config.get("chat_template")
        try:
            return cls(backend, config, template)
        except jinja2.TemplateSyntaxError as exc:
            raise QwenNPError(f"{source}: chat template does not compile: {exc}") from exc

    def save(self, folder: Path) -> None:
        """tokenizer.json and tokenizer_config.json (with the chat template) in `folder`, as from_folder reads them
        and transformers does: a tokenizer built from a GGUF's vocabulary written as a checkpoint folder's."""
        self._backend.save(str(folder / TOKENIZER_FILE))
        config = {**self._config, **({"chat_template": self.chat_template} if self.chat_template is not None else {})}
        (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    def encode(self, text: str, add_special_tokens: bool = False, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``; matches added-token strings atomically. Adds no special tokens unless
        ``add_special_tokens``: then those of tokenizer.json's post-processor (Qwen3's adds none,
        Qwen3-Embedding's appends <|endoftext|>, the token its embeddings are read at). With
        ``parse_special=False`` the special tokens' strings (``<|im_end|>``, ...) are read as the characters
        they are, as llama.cpp's ``parse_special=false`` reads them (the other added tokens keep their ids)."""
        return self._encoding(text, add_special_tokens, parse_special).ids

    def _encoding(self, text: str, add_special_tokens: bool = False, parse_special: bool = True) -> tokenizers.Encoding:
        """encode's tokenizers.Encoding (ids, and each token's characters in `text`: offsets)."""
        backend = self._backend if parse_special else self._literal_backend()
        # The binding's encode_batch releases the GIL while it works and encode holds it: a long text
        # tokenised on one thread (the server's workers) must not stop every other thread meanwhile.
        return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    def encode_chat(self, messages: list[Message], add_generation_prompt: bool = True,
                    enable_thinking: bool | None = None, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of the chat as ``apply_chat_template`` renders it, the messages read as text: the special
        tokens the template writes (each turn's <|im_start|> and <|im_end|>) are tokens, a special-token
        string inside a message (or a tool's description) is only its characters, so a user's
        ``<|im_end|><|im_start|>system ...`` opens no system turn. OpenAI's API reads message content so, as
        llama.cpp does; transformers and vLLM would parse it. A message without such strings gets exactly
        ``encode(apply_chat_template(...))``; the tags a template reads in a message (<think>, <tool_response>)
        are not special tokens and keep their ids.

        How: each special-token string in the messages gets a mark (a private-use character no message
        holds) after its first character, the chat is rendered, its text cut at the special tokens left
        (the template's own), and each piece between them is encoded: one with marks, the marks removed,
        with parse_special=False (whose backend is made only then), the others as they are."""
        pieces = self.encode_chat_pieces(messages, add_generation_prompt, enable_thinking, tools)
        return [token for piece in pieces for token in piece.ids]

    def is_special(self, text: str) -> bool:
        """Whether `text` is one of this tokenizer's special tokens (Qwen3's <|im_start|>; a tokenizer of its own,
        such as the bundled model's, may read the chat markup as plain text)."""
        return text in self._special

    def encode_chat_pieces(self, messages: list[Message], add_generation_prompt: bool = True,
                           enable_thinking: bool | None = None,
                           tools: list[dict[str, Any]] | None = None) -> list[ChatPiece]:
        """encode_chat's ids in the pieces it made them in: each of the template's own special tokens, and the
        text between two (with each token's characters in it), so that a caller can tell the template's
        markup from a message's text by the tokens (training/chats.py finds the assistant's turns so)."""
        if self._special_split is None:
            text = self.apply_chat_template(messages, add_generation_prompt, enable_thinking, tools)
            return [self._text_piece(text, parse_special=True)]
        mark = _unused_character([messages, tools, self.chat_template])
        split = self._special_split

        def defuse(value: Any) -> Any:
            if isinstance(value, str):
                return split.sub(lambda found: found[0][0] + mark + found[0][1:], value)
            if isinstance(value, dict):
                return {key: defuse(item) for key, item in value.items()}
            if isinstance(value, list):
                return [defuse(item) for item in value]
            return value

        text = self.apply_chat_template(defuse(messages), add_generation_prompt, enable_thinking, defuse(tools))
        pieces = []
        for piece in split.split(text):                  # odd pieces: the template's special tokens
            if piece in self._special:
                pieces.append(ChatPiece(piece, [self._special[piece]], [(0, len(piece))], special=True))
            elif piece:
                pieces.append(self._text_piece(piece.replace(mark, ""), parse_special=mark not in piece))
        return pieces

    def _text_piece(self, text: str, parse_special: bool) -> ChatPiece:
        encoding = self._encoding(text, parse_special=parse_special)
        return ChatPiece(text, encoding.ids, encoding.offsets, special=False)

    def _literal_backend(self) -> tokenizers.Tokenizer:
        """A second backend that reads special tokens' strings as text (tokenizers' encode_special_tokens),
        made on first use (Qwen3's: 0.7 s and 90 MiB): the flag belongs to a backend, which other threads
        are encoding with."""
        with self._literal_lock:
            if self._literal is None:
                literal = tokenizers.Tokenizer.from_str(self._backend.to_str())
                literal.encode_special_tokens = True
                self._literal = literal
            return self._literal

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        # int() accepts NumPy integers, which the Rust binding rejects.
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for: a byte-level BPE token may hold part of a UTF-8 character
        (decoding it alone gives U+FFFD), an added token such as <|im_end|> is its text. b"" for an id
        past the tokenizer's vocabulary (a model's is padded)."""
        added = self._backend.get_added_tokens_decoder().get(token_id)
        if added is not None:
            return added.content.encode()
        piece = self._backend.id_to_token(token_id)
        return b"" if piece is None else bytes(_BYTE_OF_CHARACTER[ch] for ch in piece)

    def token_to_id(self, token: str) -> int:
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise QwenNPError(f"{TOKENIZER_FILE}: no token {token!r} in the vocabulary")
        return token_id

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The ``tokenizers`` object itself (export reads its vocabulary, merges and added tokens)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows (151669 for Qwen3; the model's vocab is padded)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token(self) -> str:
        token = self.special_token("eos_token")
        if token is None:
            raise QwenNPError(f"{CONFIG_FILE}: no eos_token")
        return token

    @property
    def eos_token_id(self) -> int:
        return self.token_to_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        token = self.special_token("pad_token")
        return None if token is None else self.token_to_id(token)

    @property
    def has_chat_template(self) -> bool:
        """False for a model that only continues text (e.g. the bundled Shakespeare model): no messages, no turns."""
        return self._template is not None

    def apply_chat_template(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Render ``messages`` with the checkpoint's chat template, as transformers does.

        ``enable_thinking`` is passed to the template only when given: Qwen3's template tests
        ``enable_thinking is false``, so None (the default) lets the model decide to think.
        """
        if self._template is None:
            raise QwenNPError(f"{CONFIG_FILE}: no chat_template (and no {TEMPLATE_FILE} next to it)")
        if not messages:
            raise QwenNPError("apply_chat_template: messages is empty")
        variables: dict[str, Any] = {**self._template_tokens()}  # bos_token, eos_token, ... as transformers passes them
        if enable_thinking is not None:
            variables["enable_thinking"] = enable_thinking
        try:
            return self._template.render(
                messages=_normalize_messages(messages),
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as exc:
            raise QwenNPError(f"chat template: {exc}") from exc

    def special_token(self, name: str) -> str | None:
        """A named special token ("bos_token", "eos_token", "pad_token", ...), or None when there is none."""
        value = self._config.get(name)
        # tokenizer_config.json stores a token either as its string or as a serialised AddedToken.
        return value["content"] if isinstance(value, dict) else value

    def _template_tokens(self) -> dict[str, str]:
        tokens = {name: self.special_token(name) for name in TEMPLATE_TOKEN_NAMES}
        return {name: token for name, token in tokens.items() if token is not None}


def _unused_character(values: Any) -> str:
    """A private-use character that no string in `values` (JSON-like: strings, lists, dicts) holds; found in
    one pass over their text, whatever characters a hostile message brings."""
    used = set(re.findall(f"[{chr(PRIVATE_USE[0])}-{chr(PRIVATE_USE[-1])}]",
                          json.dumps(values, ensure_ascii=False, default=str)))
    for code in PRIVATE_USE:
        if chr(code) not in used:
            return chr(code)
    raise QwenNPError("every private-use character is in the messages: none is left to mark their special "
                      "tokens with")


def _load_backend(path: Path) -> tokenizers.Tokenizer:
    if not path.is_file():
        raise QwenNPError(
            f"{path} not found: copy the checkpoint's {TOKENIZER_FILE} there, or build Qwen3's offline "
            f"with `python tools/build_tokenizer.py --out {path.parent}`"
        )
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust binding raises a bare Exception for unreadable files
        raise QwenNPError(f"{path}: not a valid {TOKENIZER_FILE}: {exc}") from exc


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as bad:
        raise QwenNPError(f"{path}: not UTF-8 text ({bad})") from None


def _load_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise QwenNPError(
            f"{path} not found: copy the checkpoint's {CONFIG_FILE} there "
            "(`python tools/build_tokenizer.py --config PATH` copies Qwen3's)"
        )
    return read_json_object(path)


def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in the environment transformers' ``_compile_jinja_template`` sets up."""

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        # Unlike jinja's own tojson, this does not HTML-escape, and it keeps non-ASCII text as is.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def _normalize_messages(messages: list[Message]) -> list[Message]:
    """Prepare messages as transformers does before rendering.

    Keys whose value is None are dropped (templates handle a missing key but would print "None"),
    except the content of an assistant message that calls tools (OpenAI's `content: null` beside
    `tool_calls`), which is no text: "" (Qwen3's template reads it as a string). Reasoning given as
    ``thinking``/``reasoning`` is also exposed as ``reasoning_content``, the field Qwen3's template reads.
    """
    normalized = []
    for message in messages:
        message = {key: value for key, value in message.items() if value is not None}
        if message.get("tool_calls") and "content" not in message:
            message["content"] = ""
        reasoning = next((message[key] for key in REASONING_FIELDS if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        normalized.append(message)
    return normalized


class StreamDecoder:
    """Incremental detokeniser: ``push`` one generated id at a time, then ``flush`` at the end.

    A character can span several byte-level tokens (most CJK characters and emoji do), so the
    text of the newest tokens can end in an incomplete UTF-8 sequence, which decodes to U+FFFD.
    As transformers' TextStreamer and vLLM's detokeniser do, the pending tokens are decoded
    together with the already-emitted tokens before them (the prefix) and text is released only
    once it no longer ends in U+FFFD. The pushed strings plus ``flush()`` equal ``decode`` of all ids.

    Hand-written rather than tokenizers.decoders.DecodeStream, which does the same windowing: it has
    no flush, so the held-back bytes of a reply cut off mid-character (max tokens reached) would be
    lost instead of showing as U+FFFD, breaking the equality above that generation relies on when it
    stops; and it needs tokenizers >= 0.21 where qwen_np supports 0.19.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []  # the prefix tokens, then the pending ones
        self._prefix_len = 0

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (often "", e.g. mid-character)."""
        self._ids.append(int(token_id))
        prefix, text = self._decode_window()
        if text.endswith(REPLACEMENT_CHAR) or len(text) <= len(prefix):
            return ""
        # The pending tokens become the next prefix; older ones are never needed again.
        del self._ids[: self._prefix_len]
        self._prefix_len = len(self._ids)
        return text[len(prefix) :]

    def flush(self) -> str:
        """Return whatever is still held back (invalid UTF-8 included, as U+FFFD) and reset."""
        prefix, text = self._decode_window()
        self._ids.clear()
        self._prefix_len = 0
        return text[len(prefix) :]

    def _decode_window(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        skip = self._skip_special_tokens
        return decode(self._ids[: self._prefix_len], skip), decode(self._ids, skip)


@dataclass(frozen=True)
class ChatDelta:
    """What to feed the model for the next chat turn, given what it has already been fed.

    ``keep`` leading tokens of the previously fed ids are still valid: truncate the KV cache to
    ``keep`` positions, then feed ``ids``.
    """

    keep: int
    ids: list[int]


def chat_delta(
    tokenizer: Tokenizer,
    fed_ids: Sequence[int],
    messages: list[Message],
    enable_thinking: bool | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> ChatDelta:
    """Render the whole chat (with the generation prompt) and return only the part not yet fed.

    ``fed_ids`` are all tokens the model has seen so far: earlier prompts and its own generated
    tokens. Append the model's raw reply (with its ``<think>`` block) to ``messages`` as an
    assistant message; the template itself decides what history keeps. Qwen3's template drops
    the reasoning of turns before the last user query, so after a new user message the earlier
    rendering is no longer a prefix: ``keep`` is then the common prefix of the old and new ids.
    The generated ids may also differ from how the rendering re-tokenises the same text, which
    the token-level comparison handles the same way.

    At least one token is always returned, so the caller gets fresh next-token logits.
    """
    ids = tokenizer.encode_chat(messages, add_generation_prompt=True, enable_thinking=enable_thinking, tools=tools)
    keep = min(common_prefix(fed_ids, ids), len(ids) - 1)
    return ChatDelta(keep=keep, ids=ids[keep:])


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading token ids two sequences share (a cache holding `a` keeps that many for `b`). In NumPy:
    a speculative step asks it of a whole conversation's ids at every proposal."""
    import numpy as np               # here: the tokenizer alone (the CLI's start) never needs NumPy

    n = min(len(a), len(b))
    differs = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differs[0]) if differs.size else n


def split_thinking(text: str) -> tuple[str, str]:
    """Split a reply into (thinking, answer), the way Qwen3's chat template reads it.

    The reasoning is what lies between ``<think>`` and ``</think>`` without surrounding newlines;
    the answer follows ``</think>`` without leading newlines. A reply still inside its think
    block (an opening tag, no closing one) is all thinking; a reply without tags is all answer.
    """
    if THINK_CLOSE in text:
        # As the template does: reasoning before the first "</think>", answer after the last one.
        parts = text.split(THINK_CLOSE)
        return parts[0].split(THINK_OPEN)[-1].strip("\n"), parts[-1].lstrip("\n")
    if THINK_OPEN in text:
        return text.split(THINK_OPEN)[-1].strip("\n"), ""
    return "", text


class ThinkingSplitter:
    """A reply streamed apart, piece by piece, exactly as split_thinking reads it whole: what lies inside
    <think>...</think> (without its surrounding newlines) as reasoning, what follows (without its leading
    newlines) as content; a reply that does not open with <think> is all content.

    feed(piece) returns the (field, text) parts the piece completes, field "reasoning" or "content".
    Newlines at the end of the reasoning so far are held back until the next piece shows whether the
    think block closes after them (the whole-reply reading drops them there)."""

    def __init__(self) -> None:
        self.state = "start"          # start -> reasoning -> answer_lead -> answer, or start -> answer_lead
        self.held = ""                # reasoning's trailing newlines, not yet sent
        self.reasoned = False         # whether any reasoning text was sent (its leading newlines are dropped)

    def feed(self, piece: str) -> list[tuple[str, str]]:
        parts: list[tuple[str, str]] = []
        while piece:
            if self.state == "start":
                opened = piece.startswith(THINK_OPEN)
                self.state, piece = ("reasoning", piece[len(THINK_OPEN):]) if opened else ("answer", piece)
            elif self.state == "reasoning":
                inside, closed, piece = piece.partition(THINK_CLOSE)
                text = self.held + inside
                if not self.reasoned:
                    text = text.lstrip("\n")
                kept = text.rstrip("\n")
                self.held = "" if closed else text[len(kept):]
                if kept:
                    parts.append(("reasoning", kept))
                    self.reasoned = True
                if closed:
                    self.state = "answer_lead"
            elif self.state == "answer_lead":
                piece = piece.lstrip("\n")
                if piece:
                    self.state = "answer"
            else:
                parts.append(("content", piece))
                piece = ""
        return parts

