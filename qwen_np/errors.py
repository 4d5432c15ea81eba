"""The exceptions of bad input: QwenNPError for files, configs and arguments (the CLI prints one line, exit 2),
APIError for an HTTP request (the server answers OpenAI's error JSON)."""

from __future__ import annotations

from typing import Any


class QwenNPError(Exception):
    """The one exception qwen_np raises for bad files, configs and arguments; its message names the file, tensor or flag."""


class APIError(Exception):
    """A request the server answers with OpenAI's error JSON: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
