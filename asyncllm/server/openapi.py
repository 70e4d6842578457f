"""The OpenAPI 3 description of the server, served at /openapi.json for API fuzzers and
client generators. Written by hand to match server/protocol.py; tests check it covers every
route and that bodies built from its schemas are accepted."""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _integer(minimum: int | None = None, maximum: int | None = None) -> Schema:
    schema: Schema = {"type": "integer"}
    if minimum is not None:
        schema["minimum"] = minimum
    if maximum is not None:
        schema["maximum"] = maximum
    return schema


def _number(minimum: float | None = None, maximum: float | None = None) -> Schema:
    schema: Schema = {"type": "number"}
    if minimum is not None:
        schema["minimum"] = minimum
    if maximum is not None:
        schema["maximum"] = maximum
    return schema


def _nullable(schema: Schema) -> Schema:
    return {**schema, "nullable": True}


def _response(object_name: str, content: dict[str, Schema]) -> Schema:
    """A non-streaming completion response; `content` is what each choice carries."""
    choice = {
        "type": "object",
        "properties": {
            "index": {"type": "integer"},
            **content,
            "logprobs": _nullable({"type": "object"}),
            "finish_reason": _nullable({"type": "string"}),
        },
    }
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices"],
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string", "enum": [object_name]},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "items": choice},
            "usage": _ref("Usage"),
        },
    }


_TOKEN_IDS = {"type": "array", "items": _integer(0)}
_STOP = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}

# the fields both generation routes share, with protocol.py's types and SamplingParams' ranges
_SAMPLING_PROPERTIES: dict[str, Schema] = {
    "model": {"type": "string"},
    "stream": {"type": "boolean", "default": False},
    "stream_options": {
        "type": "object",
        "properties": {"include_usage": {"type": "boolean"}},
    },
    "n": _integer(1, 128),
    "best_of": _integer(1, 128),
    "temperature": _number(0),
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": _integer(-1),
    "min_p": _number(0, 1),
    "seed": _integer(),
    "presence_penalty": _number(-2, 2),
    "frequency_penalty": _number(-2, 2),
    "repetition_penalty": {"type": "number", "exclusiveMinimum": 0},
    "logit_bias": {"type": "object", "additionalProperties": _number(-100, 100)},
    "min_tokens": _integer(0),
    "ignore_eos": {"type": "boolean"},
    "stop": _STOP,
    "stop_token_ids": _TOKEN_IDS,
    "include_stop_str_in_output": {"type": "boolean"},
    "skip_special_tokens": {"type": "boolean"},
    "prompt_logprobs": _integer(0),
    "allowed_token_ids": _TOKEN_IDS,
    "bad_words": {"type": "array", "items": {"type": "string", "minLength": 1}},
    "priority": _integer(),
    "timeout": {
        "type": "number",
        "exclusiveMinimum": 0,
        "description": "seconds the whole request may take, queue included; then 408",
    },
}

_CONTENT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}},
}

_SCHEMAS: dict[str, Schema] = {
    "Error": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": _nullable({"type": "string"}),
                    "code": _nullable({"oneOf": [{"type": "string"}, {"type": "integer"}]}),
                },
            }
        },
    },
    "CompletionRequest": {
        "type": "object",
        "required": ["prompt"],
        "properties": {
            "prompt": {
                "oneOf": [
                    {"type": "string"},
                    {"type": "array", "items": {"type": "string"}, "minItems": 1},
                    {**_TOKEN_IDS, "minItems": 1},
                    {"type": "array", "items": {**_TOKEN_IDS, "minItems": 1}, "minItems": 1},
                ]
            },
            "max_tokens": _integer(1),
            "echo": {"type": "boolean"},
            "logprobs": _integer(0, 20),
            **_SAMPLING_PROPERTIES,
        },
        "additionalProperties": True,
    },
    "ChatMessage": {
        "type": "object",
        "required": ["role"],
        "properties": {
            "role": {"type": "string"},
            "content": _nullable(
                {"oneOf": [{"type": "string"}, {"type": "array", "items": _CONTENT_PART}]}
            ),
        },
    },
    "ChatCompletionRequest": {
        "type": "object",
        "required": ["messages"],
        "properties": {
            "messages": {"type": "array", "items": _ref("ChatMessage"), "minItems": 1},
            "max_tokens": _integer(1),
            "max_completion_tokens": _integer(1),
            "logprobs": {"type": "boolean"},
            "top_logprobs": _integer(0, 20),
            "chat_template_kwargs": {"type": "object"},
            **_SAMPLING_PROPERTIES,
        },
        "additionalProperties": True,
    },
    "Usage": {
        "type": "object",
        "properties": {
            "prompt_tokens": _integer(0),
            "completion_tokens": _integer(0),
            "total_tokens": _integer(0),
        },
    },
    "Completion": _response("text_completion", {"text": {"type": "string"}}),
    "ChatCompletion": _response("chat.completion", {"message": _ref("ChatMessage")}),
    "ModelList": {
        "type": "object",
        "properties": {
            "object": {"type": "string"},
            "data": {"type": "array", "items": {"type": "object"}},
        },
    },
    "TokenizeRequest": {
        "type": "object",
        "properties": {
            "prompt": {"type": "string"},
            "messages": {"type": "array", "items": _ref("ChatMessage"), "minItems": 1},
            "add_special_tokens": {"type": "boolean"},
        },
        "description": "exactly one of prompt and messages",
    },
    "TokenizeResponse": {
        "type": "object",
        "properties": {
            "count": {"type": "integer"},
            "max_model_len": {"type": "integer"},
            "tokens": _TOKEN_IDS,
        },
    },
    "DetokenizeRequest": {
        "type": "object",
        "required": ["tokens"],
        "properties": {"tokens": _TOKEN_IDS},
    },
    "DetokenizeResponse": {"type": "object", "properties": {"prompt": {"type": "string"}}},
}

