"""A thinking budget: a reply's thinking held to at most N tokens, as Qwen3's technical report (section 4.3,
"Thinking Budget") describes it. When the thinking (the tokens after <think>) reaches the budget without
having closed, the server stops it by writing Qwen's own stop-thinking text, CLOSING, ending with </think>,
and the model writes its answer after it. So every reply's thinking ends within N tokens plus CLOSING.

The budget counts from the reply's <think>, or from the reply's start when the prompt itself ends inside an
open think block (a template that opens it). OpenAI's reasoning_effort has no token meaning of its own: the
server maps it to a budget (EFFORT_BUDGETS). generate.Continuation holds one per sequence and asks it, at
each position, which token it forces (None: the model chooses).
"""

from __future__ import annotations

from typing import Sequence

from ..errors import QwenNPError
from ..files.tokenizer import THINK_CLOSE, THINK_OPEN, Tokenizer

# Qwen's stop-thinking instruction, the text the report's server inserts at the budget (its "</think>." and
# blank line included).
CLOSING = ("Considering the limited time by the user, I have to give the solution based on the thinking "
           "directly now.\n</think>.\n\n")
# reasoning_effort's budgets, in thinking tokens (minutes of decode on two cores for the larger ones).
EFFORT_BUDGETS = {"none": 0, "minimal": 0, "low": 512, "medium": 2048, "high": 8192}


class ThinkingBudget:
    """One sequence's thinking and its budget: how many thinking tokens it has written, and once the budget is
    spent, the tokens of CLOSING still to force. forced() is the token the next position must take (None:
    the model chooses); saw(token) follows each token chosen."""

    def __init__(self, tokenizer: Tokenizer, budget: int, prompt: Sequence[int]) -> None:
        if budget < 0:
            raise QwenNPError(f"must be >= 0, got {budget}", "thinking_budget")
        try:
            opening, closing = tokenizer.token_to_id(THINK_OPEN), tokenizer.token_to_id(THINK_CLOSE)
        except QwenNPError:
            raise QwenNPError(f"this tokenizer has no {THINK_OPEN} and {THINK_CLOSE} tokens (the model does not "
                              "think), so there is no thinking to budget", "thinking_budget") from None
        self.budget, self.opening, self.closing = budget, opening, closing
        self.closing_ids = tokenizer.encode(CLOSING, parse_special=True)
        last_open = max((i for i, t in enumerate(prompt) if t == opening), default=-1)
        last_close = max((i for i, t in enumerate(prompt) if t == closing), default=-1)
        self.thinking = last_open > last_close            # the prompt ends inside an open think block
        self.done = False                                  # the thinking has closed: nothing more to count
        self.spent = 0                                     # thinking tokens written
        self.pending: list[int] = []                       # CLOSING's tokens still to force

    def forced(self) -> int | None:
        """The token the next position must take: CLOSING's next, once the budget is spent."""
        if self.thinking and not self.done and not self.pending and self.spent >= self.budget:
            self.pending = list(self.closing_ids)
        return self.pending[0] if self.pending else None

    def saw(self, token: int) -> None:
        """Follow a token the sequence took (forced or chosen)."""
        if self.pending and token == self.pending[0]:
            self.pending.pop(0)
            if token == self.closing:
                self.done = True                            # what follows </think> in CLOSING is the answer's
            return
        self.pending = []                                   # a grammar took another token: it leads now
        if self.done:
            return
        if token == self.closing:
            self.done = self.thinking
        elif self.thinking:
            self.spent += 1
        elif token == self.opening:
            self.thinking = True

