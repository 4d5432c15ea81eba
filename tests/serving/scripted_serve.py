"""`python tests/serving/scripted_serve.py serve --model FOLDER ...`: the real `serve` (its HTTP, template, tokenizer,
batcher, grammar masks, reply parsing) over a model whose replies a test scripts, for tests/serving/test_serve_tools.py.

The model's forward passes run as usual; only its logits are replaced, before sampling, by a script's: the
conversation's first user message holds the replies, one per assistant turn, separated by SEPARATOR, each
tokenised with special tokens parsed (so "<tool_call>" and "<think>" are those tokens) and ended by
<|im_end|>. Each position's logits are 0 but the script's next token's, SCRIPTED_LOGIT: greedily and when
sampling (its probability is 1 - 1e-8) that token comes, unless a grammar masks it out; then the grammar's
own choice among its allowed tokens (all equal) stands in, and the script goes on at the next position.
"""

from __future__ import annotations

import sys

import numpy as np

from qwen_np import cli
from qwen_np.generation.generate import Continuation, TokenEvent
from qwen_np.generation.speculative import Draft

SEPARATOR = "\n=====\n"
SCRIPTED_LOGIT = 40.0
USER, ASSISTANT, END = "<|im_start|>user\n", "<|im_start|>assistant", "<|im_end|>"


def script(continuation: Continuation) -> list[int]:
    """The token ids of the reply this conversation's prompt scripts (its turn: the assistant turns before it)."""
    tokenizer = continuation.tokenizer
    prompt = tokenizer.decode(continuation.sequence[:len(continuation.sequence) - len(continuation.generated)])
    replies = prompt.split(USER, 1)[1].split(END, 1)[0].split(SEPARATOR)
    turn = min(prompt.count(ASSISTANT) - 1, len(replies) - 1)
    return tokenizer.encode(replies[turn], parse_special=True) + [tokenizer.token_to_id(END)]


def scripted_verify(self: Continuation, logits: np.ndarray, draft: Draft) -> list[TokenEvent]:
    ids = script(self)
    scripted = np.zeros_like(logits)                                   # [1, V]: no speculation here
    scripted[0, ids[min(len(self.generated), len(ids) - 1)]] = SCRIPTED_LOGIT
    return ORIGINAL(self, scripted, draft)


ORIGINAL = Continuation.verify

if __name__ == "__main__":
    Continuation.verify = scripted_verify              # type: ignore[method-assign]
    sys.exit(cli.main(sys.argv[1:]))
