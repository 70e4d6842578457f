"""tools, tool_choice and parallel_tool_calls of a chat request: checked (400s naming the field),
the tools handed to the chat template, and tool_choice required or named enforced with a JSON
schema, so that the arguments always parse."""

from __future__ import annotations

import contextlib
import json
from typing import Any

from asyncllm.errors import ValidationError
from asyncllm.sampling_params import SamplingParams, StructuredOutputsParams
from asyncllm.server.chat_message import MessageShape

TOOL_CHOICES = ("none", "auto", "required")
_ANY_OBJECT = {"type": "object"}


def check_tools(tools: list[Any]) -> dict[str, dict[str, Any]]:
    """Function name -> its parameters schema; each must be a function with a name and a
    schema xgrammar can read."""
    from asyncllm.structured_output.grammar import check_structured_outputs

    functions = {}
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise ValidationError(f"{at} must be a function tool.", at)
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValidationError(
                f"{at}.function.name must be a non-empty string.", f"{at}.function.name"
            )
        parameters = function.get("parameters", _ANY_OBJECT)
        param = f"{at}.function.parameters"
        if not isinstance(parameters, dict):
            raise ValidationError(f"{param} must be a JSON schema object.", param)
        check_structured_outputs(StructuredOutputsParams(json=parameters), param)
        functions[name] = parameters
    return functions


def apply_tools(
    values: dict[str, Any],
    params: SamplingParams,
    tool_parser: str | None,
    reasoning_parser: str | None,
) -> tuple[MessageShape, list[Any] | None]:
    """The reply's shape and the tools for the template (None: none); sets the constraint of
    tool_choice required or named on params."""
    tools = values.get("tools")
    functions = check_tools(tools) if tools else {}
    choice = values.get("tool_choice", "auto" if tools else "none")
    mode, name = _mode(choice, functions)
    if mode == "auto" and tool_parser is None:
        raise ValidationError(
            'tool_choice "auto" needs the server started with --tool-call-parser.', "tool_choice"
        )
    shape = MessageShape(mode, name, tool_parser, reasoning_parser)
    if mode in ("required", "named"):
        if params.structured_outputs is not None:
            raise ValidationError(
                "tool_choice required or named cannot be combined with structured outputs.",
                "tool_choice",
            )
        parallel = values.get("parallel_tool_calls", True)
        schema = functions[name] if mode == "named" else _calls_schema(functions, parallel)
        params.structured_outputs = StructuredOutputsParams(json=schema)
    return shape, (tools if mode != "none" else None)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant tool calls as chat templates read them: arguments as objects, not JSON text."""
    return [_with_argument_objects(m) if m.get("tool_calls") else m for m in messages]


def _mode(choice: Any, functions: dict[str, Any]) -> tuple[str, str | None]:
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise ValidationError(
                f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a named function.",
                "tool_choice",
            )
        if choice != "none" and not functions:
            raise ValidationError(f'tool_choice "{choice}" needs tools.', "tool_choice")
        return choice, None
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if name not in functions:
        raise ValidationError(
            f"tool_choice names a function that is not among the tools: {name!r}.",
            "tool_choice",
        )
    return "named", name


def _calls_schema(functions: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """A JSON array of one call or more (one only without parallel_tool_calls). The tools'
    definitions move to the root, where their references (#/$defs/...) point."""
    calls, definitions = [], {}
    for name, parameters in functions.items():
        parameters = dict(parameters)
        definitions.update(parameters.pop("$defs", {}))
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"enum": [name]}, "arguments": parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if definitions:
        schema["$defs"] = definitions
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _with_argument_objects(message: dict[str, Any]) -> dict[str, Any]:
    calls = []
    for call in message["tool_calls"]:
        function = dict(call.get("function") or {})
        if isinstance(function.get("arguments"), str):
            # text that is no JSON, the template renders as it came
            with contextlib.suppress(ValueError):
                function["arguments"] = json.loads(function["arguments"])
        calls.append({**call, "function": function})
    return {**message, "tool_calls": calls}
