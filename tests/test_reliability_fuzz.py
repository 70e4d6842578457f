"""Fuzzed input against a real server process: chat and completions bodies (wrong types, huge
and negative numbers, deep nesting, invalid UTF-8, megabyte strings, unknown fields) and
WebSocket frames. Every answer is a well-formed OpenAI error or a valid result, never a 500 or
a stack trace, and the server is healthy afterwards. Bodies built from /openapi.json's schemas
are accepted, so the description standard API fuzzers read matches the server."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import re
import time
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_reliability_support import is_openai_error, report
from test_server_support import ServerProcess, parse_metrics, parse_sse, tiny_server_args

BODY_LIMIT = 2 * 1024 * 1024
EXAMPLES = int(os.environ.get("ASYNCLLM_FUZZ_EXAMPLES", "60"))  # raise it for a deeper run
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
REFUSALS = {400, 404, 408, 413, 429, 503}
SEEN: dict[int, int] = {}  # status -> count, over the whole module


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("fuzz") / "server.log"
    flags = ("--max-request-body-bytes", str(BODY_LIMIT), "--max-model-len", "96")
    args = [*tiny_server_args(tiny_model_dir), *flags]  # the last --max-model-len wins
    process = ServerProcess(log, *args).start()
    yield process
    process.stop()
    report("fuzz", statuses=dict(sorted(SEEN.items())))


@pytest.fixture(scope="module")
def connection(server):
    parts = urlsplit(server.url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    yield connection
    connection.close()


# -- strategies ------------------------------------------------------------------------------

HUGE_NUMBERS = [2**63 - 1, -(2**63), 2**64 - 1, 2**64, 10**30, -(10**30), 1e308, -1e308, 5e-324]
leaves = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from(HUGE_NUMBERS)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    leaves,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
hostile_values = (
    json_values
    | st.integers(17, 19).map(lambda bits: "\u00e9" * (1 << bits))  # up to 1 MiB of UTF-8
    | st.integers(min_value=-1, max_value=200)
    | st.lists(st.integers(-5, 60000), max_size=50)
)
SAMPLING_FIELDS = [
    "model", "stream", "stream_options", "n", "best_of", "temperature", "top_p", "top_k",
    "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "logit_bias", "min_tokens", "ignore_eos", "stop", "stop_token_ids", "max_tokens",
    "include_stop_str_in_output", "skip_special_tokens", "prompt_logprobs", "logprobs",
    "allowed_token_ids", "bad_words", "priority", "timeout", "user", "tools",
]  # fmt: skip
COMPLETION_FIELDS = [*SAMPLING_FIELDS, "prompt", "echo", "suffix"]
CHAT_FIELDS = [
    *SAMPLING_FIELDS, "messages", "max_completion_tokens", "top_logprobs",
    "chat_template_kwargs", "response_format",
]  # fmt: skip

message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]) | json_values},
    optional={"content": st.text(max_size=50) | json_values, "name": json_values},
)
prompts = st.text(max_size=60) | st.lists(st.integers(0, 49151), min_size=1, max_size=20)
stream_flags = st.fixed_dictionaries({}, optional={"stream": st.booleans()})


def bodies(base: st.SearchStrategy, fields: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """A valid body, then some fields replaced by anything, then some unknown fields."""
    overrides = st.dictionaries(st.sampled_from(fields), hostile_values, max_size=4)
    unknown = st.dictionaries(st.text(min_size=1, max_size=12), json_values, max_size=2)
    return st.tuples(base, overrides, unknown, stream_flags).map(
        lambda parts: {**parts[2], **parts[0], **parts[3], **parts[1]}
    )


completion_bodies = bodies(st.fixed_dictionaries({"prompt": prompts}), COMPLETION_FIELDS)
chat_bodies = bodies(
    st.fixed_dictionaries({"messages": st.lists(message, min_size=1, max_size=3)}), CHAT_FIELDS
)


def encoded(body: dict[str, Any]) -> bytes:
    """UTF-8, except that lone surrogates pass through as the invalid bytes they make."""
    return json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")


raw_bodies = (
    st.binary(max_size=200)
    | st.integers(1, 3000).map(lambda depth: b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}")
    | st.integers(1, 3000).map(
        lambda depth: b'{"messages": [' + b'{"a":' * depth + b"1" + b"}" * depth + b"]}"
    )  # fmt: skip
    | st.binary(min_size=1, max_size=50).map(lambda junk: b'{"prompt": "' + junk + b'"}')
    | st.just(b'{"prompt": "\xff\xfe\xfd", "max_tokens": 2}')
    | st.just(b'{"prompt": "x", "max_tokens": 2' + b" " * (BODY_LIMIT + 1) + b"}")
)


# -- checks ----------------------------------------------------------------------------------


def post(connection: http.client.HTTPConnection, path: str, body: bytes) -> tuple[int, bytes]:
    try:
        connection.request("POST", path, body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    except (http.client.HTTPException, ConnectionError):
        connection.close()  # the server may close after a refused body; reconnect once
        connection.request("POST", path, body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()


def check_answer(status: int, raw: bytes, kind: str) -> None:
    SEEN[status] = SEEN.get(status, 0) + 1
    assert b"Traceback" not in raw and b'File "' not in raw
    assert status == 200 or status in REFUSALS, (status, raw[:300])
    if status != 200:
        assert is_openai_error(orjson.loads(raw)), raw[:300]
    elif raw.startswith((b"data: ", b":")):  # SSE; a slow request's starts with `: keep-alive`
        check_stream(parse_sse(raw), kind)
    else:
        check_result(orjson.loads(raw), kind)


def check_stream(events: list, kind: str) -> None:
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        if "error" in event:
            assert is_openai_error(event) and event["error"]["type"] != "internal_server_error"
        else:
            assert event["object"] == ("chat.completion.chunk" if kind == "chat" else "text_completion")  # fmt: skip
            assert isinstance(event["choices"], list)


def check_result(result: dict, kind: str) -> None:
    assert result["object"] == ("chat.completion" if kind == "chat" else "text_completion")
    assert result["choices"] and result["usage"]["total_tokens"] > 0
    for choice in result["choices"]:
        assert choice["finish_reason"] in ("stop", "length")


# -- HTTP ------------------------------------------------------------------------------------


@FUZZ
@given(body=completion_bodies)
def test_fuzzed_completion_bodies(connection, body) -> None:
    status, raw = post(connection, "/v1/completions", encoded(body))
    check_answer(status, raw, "completion")


@FUZZ
@given(body=chat_bodies)
def test_fuzzed_chat_bodies(connection, body) -> None:
    status, raw = post(connection, "/v1/chat/completions", encoded(body))
    check_answer(status, raw, "chat")


@settings(FUZZ, max_examples=EXAMPLES * 2 // 3)
@given(raw=raw_bodies, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_malformed_bytes(connection, raw, path) -> None:
    status, answer = post(connection, path, raw)
    check_answer(status, answer, "chat" if "chat" in path else "completion")
    assert status != 200 or raw.startswith(b'{"prompt": "')


HOSTILE = [
    {"prompt": "x", "seed": 2**64 - 1, "temperature": 1.0},
    {"prompt": "x", "seed": -(2**63), "temperature": 1.0},
    {"prompt": "x", "seed": 2**64, "temperature": 1.0},
    {"prompt": "x", "top_k": 10**9, "temperature": 1.0},
    {"prompt": "x", "top_p": 5e-324, "temperature": 1e308},
    {"prompt": "x", "min_tokens": 10**9},
    {"prompt": "x", "n": 128, "max_tokens": 2},
    {"prompt": "x", "n": 129},
    {"prompt": ["a"] * 100_000},
    {"prompt": "x", "best_of": 10**18},
    {"prompt": "x", "logprobs": 10**9},
    {"prompt": "x", "prompt_logprobs": 20, "logprobs": 20, "echo": True},
    {"prompt": "x", "stop": ["a" * 1000] * 1000},
    {"prompt": "x", "bad_words": ["z" * 10_000]},
    {"prompt": "x", "logit_bias": {str(i): 100 for i in range(49152)}},
    {"prompt": "x", "priority": -(2**63), "max_tokens": 2},
    {"prompt": [49151] * 95, "max_tokens": 10**9},
    {"prompt": "x", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": 1}},
]


@pytest.mark.parametrize("body", HOSTILE, ids=range(len(HOSTILE)))
def test_known_hostile_bodies(connection, body) -> None:
    status, raw = post(connection, "/v1/completions", encoded(body))
    check_answer(status, raw, "completion")


# -- WebSocket -------------------------------------------------------------------------------

frames = st.one_of(
    st.builds(
        lambda kind, rid, endpoint, body: {
            "type": kind,
            "id": rid,
            "endpoint": endpoint,
            "body": body,
        },  # fmt: skip
        st.sampled_from(["request", "cancel"]) | json_values,
        st.text(max_size=4) | st.integers(-2, 2) | json_values,
        st.sampled_from(["chat", "completions", "/v1/completions"]) | json_values,
        completion_bodies | chat_bodies | json_values,
    ),
    json_values.map(json.dumps),
    st.text(max_size=40),
    st.binary(max_size=40),
)


async def closes_as_too_big(ws: aiohttp.ClientWebSocketResponse, text: str) -> None:
    with contextlib.suppress(ConnectionError):  # the server may close while it arrives
        await ws.send_str(text.encode("utf-8", "replace").decode())
    deadline = time.monotonic() + 30
    while not ws.closed:
        message = await ws.receive(timeout=max(deadline - time.monotonic(), 0.01))
        assert message.type != aiohttp.WSMsgType.ERROR or isinstance(message.data, ConnectionError)
    # 1006: the connection dropped before the close frame could be read
    assert ws.close_code in (1009, 1006, None)


async def exchange(url: str, sent: list) -> list[dict]:
    """Sends the frames, then a sentinel request; returns every frame up to its done. A frame
    over the size limit must close the socket with 1009 instead."""
    async with aiohttp.ClientSession() as session, session.ws_connect(f"{url}/v1/stream") as ws:
        for frame in sent:
            if isinstance(frame, bytes):
                await ws.send_bytes(frame)
                continue
            text = frame if isinstance(frame, str) else json.dumps(frame)
            if len(text.encode("utf-8", "surrogatepass")) > BODY_LIMIT:
                await closes_as_too_big(ws, text)
                return []
            await ws.send_str(text.encode("utf-8", "replace").decode())
        sentinel = {"id": "sentinel", "endpoint": "completions", "body": {"prompt": "x", "max_tokens": 1}}  # fmt: skip
        await ws.send_str(orjson.dumps(sentinel).decode())
        received = []
        deadline = time.monotonic() + 60
        while not (received and received[-1] == {"type": "done", "id": "sentinel"}):
            message = await ws.receive(timeout=max(deadline - time.monotonic(), 0.01))
            assert message.type == aiohttp.WSMsgType.TEXT, message
            received.append(orjson.loads(message.data))
        return received


@settings(FUZZ, max_examples=EXAMPLES * 2 // 3)
@given(sent=st.lists(frames, max_size=4))
def test_fuzzed_websocket_frames(server, sent) -> None:
    for frame in asyncio.run(exchange(server.url, sent)):
        assert frame["type"] in ("chunk", "error", "done"), frame
        if frame["type"] == "error":
            assert set(frame) == {"type", "id", "error"}
            assert is_openai_error({"error": frame["error"]})
            assert frame["error"]["type"] != "internal_server_error"


async def test_invalid_utf8_in_a_text_frame_closes_only_that_socket(server) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(f"{server.url}/v1/stream") as ws:
            await ws._writer.send_frame(b'{"id": "\xff\xfe"}', aiohttp.WSMsgType.TEXT)
            message = await ws.receive(timeout=10)
            assert message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
        async with session.get(f"{server.url}/health") as response:
            assert response.status == 200


# -- the API description ---------------------------------------------------------------------


def from_schema(schema: dict, spec: dict) -> st.SearchStrategy:
    """Values valid under a (small) OpenAPI 3.0 schema: what a schema-driven fuzzer sends."""
    if "$ref" in schema:
        return from_schema(spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]], spec)
    if "oneOf" in schema:
        return st.one_of([from_schema(s, spec) for s in schema["oneOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "object":
        properties = schema.get("properties", {})
        required = set(schema.get("required", []))
        return st.fixed_dictionaries(
            {k: from_schema(v, spec) for k, v in properties.items() if k in required},
            optional={
                k: from_schema(v, spec) for k, v in properties.items() if k not in required
            },  # fmt: skip
        )
    if kind == "array":
        return st.lists(from_schema(schema["items"], spec), min_size=schema.get("minItems", 0), max_size=4)  # fmt: skip
    if kind == "integer":
        return st.integers(schema.get("minimum", -(2**40)), schema.get("maximum", 2**40))
    if kind == "number":
        low = schema.get("minimum", schema.get("exclusiveMinimum", -1e6))
        high = schema.get("maximum", 1e6)
        return st.floats(low, high, exclude_min="exclusiveMinimum" in schema)
    if kind == "boolean":
        return st.booleans()
    return st.text(min_size=schema.get("minLength", 0), max_size=20)


@pytest.fixture(scope="module")
def spec(connection) -> dict:
    connection.close()  # reconnects: the shared connection may have idled past the keep-alive
    connection.request("GET", "/openapi.json")
    response = connection.getresponse()
    assert response.status == 200
    return orjson.loads(response.read())


def test_openapi_describes_every_route(spec, connection) -> None:
    assert spec["openapi"].startswith("3.")
    for path, operations in spec["paths"].items():
        for method in operations:
            concrete = re.sub(r"\{\w+\}", "unknown-id", path)
            connection.request(method.upper(), concrete, b"{}" if method == "post" else None)
            response = connection.getresponse()
            raw = response.read()
            # a templated path ({model}, an id) gets a value; its route's 404 names what was not found
            known_route = response.status != 404 or (concrete != path and b"_not_found" in raw)
            assert known_route, (method, path)


@settings(FUZZ, max_examples=EXAMPLES * 2 // 3)
@given(data=st.data())
def test_bodies_valid_under_the_openapi_schemas_are_accepted(spec, connection, data) -> None:
    path = data.draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    operation = spec["paths"][path]["post"]
    schema = operation["requestBody"]["content"]["application/json"]["schema"]
    body = data.draw(from_schema(schema, spec))
    body.pop("model", None)  # any other name is a 404
    status, raw = post(connection, path, encoded(body))
    check_answer(status, raw, "chat" if "chat" in path else "completion")
    assert status in (200, 400, 404, 408), (status, raw[:300])
    if status == 400:  # never a type error or a missing field
        code = orjson.loads(raw)["error"]["code"]
        assert code not in ("invalid_type", "missing_required_parameter"), raw[:300]


async def test_the_server_is_healthy_and_logged_no_failure(server) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{server.url}/health") as response:
            assert response.status == 200
        deadline = time.monotonic() + 30
        while True:
            async with session.get(f"{server.url}/metrics") as response:
                metrics = parse_metrics(await response.text())
            idle = metrics["asyncllm:num_requests_running"] == 0
            idle = idle and metrics["asyncllm:num_requests_waiting"] == 0
            if idle and metrics["asyncllm:kv_cache_usage_perc"] == 0:
                break
            assert time.monotonic() < deadline, metrics
            await asyncio.sleep(0.1)
    assert "Traceback" not in server.log()
