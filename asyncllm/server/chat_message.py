"""The assistant message a chat reply's text becomes: reasoning apart (--reasoning-parser), tool
calls apart (tools with tool_choice), the rest content. One ChatMessageStream per choice turns
text deltas into OpenAI's delta fields; `message` does the same for the whole text at once, and a
stream assembles to it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncllm.server.reasoning_parsers import reasoning_parser
from asyncllm.server.tool_parsers import tool_parser
from asyncllm.server.tool_parsers.base import ToolCall, ToolParser, new_call_id
from asyncllm.server.tool_parsers.json_array import JsonArrayToolParser


@dataclass(frozen=True)
class MessageShape:
    """What a request asks of the reply: tool_mode none (text only), auto (the model's own
    format, read by the tool parser), required (a JSON array of calls) or named (the arguments of
    tool_name, as JSON)."""

    tool_mode: str = "none"
    tool_name: str | None = None
    tool_parser: str | None = None
    reasoning_parser: str | None = None

    @property
    def plain(self) -> bool:
        return self.tool_mode == "none" and self.reasoning_parser is None


class ChatMessageStream:
    def __init__(self, shape: MessageShape) -> None:
        self.shape = shape
        self.reasoning = (
            reasoning_parser(shape.reasoning_parser).stream() if shape.reasoning_parser else None
        )
        parser = _parser(shape)
        self.tools = parser.stream() if parser is not None else None
        self.named_id: str | None = None  # the named call's id once its first delta is out
        self.num_calls = 0
        # trailing whitespace of the content, held until more content follows: a reply with
        # calls drops it, as its whole message does
        self.held_space = ""

    def feed(self, text: str) -> dict[str, Any]:
        return self._delta(text, final=False)

    def finish(self) -> dict[str, Any]:
        return self._delta("", final=True)

    @property
    def called(self) -> bool:
        return self.num_calls > 0 or self.named_id is not None

    def _delta(self, text: str, final: bool) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        content = text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.finish() if final else self.reasoning.feed(text)
            if reasoning:
                delta["reasoning_content"] = reasoning
        if self.shape.tool_mode == "named":
            if content or final:
                delta["tool_calls"] = [self._named_fragment(content)]
            return delta
        if self.tools is not None:
            settled = self.tools.finish() if final else self.tools.feed(content)
            if settled.tool_calls:
                delta["tool_calls"] = [self._call_delta(c) for c in settled.tool_calls]
            content = self._without_trailing_space(settled.content, final)
        if content:
            delta["content"] = content
        return delta

    def _without_trailing_space(self, content: str, final: bool) -> str:
        content = self.held_space + content
        kept = content.rstrip()
        self.held_space = content[len(kept) :]
        if final and not self.called:
            kept, self.held_space = content, ""
        return kept

    def _named_fragment(self, arguments: str) -> dict[str, Any]:
        if self.named_id is None:
            self.named_id = new_call_id()
            function = {"name": self.shape.tool_name, "arguments": arguments}
            return {"index": 0, "id": self.named_id, "type": "function", "function": function}
        return {"index": 0, "function": {"arguments": arguments}}

    def _call_delta(self, call: ToolCall) -> dict[str, Any]:
        delta = {"index": self.num_calls, **call.to_openai()}
        self.num_calls += 1
        return delta


def message(shape: MessageShape, text: str) -> dict[str, Any]:
    """The whole reply as an assistant message."""
    result: dict[str, Any] = {"role": "assistant", "content": text}
    if shape.reasoning_parser is not None:
        reasoning, text = reasoning_parser(shape.reasoning_parser).parse(text)
        result["reasoning_content"] = reasoning
        result["content"] = text
    if shape.tool_mode == "named":
        call = ToolCall(shape.tool_name, text)
        return {**result, "content": None, "tool_calls": [call.to_openai()]}
    parser = _parser(shape)
    if parser is None:
        return result
    parsed = parser.parse(text)
    if not parsed.tool_calls:
        return result
    content = parsed.content.rstrip() or None
    calls = [c.to_openai() for c in parsed.tool_calls]
    return {**result, "content": content, "tool_calls": calls}


def _parser(shape: MessageShape) -> ToolParser | None:
    if shape.tool_mode == "required":
        return JsonArrayToolParser()
    if shape.tool_mode == "auto" and shape.tool_parser is not None:
        return tool_parser(shape.tool_parser)
    return None
