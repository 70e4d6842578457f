"""Tool-call parsers on outputs recorded in each model family's format: several calls, text
around them, malformed JSON. Streamed in random chunk sizes, every output assembles to exactly
its whole parse."""

from __future__ import annotations

import json

import pytest
from test_parsers_support import streamed

from asyncllm.server.tool_parsers import TOOL_PARSERS, tool_parser

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TIME = '{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}'

# parser -> (recorded output, expected content, expected (name, arguments) of each call)
RECORDED = {
    "hermes": [
        (
            f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>",
            "\n",
            [
                ("get_weather", {"city": "Paris", "unit": "celsius"}),
                ("get_time", {"zone": "Europe/Paris"}),
            ],
        ),
        (
            f"Let me check.\n<tool_call>\n{TIME}\n</tool_call> Done.",
            "Let me check.\n Done.",
            [("get_time", {"zone": "Europe/Paris"})],
        ),
        (
            '<tool_call>\n{"name": "broken", "arguments": {</tool_call> after',
            '<tool_call>\n{"name": "broken", "arguments": {</tool_call> after',
            [],
        ),
        (
            f"<tool_call>{TIME}",
            "",
            [("get_time", {"zone": "Europe/Paris"})],
        ),  # stopped before the close
        (
            "Just text, a < sign and <tool_ but no call.",
            "Just text, a < sign and <tool_ but no call.",
            [],
        ),
    ],
    "llama3_json": [
        (
            '{"name": "get_time", "parameters": {"zone": "UTC"}}',
            "",
            [("get_time", {"zone": "UTC"})],
        ),
        (
            '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}',
            "",
            [("a", {"x": 1}), ("b", {})],
        ),
        ("The weather is fine {not json}.", "The weather is fine {not json}.", []),
        ('{"name": "a", "parameters": {"x": 1}}; {"oops": ', '{"oops": ', [("a", {"x": 1})]),
    ],
    "mistral": [
        (
            f"[TOOL_CALLS] [{WEATHER}, {TIME}]",
            "",
            [
                ("get_weather", {"city": "Paris", "unit": "celsius"}),
                ("get_time", {"zone": "Europe/Paris"}),
            ],
        ),
        (f"Sure. [TOOL_CALLS][{TIME}]", "Sure. ", [("get_time", {"zone": "Europe/Paris"})]),
        (
            '[TOOL_CALLS] [{"name": "x", "arguments": ',
            '[TOOL_CALLS] [{"name": "x", "arguments": ',
            [],
        ),
        ("[TOOL_CALLS] [1, 2] and text", "[TOOL_CALLS] [1, 2] and text", []),
    ],
}
CASES = [(name, *case) for name, cases in RECORDED.items() for case in cases]


def calls_of(tool_calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in tool_calls]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_whole_output_parses(parser, text, content, calls) -> None:
    parsed = tool_parser(parser).parse(text)
    assert parsed.content == content
    assert calls_of(parsed.tool_calls) == calls


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_streams_in_random_chunks_assemble_to_the_whole_parse(parser, text, content, calls) -> None:
    for seed in range(20):
        deltas = streamed(tool_parser(parser).stream(), text, seed)
        assert "".join(d.content for d in deltas) == content
        assert calls_of([c for d in deltas for c in d.tool_calls]) == calls


def test_mistral_ids_are_nine_alphanumerics() -> None:
    (call,) = tool_parser("mistral").parse(f"[TOOL_CALLS][{TIME}]").tool_calls
    assert len(call.id) == 9 and call.id.isalnum()


def test_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="hermes"):
        tool_parser("nope")
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral"}
