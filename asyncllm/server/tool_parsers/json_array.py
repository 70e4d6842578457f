"""A JSON array of {"name", "arguments"} objects: the output tool_choice "required" constrains
the model to, and the body of Mistral's [TOOL_CALLS]."""

from __future__ import annotations

import json

from asyncllm.server.tool_parsers.base import ToolCall, ToolParser, call_from_json

_DECODER = json.JSONDecoder()


def decode_calls(text: str, position: int) -> tuple[list[ToolCall] | None, int] | None:
    """(the calls, or None when the array holds something else; where it ends) of the array at
    position (after whitespace); None while it is incomplete or not JSON."""
    while position < len(text) and text[position].isspace():
        position += 1
    try:
        value, end = _DECODER.raw_decode(text, position)
    except ValueError:
        return None
    if not isinstance(value, list) or not value:
        return None, end
    calls = [call_from_json(v) for v in value]
    return (None if any(c is None for c in calls) else calls), end


class JsonArrayToolParser(ToolParser):
    def split(self, text: str, final: bool) -> list[str | ToolCall]:
        decoded = decode_calls(text, 0)
        if decoded is None:
            return [text] if final else []
        calls, end = decoded
        return [*(calls if calls is not None else [text[:end]]), text[end:]]
