"""The exceptions of bad input: QwenNPError for files, configs and arguments (the CLI prints one line, exit 2),
APIError for an HTTP request (the server answers OpenAI's error JSON).

The library names its own parameters, never a front end's: an error about one carries its name in `param`
("kv_dtype: expected one of fp32, bf16, fp16, int8, got 'x'"), and each front end words it with its own name for
that parameter (`worded`): the CLI with its flag (commands.FLAGS: "--kv-dtype: ..."), the server with its JSON
field (serving/requests.FIELDS). A message that names a parameter again in its text writes it in backticks
("drop `seed`"), and the front end words that one too (reworded).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

NAMED = re.compile(r"`(\w+)`")          # a parameter named in a message's text: `seed`


def reworded(text: str, names: Mapping[str, str]) -> str:
    """`text` (an error's or a notice's) with each parameter it names in backticks under a front end's name
    for it (`names`: parameter -> flag or field); one `names` does not know keeps its backticks."""
    return NAMED.sub(lambda named: names.get(named[1], named[0]), text)


class QwenNPError(Exception):
    """The one exception qwen_np raises for bad files, configs and arguments; its message names the file,
    tensor or parameter. `param`: the library parameter the error is about (a keyword of the function that
    was called, e.g. "kv_dtype"), written before the message ("kv_dtype: ..."); None for a file's or
    tensor's error, whose message names the file itself."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(f"{param}: {message}" if param is not None else message)
        self.param, self.detail = param, message

    def worded(self, names: Mapping[str, str]) -> str:
        """The message with its parameter, and those its text names (reworded), under a front end's name for
        them (`names`: parameter -> flag or field); a parameter `names` does not know keeps its own name."""
        if self.param is None:
            return reworded(str(self), names)
        return f"{names.get(self.param, self.param)}: {reworded(self.detail, names)}"

    def __reduce__(self) -> tuple[Any, ...]:          # a copy (pickle, copy.copy) keeps `param`
        return type(self), (self.detail, self.param)


class APIError(Exception):
    """A request the server answers with OpenAI's error JSON: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
