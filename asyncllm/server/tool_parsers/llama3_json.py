"""Llama 3.x JSON format: an output that opens with a JSON object (or <|python_tag|>) is calls,
{"name": ..., "parameters": {...}}, separated by ";". Any other output is content, and so is
whatever follows the first piece that is not a call."""

from __future__ import annotations

import json

from asyncllm.server.tool_parsers.base import ToolCall, ToolParser, call_from_json

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


class Llama3JsonToolParser(ToolParser):
    def split(self, text: str, final: bool) -> list[str | ToolCall]:
        opening = text.lstrip()
        if not opening or PYTHON_TAG.startswith(opening):
            return [text] if final else []
        if not (opening.startswith("{") or opening.startswith(PYTHON_TAG)):
            return [text]
        position = len(text) - len(opening)
        if opening.startswith(PYTHON_TAG):
            position += len(PYTHON_TAG)
        return _calls(text, position, final)


def _calls(text: str, position: int, final: bool) -> list[str | ToolCall]:
    """Calls from position on; the rest, once one piece is no call, is content."""
    pieces: list[str | ToolCall] = []
    while True:
        position = _skip_separators(text, position)
        if position == len(text):
            return pieces
        try:
            value, end = _DECODER.raw_decode(text, position)
        except ValueError:
            if not final:
                return pieces
            value, end = None, len(text)
        key = "parameters" if isinstance(value, dict) and "parameters" in value else "arguments"
        call = call_from_json(value, key)
        if call is None:
            pieces.append(text[position:])
            return pieces if final else pieces[:-1]
        pieces.append(call)
        position = end


def _skip_separators(text: str, position: int) -> int:
    while position < len(text) and (text[position].isspace() or text[position] == ";"):
        position += 1
    return position
