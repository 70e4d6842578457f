"""Tool-call parsers chosen by --tool-call-parser: a model's raw output -> content and calls."""

from __future__ import annotations

from asyncllm.server.tool_parsers.base import ToolParser
from asyncllm.server.tool_parsers.hermes import HermesToolParser
from asyncllm.server.tool_parsers.llama3_json import Llama3JsonToolParser
from asyncllm.server.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}


def tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(
            f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}; got {name!r}."
        )
    return TOOL_PARSERS[name]()
