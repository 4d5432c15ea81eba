"""Numbers a response carries are finite, or the request is refused: a 422 naming its field and, where it
can, the token. JSON has no NaN (a response holding one fails to encode: a 500), and base64 floats would
carry it to the client in silence.

A model's numbers can be non-finite for some tokens only: an embedding row holding a NaN or an Inf (what
a NaN block scale in a GGUF's embedding gives; the start-up check, engine.finite.check_weights_finite,
reads token 0's row alone), or a layer that overflows FP32 for some inputs. The request is valid and this
model cannot answer it, hence 422 (Unprocessable), not 400; every other request is untouched, each row's
numbers being its own in a forward pass.

Imports nothing of serving/ (it is near the bottom of the folder, with access.py and protocol.py).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..core import layers
from ..core.model import Qwen3Model
from ..errors import APIError
from ..files.tokenizer import Tokenizer

NON_FINITE = "non_finite_numbers"           # the error's code


def not_finite(model: Qwen3Model, tokenizer: Tokenizer, ids: Sequence[int], where: str, param: str | None,
               prompt_tokens: int | None = None) -> APIError:
    """The 422 of a request whose numbers came out NaN or Inf for `ids` (`where`: the input they are, e.g.
    "input[1]", naming the field `param`), naming the first token whose embedding row is not finite where
    there is one. ids past `prompt_tokens` are the reply's: a culprit among them is named as generated,
    and the error then names no field (the request was fine; the model wrote the token)."""
    rows = layers.embed(np.asarray(ids, dtype=np.int64), model.embed_tokens)            # [T, D]
    broken = np.flatnonzero(~np.isfinite(rows).all(axis=1))
    why = "a layer's weights hold NaN or Inf, or its values overflow FP32, for these tokens"
    if broken.size:
        position = int(broken[0])
        token = int(ids[position])
        generated = prompt_tokens is not None and position >= prompt_tokens
        why = (f"the embedding row of {'generated ' if generated else ''}token {token} "
               f"({tokenizer.decode([token])!r}) holds NaN or Inf")
        if generated:
            where, param = "the reply", None
    return APIError(422, f"{where}: the model's numbers are not finite (NaN or Inf) for this input: {why}; "
                         "the checkpoint's weights are at fault there, not the request", param, NON_FINITE)


def all_finite(values: Sequence[float]) -> bool:
    """Whether every number is finite (log-probabilities: -inf, NaN and +inf are none of JSON's)."""
    return bool(np.isfinite(np.asarray(values, dtype=np.float64)).all())
