"""Tokens as short quoted text, aligned in terminal columns (for the lens and attention views)."""

from __future__ import annotations

import unicodedata
from typing import Any


def token_text(tokenizer: Any, token_id: int, width: int = 14) -> str:
    """One token as quoted text, with whitespace made visible ('\\n') and long tokens shortened. A token that is
    part of a UTF-8 character (decoding alone gives '\ufffd') shows its bytes instead: b'\\xe2\\x80'."""
    decoded = tokenizer.decode([token_id])
    raw = token_bytes(tokenizer, token_id) if "\ufffd" in decoded else None
    text = repr(raw if raw is not None else decoded)
    return text if len(text) <= width else text[:width - 2] + "…" + text[-1]


def _byte_characters() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes stand for themselves, the other 68
    for the characters from U+0100 on, in order. Hand-written: `tokenizers` applies it but does not expose it."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(moved)}}


BYTE_CHARACTERS = _byte_characters()


def token_bytes(tokenizer: Any, token_id: int) -> bytes | None:
    """The bytes a byte-level BPE token stands for, or None when its vocabulary entry is not byte-level."""
    piece = tokenizer.backend.id_to_token(token_id)
    if piece is None or any(ch not in BYTE_CHARACTERS for ch in piece):
        return None
    return bytes(BYTE_CHARACTERS[ch] for ch in piece)


def pad(text: str, width: int) -> str:
    """Left-align text in `width` terminal columns; CJK and other wide characters take two."""
    columns = sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)
    return text + " " * max(0, width - columns)
