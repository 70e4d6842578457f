"""A chat reply's text as an assistant message: tool calls for tool_choice auto, required and
named, reasoning apart; streamed in random chunks, it assembles to the whole reply's message."""

from __future__ import annotations

import json

import pytest
from test_parsers_support import streamed

from asyncllm.errors import ValidationError
from asyncllm.sampling_params import SamplingParams
from asyncllm.server.chat_message import ChatMessageStream, MessageShape, message
from asyncllm.server.tools import apply_tools, template_messages

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}

# shape, reply text, the message's content, reasoning_content and calls (name, arguments)
REPLIES = [
    (
        MessageShape("named", "get_weather"),
        '{"city": "Oslo"}',
        None,
        None,
        [("get_weather", {"city": "Oslo"})],
    ),
    (
        MessageShape("required"),
        '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]',
        None,
        None,
        [("get_time", {}), ("get_weather", {"city": "Rome"})],
    ),
    (
        MessageShape("auto", tool_parser="hermes", reasoning_parser="qwen3"),
        '<think>Need the time.</think>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
        None,
        "Need the time.",
        [("get_time", {})],
    ),
    (MessageShape("auto", tool_parser="hermes"), "No tools needed.", "No tools needed.", None, []),
    (MessageShape(reasoning_parser="deepseek_r1"), "hmm</think>42", "42", "hmm", []),
]


def calls(tool_calls) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in tool_calls]


@pytest.mark.parametrize(("shape", "text", "content", "reasoning", "expected"), REPLIES)
def test_whole_reply(shape, text, content, reasoning, expected) -> None:
    reply = message(shape, text)
    assert reply["content"] == content
    assert reply.get("reasoning_content") == reasoning
    assert calls(reply.get("tool_calls", [])) == expected


@pytest.mark.parametrize(("shape", "text", "content", "reasoning", "expected"), REPLIES)
def test_streamed_reply_assembles_to_the_whole(shape, text, content, reasoning, expected) -> None:
    for seed in range(10):
        stream = ChatMessageStream(shape)
        deltas = streamed(stream, text, seed, max_chunk=6)
        assert "".join(d.get("content", "") for d in deltas) == (content or "")
        assert "".join(d.get("reasoning_content", "") for d in deltas) == (reasoning or "")
        assembled: dict[int, dict] = {}
        for d in deltas:
            for fragment in d.get("tool_calls", []):
                call = assembled.setdefault(
                    fragment["index"], {"function": {"name": "", "arguments": ""}}
                )
                if "id" in fragment:
                    assert fragment["type"] == "function" and fragment["id"].startswith("call_")
                    call["function"]["name"] = fragment["function"]["name"]
                call["function"]["arguments"] += fragment["function"]["arguments"]
        assert calls([assembled[i] for i in sorted(assembled)]) == expected
        assert stream.called == bool(expected)


def test_named_and_required_choices_set_the_constraint() -> None:
    params = SamplingParams()
    shape, tools = apply_tools(
        {
            "tools": [WEATHER, TIME],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
        params,
        None,
        None,
    )
    assert shape == MessageShape("named", "get_weather") and tools == [WEATHER, TIME]
    assert params.structured_outputs.json == WEATHER["function"]["parameters"]
    params = SamplingParams()
    apply_tools(
        {"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False},
        params,
        None,
        None,
    )
    schema = params.structured_outputs.json
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2


def test_required_choice_moves_the_tools_definitions_to_the_root() -> None:
    from asyncllm.structured_output.grammar import check_structured_outputs

    parameters = {
        "type": "object",
        "properties": {"unit": {"$ref": "#/$defs/Unit"}},
        "required": ["unit"],
        "$defs": {"Unit": {"enum": ["c", "f"]}},
    }
    tool = {"type": "function", "function": {"name": "temp", "parameters": parameters}}
    params = SamplingParams()
    apply_tools({"tools": [tool, TIME], "tool_choice": "required"}, params, None, None)
    assert params.structured_outputs.json["$defs"] == {"Unit": {"enum": ["c", "f"]}}
    check_structured_outputs(params.structured_outputs)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}
                ]
            },
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {}}], "tool_choice": "required"},
            "tools[0].function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER]}, "tool_choice"),  # auto without --tool-call-parser
    ],
)
def test_bad_tool_fields_name_the_field(fields, param) -> None:
    with pytest.raises(ValidationError) as raised:
        apply_tools(fields, SamplingParams(), None, None)
    assert raised.value.param == param


def test_assistant_tool_calls_reach_the_template_as_objects() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    (rendered,) = template_messages([{"role": "assistant", "content": "", "tool_calls": [call]}])
    assert rendered["tool_calls"][0]["function"]["arguments"] == {"a": 1}