_ERRORS = {
    "400": "malformed JSON or an out-of-range value",
    "401": "a missing or wrong API key (with --api-key)",
    "404": "an unknown model",
    "408": "the request's own timeout ran out",
    "413": "a body over --max-request-body-bytes",
    "422": "a missing field or a wrong type",
    "429": "over --max-concurrent-requests (Retry-After)",
    "503": "the queue is full, the wait too long, the server draining or the engine dead "
    "(Retry-After unless the engine is dead)",
}


def _error_responses(codes: str) -> dict[str, Any]:
    content = {"application/json": {"schema": _ref("Error")}}
    return {code: {"description": _ERRORS[code], "content": content} for code in codes.split()}


def _json_body(schema_name: str) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": _ref(schema_name)}}}


def _generation(summary: str, request: str, response: str) -> dict[str, Any]:
    ok = {
        "description": "the response object, or with stream: true an SSE stream of chunks "
        "ending in `data: [DONE]`",
        "content": {
            "application/json": {"schema": _ref(response)},
            "text/event-stream": {"schema": {"type": "string"}},
        },
    }
    return {
        "post": {
            "summary": summary,
            "requestBody": _json_body(request),
            "responses": {"200": ok, **_error_responses("400 401 404 408 413 422 429 503")},
        }
    }


def _get(summary: str, schema: Schema | None, errors: str = "") -> dict[str, Any]:
    content = {"application/json": {"schema": schema}} if schema else {}
    ok: dict[str, Any] = {"description": "OK"}
    if content:
        ok["content"] = content
    return {"get": {"summary": summary, "responses": {"200": ok, **_error_responses(errors)}}}


def _post(summary: str, request: str, response: str) -> dict[str, Any]:
    ok = {"description": "OK", "content": {"application/json": {"schema": _ref(response)}}}
    return {
        "post": {
            "summary": summary,
            "requestBody": _json_body(request),
            "responses": {"200": ok, **_error_responses("400 401 413 422")},
        }
    }


def openapi_spec(prefix: str = "", version: str = "unknown") -> dict[str, Any]:
    """The whole description; `prefix` is the server's --root-path."""
    websocket = _get(
        "WebSocket upgrade: JSON frames {type: request|cancel, id, endpoint, body}; the server "
        "answers chunk, error and done frames",
        None,
        "401",
    )
    websocket["get"]["responses"]["101"] = {"description": "switching to the WebSocket"}
    paths = {
        "/v1/completions": _generation("Text completion", "CompletionRequest", "Completion"),
        "/v1/chat/completions": _generation(
            "Chat completion", "ChatCompletionRequest", "ChatCompletion"
        ),
        "/v1/stream": websocket,
        "/v1/models": _get("The served model", _ref("ModelList"), "401"),
        "/tokenize": _post("Tokenize a prompt or a chat", "TokenizeRequest", "TokenizeResponse"),
        "/detokenize": _post("Token ids to text", "DetokenizeRequest", "DetokenizeResponse"),
        "/health": _get("200, or 503 once the engine is dead or the server drains", None, "503"),
        "/metrics": _get("Prometheus metrics", None),
        "/version": _get("The server version", {"type": "object"}),
        "/openapi.json": _get("This description", {"type": "object"}),
    }
    return {
        "openapi": "3.0.3",
        "info": {"title": "asyncllm", "version": version},
        "servers": [{"url": prefix or "/"}],
        "paths": paths,
        "components": {
            "schemas": _SCHEMAS,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}, {}],
    }
