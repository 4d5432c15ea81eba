"""Tokens as short quoted text, aligned in terminal columns (for the lens and attention views)."""

from __future__ import annotations

import unicodedata
from typing import Any


def token_text(tokenizer: Any, token_id: int, width: int = 14) -> str:
    """One token as quoted text, with whitespace made visible ('\\n') and long tokens shortened."""
    text = repr(tokenizer.decode([token_id]))
    return text if len(text) <= width else text[:width - 2] + "…" + text[-1]


def pad(text: str, width: int) -> str:
    """Left-align text in `width` terminal columns; CJK and other wide characters take two."""
    columns = sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)
    return text + " " * max(0, width - columns)
