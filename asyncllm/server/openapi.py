"""The OpenAPI 3 description of the server, served at /openapi.json for API fuzzers and
client generators. Request bodies come from the table of fields the parser checks against
(server/fields.py); tests check it covers every route and that bodies built from its schemas
are accepted."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from asyncllm.server.fields import (
    CHAT,
    COMPLETIONS,
    DETOKENIZE,
    MESSAGE_FIELDS,
    RESPONSES,
    TOKEN_IDS,
    TOKENIZE,
    Field,
    Schema,
    fields_for,
)


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


_COUNT: Schema = {"type": "integer", "minimum": 0}


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
            "stop_reason": _nullable({"oneOf": [{"type": "string"}, {"type": "integer"}]}),
            "prompt_logprobs": {
                "type": "array",
                "items": _nullable({"type": "object"}),
                "description": "with prompt_logprobs: per prompt token (null first), token id -> "
                "{logprob, rank, decoded_token}",
            },
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
            "usage": {"allOf": [_ref("Usage")], "nullable": True},
        },
    }


def _request(route: str) -> Schema:
    """A route's request body, from the table of fields."""
    return _object(fields_for(route))


def _object(fields: Sequence[Field]) -> Schema:
    schema: Schema = {
        "type": "object",
        "properties": {f.name: f.json_schema() for f in fields},
        "additionalProperties": True,
    }
    required = [f.name for f in fields if f.required]
    return {**schema, "required": required} if required else schema


_SCHEMAS: dict[str, Schema] = {
    "CompletionRequest": _request(COMPLETIONS),
    "ChatCompletionRequest": _request(CHAT),
    "TokenizeRequest": {**_request(TOKENIZE), "description": "exactly one of prompt and messages"},
    "DetokenizeRequest": _request(DETOKENIZE),
    "ResponseRequest": _request(RESPONSES),
    "Response": {
        "type": "object",
        "description": "OpenAI's response object: id, status, output (one assistant message), "
        "output_text, usage",
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string", "enum": ["response"]},
            "status": {
                "type": "string",
                "enum": ["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"],
            },
            "output": {"type": "array", "items": {"type": "object"}},
            "output_text": {"type": "string"},
            "usage": _nullable({"type": "object"}),
        },
    },
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
    "ChatMessage": _object(MESSAGE_FIELDS),
    "Usage": {
        "type": "object",
        "properties": {
            "prompt_tokens": _COUNT,
            "completion_tokens": _COUNT,
            "total_tokens": _COUNT,
            "prompt_tokens_details": {
                "type": "object",
                "properties": {"cached_tokens": {**_COUNT, "description": "prefix cache hits"}},
            },
        },
    },
    "Completion": _response("text_completion", {"text": {"type": "string"}}),
    "ChatCompletion": _response("chat.completion", {"message": _ref("ChatMessage")}),
    "ChatCompletionChunk": _response(
        "chat.completion.chunk",
        {
            "delta": {
                "type": "object",
                "properties": {"role": {"type": "string"}, "content": {"type": "string"}},
            }
        },
    ),
    "ModelList": {
        "type": "object",
        "properties": {
            "object": {"type": "string"},
            "data": {"type": "array", "items": _ref("Model")},
        },
    },
    "Model": {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string"},
            "created": {"type": "integer"},
            "owned_by": {"type": "string"},
            "root": {"type": "string"},
            "max_model_len": {"type": "integer"},
        },
    },
    "TokenizeResponse": {
        "type": "object",
        "properties": {
            "count": {"type": "integer"},
            "max_model_len": {"type": "integer"},
            "tokens": TOKEN_IDS,
            "token_strs": {"type": "array", "items": {"type": "string"}},
        },
    },
    "DetokenizeResponse": {"type": "object", "properties": {"prompt": {"type": "string"}}},
}

_ERRORS = {
    "400": "malformed JSON, a missing field (code missing_required_parameter), a wrong type "
    "(code invalid_type) or an out-of-range value; `param` names the field",
    "401": "a missing or wrong API key (with --api-key)",
    "404": "an unknown model",
    "408": "the request's own timeout ran out",
    "413": "a body over --max-request-body-bytes",
    "415": "a body declared (Content-Type) as anything but JSON",
    "429": "over --max-concurrent-requests (Retry-After)",
    "503": "the queue is full, the wait too long, the server draining or the engine dead "
    "(Retry-After unless the engine is dead)",
}


def _error_responses(codes: str) -> dict[str, Any]:
    content = {"application/json": {"schema": _ref("Error")}}
    return {code: {"description": _ERRORS[code], "content": content} for code in codes.split()}


def _json_body(schema_name: str) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": _ref(schema_name)}}}


def _generation(summary: str, request: str, response: str, chunk: str) -> dict[str, Any]:
    events = {
        "schema": {
            "type": "string",
            "description": f"`data: <{chunk} as JSON>` events, one per chunk (`data: <Error as "
            "JSON>` for a failure once the stream has started); `: keep-alive` comments while "
            "the request waits; `data: [DONE]` last",
        },
        "x-event-data": _ref(chunk),
    }
    ok = {
        "description": "the response object, or with stream: true an SSE stream of chunks",
        "content": {"application/json": {"schema": _ref(response)}, "text/event-stream": events},
    }
    return {
        "post": {
            "summary": summary,
            "requestBody": _json_body(request),
            "responses": {"200": ok, **_error_responses("400 401 404 408 413 415 429 503")},
        }
    }


