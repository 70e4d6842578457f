"""What every tool-call format shares. A format only says how to split text into settled
pieces (content, calls) and the pending rest; parsing the whole output and streaming it are the
same split, of the whole text so far, so a stream always assembles to the whole output's
parse. A call's arguments stream as one fragment, once the call is whole."""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass
class ParsedOutput:
    content: str
    tool_calls: list[ToolCall]


def call_from_json(value: Any, arguments_key: str = "arguments") -> ToolCall | None:
    """{"name": ..., "arguments": {...}} as a call; None when it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, {})
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def content_before(text: str, position: int, marker: str, final: bool) -> tuple[str, int | None]:
    """The content from position to the next marker, and where the marker starts; with no
    marker, the content to the end (less what may still become one) and None."""
    start = text.find(marker, position)
    if start >= 0:
        return text[position:start], start
    end = len(text) if final else len(text) - held_back(text[position:], marker)
    return text[position:end], None


def held_back(text: str, marker: str) -> int:
    """Length of the longest end of text that could be the start of marker."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ToolParser(ABC):
    @abstractmethod
    def split(self, text: str, final: bool) -> list[str | ToolCall]:
        """The settled pieces of text in order (a str is content); with final, all of it is
        settled."""

    def parse(self, text: str) -> ParsedOutput:
        return _assemble(self.split(text, final=True))

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


class ToolCallStream:
    """Text in as it arrives; each feed splits the whole text so far and gives what grew: the
    settled content and calls of a text only ever grow as text is added."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.content_sent = 0
        self.calls_sent = 0

    def feed(self, text: str) -> StreamDelta:
        return self._settle(text, final=False)

    def finish(self) -> StreamDelta:
        return self._settle("", final=True)

    def _settle(self, text: str, final: bool) -> StreamDelta:
        self.text += text
        settled = _assemble(self.parser.split(self.text, final))
        delta = StreamDelta(
            settled.content[self.content_sent :], settled.tool_calls[self.calls_sent :]
        )
        self.content_sent, self.calls_sent = len(settled.content), len(settled.tool_calls)
        return delta


def _assemble(pieces: list[str | ToolCall]) -> ParsedOutput:
    content = "".join(p for p in pieces if isinstance(p, str))
    return ParsedOutput(content, [p for p in pieces if isinstance(p, ToolCall)])
