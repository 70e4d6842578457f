"""The error a refused request raises: it names the field at fault, so a server maps it to an
OpenAI error without reading the message."""

from __future__ import annotations


class ValidationError(ValueError):
    """A request value the engine refuses. A ValueError, so offline `LLM` users catch it as one;
    `param` is the request field at fault, `code` OpenAI's error code where it has one."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code
