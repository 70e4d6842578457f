"""Mistral format: content, then [TOOL_CALLS] and a JSON array of {"name", "arguments"}
objects. An array that is not calls stays content; ids are 9 alphanumerics, as Mistral's
templates require."""

from __future__ import annotations

import uuid

from asyncllm.server.tool_parsers.base import ToolCall, ToolParser, content_before
from asyncllm.server.tool_parsers.json_array import decode_calls

MARKER = "[TOOL_CALLS]"


class MistralToolParser(ToolParser):
    def split(self, text: str, final: bool) -> list[str | ToolCall]:
        pieces: list[str | ToolCall] = []
        position = 0
        while True:
            content, start = content_before(text, position, MARKER, final)
            pieces.append(content)
            if start is None:
                return pieces
            decoded = decode_calls(text, start + len(MARKER))
            if decoded is None:
                if final:
                    pieces.append(text[start:])
                return pieces
            calls, end = decoded
            for call in calls or []:
                call.id = uuid.uuid4().hex[:9]
            pieces.extend(calls if calls is not None else [text[start:end]])
            position = end