def _get(summary: str, schema: Schema | None, errors: str = "") -> dict[str, Any]:
    content = {"application/json": {"schema": schema}} if schema else {}
    ok: dict[str, Any] = {"description": "OK"}
    if content:
        ok["content"] = content
    return {"get": {"summary": summary, "responses": {"200": ok, **_error_responses(errors)}}}


def _model_by_id() -> dict[str, Any]:
    operation = _get("The served model by its id (404 for any other)", _ref("Model"), "401 404")
    model = {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
    operation["get"]["parameters"] = [model]
    return operation


def _post(summary: str, request: str, response: str) -> dict[str, Any]:
    ok = {"description": "OK", "content": {"application/json": {"schema": _ref(response)}}}
    return {
        "post": {
            "summary": summary,
            "requestBody": _json_body(request),
            "responses": {"200": ok, **_error_responses("400 401 413 415")},
        }
    }


_SSE = {"schema": {"type": "string", "description": "`data: ...` / `id: N` events"}}
_RESUME_PARAMETERS = [
    {
        "name": "Last-Event-ID",
        "in": "header",
        "schema": {"type": "integer", "minimum": 0},
        "description": "the last event the client saw: the stream resumes after it",
    },
    {
        "name": "starting_after",
        "in": "query",
        "schema": {"type": "integer", "minimum": 0},
        "description": "as Last-Event-ID",
    },
]


def _path_parameter(name: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}


def _not_found(what: str) -> dict[str, Any]:
    content = {"application/json": {"schema": _ref("Error")}}
    return {"404": {"description": f"an unknown, expired or deleted {what}", "content": content}}


def _resumable_paths() -> dict[str, Any]:
    response_json = {"application/json": {"schema": _ref("Response")}}
    ok = {"description": "the response", "content": response_json}
    errors = {**_error_responses("400 401"), **_not_found("response")}
    stream_ok = {"description": "the events after the given one", "content": {"text/event-stream": _SSE}}  # fmt: skip
    stream = {
        "get": {
            "summary": "Resume a resumable stream",
            "parameters": [_path_parameter("stream_id"), *_RESUME_PARAMETERS],
            "responses": {"200": stream_ok, **_error_responses("400 401"), **_not_found("stream")},
        }
    }
    create = _generation("Create a response", "ResponseRequest", "Response", "Response")
    stream_query = {"name": "stream", "in": "query", "schema": {"type": "boolean"}}
    response_id = _path_parameter("response_id")
    one = {
        "get": {
            "summary": "A stored response; with stream=true, a background one's events",
            "parameters": [response_id, stream_query, *_RESUME_PARAMETERS],
            "responses": {
                "200": {**ok, "content": {**response_json, "text/event-stream": _SSE}},
                **errors,
            },  # fmt: skip
        },
        "delete": {
            "summary": "Forget a response",
            "parameters": [response_id],
            "responses": {"200": {"description": "deleted"}, **errors},
        },
    }
    cancel = {
        "post": {
            "summary": "Cancel a background response",
            "parameters": [response_id],
            "responses": {"200": ok, **errors},
        }
    }
    return {
        "/v1/streams/{stream_id}": stream,
        "/v1/responses": create,
        "/v1/responses/{response_id}": one,
        "/v1/responses/{response_id}/cancel": cancel,
    }


def openapi_spec(prefix: str = "", version: str = "unknown") -> dict[str, Any]:
    """The whole description; `prefix` is the server's --root-path."""
    websocket = _get(
        "WebSocket upgrade: JSON frames {type: request|cancel, id, endpoint, body}; the server "
        "answers chunk, error and done frames",
        None,
        "400 401",
    )
    responses = websocket["get"]["responses"]
    responses["101"] = {"description": "switching to the WebSocket"}
    responses["400"] = {**responses["400"], "description": "a GET without a WebSocket upgrade"}
    paths = {
        "/v1/completions": _generation(
            "Text completion", "CompletionRequest", "Completion", "Completion"
        ),
        "/v1/chat/completions": _generation(
            "Chat completion", "ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk"
        ),
        "/v1/stream": websocket,
        "/v1/models": _get("The served model", _ref("ModelList"), "401"),
        "/v1/models/{model}": _model_by_id(),
        "/tokenize": _post("Tokenize a prompt or a chat", "TokenizeRequest", "TokenizeResponse"),
        "/detokenize": _post("Token ids to text", "DetokenizeRequest", "DetokenizeResponse"),
        "/health": _get("200, or 503 once the engine is dead or the server drains", None, "503"),
        "/metrics": _get("Prometheus metrics", None),
        "/version": _get("The server version", {"type": "object"}),
        "/openapi.json": _get("This description", {"type": "object"}),
        "/": _get("The chat page (HTML, open: it asks for the API key)", None),
        **_resumable_paths(),
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
