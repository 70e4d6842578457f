"""Hermes format (Qwen2.5, Qwen3): <tool_call>{"name": ..., "arguments": {...}}</tool_call>,
any number of them, text around them. A block whose JSON is no call stays content."""

from __future__ import annotations

import json

from asyncllm.server.tool_parsers.base import ToolCall, ToolParser, call_from_json, content_before

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    def split(self, text: str, final: bool) -> list[str | ToolCall]:
        pieces: list[str | ToolCall] = []
        position = 0
        while True:
            content, start = content_before(text, position, OPEN, final)
            pieces.append(content)
            if start is None:
                return pieces
            close = text.find(CLOSE, start + len(OPEN))
            if close < 0 and not final:
                return pieces
            end = len(text) if close < 0 else close + len(CLOSE)
            body = text[start + len(OPEN) : close if close >= 0 else len(text)]
            pieces.append(_call(body) or text[start:end])
            position = end


def _call(body: str) -> ToolCall | None:
    try:
        return call_from_json(json.loads(body))
    except ValueError:
        return None
