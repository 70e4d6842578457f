"""Structured outputs and tool calls as the openai SDK uses them, against a real server running
the default model (SmolLM2-135M-Instruct, with a tool-call and a reasoning parser on): answers
and arguments that parse on every try, streamed or not, and 400s in OpenAI's error shape for
constraints and tools that cannot be compiled."""

from __future__ import annotations

import enum
import json
import re

import openai
import pytest
from pydantic import BaseModel, Field
from test_server_support import ServerProcess, tiny_server_args

ASK = [{"role": "user", "content": "Describe a made-up person as JSON."}]


class Color(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


# bounded strings and arrays: a small model at temperature 1 would otherwise ramble inside a
# string until max_tokens, and the SDK refuses a cut-off answer
class Pet(BaseModel):
    kind: Color
    name: str = Field(max_length=6)


class Weather(BaseModel):
    city: str = Field(max_length=10)
    unit: Color


WEATHER_CHOICE = {"type": "function", "function": {"name": "Weather"}}


class Person(BaseModel):
    name: str = Field(max_length=8)
    favourite: Color
    tags: list[Color] = Field(max_length=2)
    pet: Pet
    nickname: str | None = Field(max_length=6)


@pytest.fixture(scope="module")
def server(default_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = tiny_server_args(
        default_model_dir,
        *(
            "--served-model-name",
            "m",
            "--tool-call-parser",
            "hermes",
            "--reasoning-parser",
            "qwen3",
        ),
    )
    process = ServerProcess(log, *args)
    yield process.start()
    process.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def chat_text(client, stream: bool, **kwargs) -> str:
    kwargs = {"model": "m", "messages": ASK, "max_tokens": 40, **kwargs}
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = client.chat.completions.create(stream=True, **kwargs)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_parse_with_a_pydantic_model_is_valid_on_every_try(client) -> None:
    for seed in range(3):
        completion = client.chat.completions.parse(
            model="m",
            messages=ASK,
            response_format=Person,
            max_tokens=100,
            temperature=1.0,
            seed=seed,
        )
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "stop"
        assert isinstance(message.parsed, Person)


@pytest.mark.parametrize("stream", [False, True])
def test_json_object_holds(client, stream) -> None:
    short = [{"role": "user", "content": 'Reply with the JSON object {"ok": true}.'}]
    text = chat_text(
        client, stream, messages=short, temperature=0, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(text), dict)
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["n"],
    }
    bounded = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    assert isinstance(json.loads(chat_text(client, stream, response_format=bounded))["n"], int)


@pytest.mark.parametrize("stream", [False, True])
def test_regex_and_choice_hold_on_both_routes(client, stream) -> None:
    constraint = {"structured_outputs": {"regex": r"(yes|no), [0-9]{2}"}}
    assert re.fullmatch(r"(yes|no), [0-9]{2}", chat_text(client, stream, extra_body=constraint))
    choice = {"structured_outputs": {"choice": ["alpha", "beta gamma"]}}
    completion = client.completions.create(
        model="m", prompt="Pick one:", max_tokens=10, stream=stream, extra_body=choice
    )
    chunks = [completion] if not stream else list(completion)
    assert "".join(c.choices[0].text for c in chunks if c.choices) in ("alpha", "beta gamma")


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_gives_arguments_that_match_the_schema(client, stream) -> None:
    kwargs = {
        "model": "m",
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [openai.pydantic_function_tool(Weather)],
        "tool_choice": WEATHER_CHOICE,
        "max_tokens": 40,
        "temperature": 1.0,
    }
    if stream:
        with client.chat.completions.stream(**kwargs) as events:
            for _ in events:
                pass
            completion = events.get_final_completion()
    else:
        completion = client.chat.completions.parse(**kwargs)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "Weather" and call.id
    assert isinstance(call.function.parsed_arguments, Weather)
    Weather.model_validate_json(call.function.arguments)


def test_required_tool_choice_calls_one_of_the_tools(client) -> None:
    tools = [
        openai.pydantic_function_tool(Weather),
        openai.pydantic_function_tool(Pet, name="adopt"),
    ]
    completion = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Call a tool."}],
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=50,
    )
    (call,) = completion.choices[0].message.tool_calls
    model = {"Weather": Weather, "adopt": Pet}[call.function.name]
    model.model_validate_json(call.function.arguments)
    follow_up = [
        {"role": "user", "content": "Call a tool."},
        completion.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "done"},
    ]
    answer = client.chat.completions.create(model="m", messages=follow_up, max_tokens=3)
    assert answer.choices[0].message.content is not None


BAD_TOOLS = [
    (
        {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": WEATHER_CHOICE},
        "tool_choice",
    ),
    (
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}
            ]
        },
        "tools[0].function.parameters",
    ),
    ({"tool_choice": "required"}, "tool_choice"),
]
BAD_CONSTRAINTS = [
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nope"}},
            }
        },
        "response_format.json_schema.schema",
    ),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= nothing"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
]


def test_bad_constraints_are_400s_and_the_server_keeps_serving(client) -> None:
    for body, param in BAD_CONSTRAINTS + BAD_TOOLS:
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(model="m", messages=ASK, max_tokens=5, extra_body=body)
        error = raised.value.body
        assert error["param"] == param and error["type"] == "invalid_request_error", error
        assert error["message"]
    assert client.chat.completions.create(model="m", messages=ASK, max_tokens=2).choices
