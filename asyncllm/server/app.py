"""build_app(engine, args): the aiohttp application around one AsyncLLM."""

from __future__ import annotations

import hmac
import importlib.metadata
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from asyncllm.engine.async_llm import AsyncLLM
from asyncllm.server.access_log import log_cancelled
from asyncllm.server.args import ServerArgs
from asyncllm.server.openai_routes import OpenAIRoutes
from asyncllm.server.openapi import openapi_spec
from asyncllm.server.protocol import ProtocolError, overloaded
from asyncllm.server.state import REQUEST_ID, STATE, ServerState
from asyncllm.server.streaming import error_for, error_response, json_response

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def build_app(engine: AsyncLLM, args: ServerArgs | Any = None) -> web.Application:
    if not isinstance(args, ServerArgs):
        args = ServerArgs() if args is None else ServerArgs.from_namespace(args)
    state = ServerState(engine, args)
    prefix = "/" + args.root_path.strip("/") if args.root_path.strip("/") else ""
    # under a root path the routes are served without it too, for proxies that strip it
    prefixes = dict.fromkeys([prefix, ""])
    open_paths = {f"{p}{path}" for p in prefixes for path in _OPEN_PATHS}
    app = web.Application(
        client_max_size=args.max_request_body_bytes,
        middlewares=[log_cancelled, _error_middleware, _auth_middleware(args.api_key, open_paths)],
    )
    app[STATE] = state
    app.on_response_prepare.append(_add_request_id_header)
    routes = OpenAIRoutes(state)
    openapi = _openapi_handler(prefix)
    for p in prefixes:
        app.router.add_post(f"{p}/v1/completions", routes.completions)
        app.router.add_post(f"{p}/v1/chat/completions", routes.chat_completions)
        app.router.add_get(f"{p}/v1/stream", routes.websocket)
        app.router.add_get(f"{p}/v1/models", routes.models)
        app.router.add_get(f"{p}/v1/models/{{model}}", routes.model)
        app.router.add_post(f"{p}/tokenize", routes.tokenize)
        app.router.add_post(f"{p}/detokenize", routes.detokenize)
        app.router.add_get(f"{p}/health", _health)
        app.router.add_get(f"{p}/metrics", _metrics)
        app.router.add_get(f"{p}/version", _version)
        app.router.add_get(f"{p}/openapi.json", openapi)
    return app


_OPEN_PATHS = ("/health", "/metrics", "/openapi.json")  # no API key asked


async def _health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.healthy:
        return web.Response(status=200)
    if state.draining:
        return error_response(overloaded("the server is shutting down."))
    error = ProtocolError("the engine has stopped.", status=503, type="service_unavailable")
    return error_response(error)


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _version(request: web.Request) -> web.Response:
    return json_response({"version": _package_version()})


def _openapi_handler(prefix: str) -> Handler:
    spec = orjson.dumps(openapi_spec(prefix, _package_version()))

    async def openapi(request: web.Request) -> web.Response:
        return web.Response(body=spec, content_type="application/json")

    return openapi


def _package_version() -> str:
    try:
        return importlib.metadata.version("asyncllm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@web.middleware
async def _error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every refusal leaves in OpenAI's error shape; request ids tag the access log."""
    request[REQUEST_ID] = _client_request_id(request) or uuid.uuid4().hex
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        error_type = "invalid_request_error" if e.status < 500 else "internal_server_error"
        return error_response(ProtocolError(e.reason, status=e.status, type=error_type))
    except Exception as e:
        return error_response(error_for(e))


def _client_request_id(request: web.Request) -> str | None:
    value = request.headers.get("X-Request-Id", "")
    return value if 0 < len(value) <= 128 and value.isprintable() else None


async def _add_request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    if REQUEST_ID in request:
        response.headers["X-Request-Id"] = request[REQUEST_ID]


def _auth_middleware(api_key: str | None, open_paths: set[str]):
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if api_key and request.path not in open_paths:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                raise ProtocolError(
                    "invalid or missing API key (expected Authorization: Bearer <key>).",
                    status=401,
                    code="invalid_api_key",
                )
        return await handler(request)

    return auth
