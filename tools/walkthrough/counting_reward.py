"""The reasoning chapter's checker (walkthrough_chapter_reason.py): the reward function `train --grpo` and
`eval --prompts` call, and the answer extractor `generate --vote` calls, for the task "how many 1s".

A prompts line is {"messages": [{"role": "user", "content": "011010010111"}], "answer": 7}: the line's other
fields (here `answer`) are passed to the reward function by name, as TRL passes a dataset's other columns.
"""

from __future__ import annotations

import re
from typing import Any

# A reply that is an answer: digits, nothing else but surrounding whitespace. Stricter than "the last number
# in the reply" on purpose: a reply that writes two numbers has not answered.
ANSWER = re.compile(r"\s*(\d+)\s*")


def extract(completion: str) -> str | None:
    """The reply's answer, its digits (None, no vote, when the reply is not just a number)."""
    found = ANSWER.fullmatch(completion)
    return found.group(1) if found else None


def reward(prompt: Any, completion: str, answer: int, **row: Any) -> float:
    """1.0 when the reply is the count, 0.0 otherwise (a reward > 0 counts as correct for pass@k)."""
    given = extract(completion)
    return float(given is not None and int(given) == answer)
