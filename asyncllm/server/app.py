"""build_app(engine, args): the aiohttp application around one AsyncLLM."""

from __future__ import annotations

import asyncio
import hmac
import importlib.metadata
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from asyncllm.debugging import profiler_dir
from asyncllm.engine.async_llm import AsyncLLM
from asyncllm.server.access_log import log_cancelled
from asyncllm.server.args import ServerArgs
from asyncllm.server.openai_routes import OpenAIRoutes
from asyncllm.server.openapi import openapi_spec
from asyncllm.server.protocol import ProtocolError, overloaded
from asyncllm.server.request_keys import REQUEST_ID
from asyncllm.server.response_store import ResponseStore, open_response_store
from asyncllm.server.responses_api import ResponsesRoutes
from asyncllm.server.state import STATE, ServerState
from asyncllm.server.streaming import error_for, error_response, json_response
from asyncllm.server.supervisor import start_supervisor

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def build_app(
    engine: AsyncLLM, args: ServerArgs | Any = None, store: ResponseStore | None = None
) -> web.Application:
    if not isinstance(args, ServerArgs):
        args = ServerArgs() if args is None else ServerArgs.from_namespace(args)
    state = ServerState(engine, args)
    store = store or open_response_store(args.response_store)
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
    app.on_cleanup.append(lambda _: _close(state, store))
    app.cleanup_ctx.append(_supervised)
    routes = OpenAIRoutes(state)
    responses = ResponsesRoutes(routes, store)
    openapi = _openapi_handler(prefix)
    chat_page = _chat_page_handler()
    for p in prefixes:
        app.router.add_post(f"{p}/v1/completions", routes.completions)
        app.router.add_post(f"{p}/v1/chat/completions", routes.chat_completions)
        app.router.add_get(f"{p}/v1/stream", routes.websocket)
        app.router.add_get(f"{p}/v1/streams/{{stream_id}}", routes.resume)
        app.router.add_post(f"{p}/v1/responses", responses.create)
        app.router.add_get(f"{p}/v1/responses/{{response_id}}", responses.retrieve)
        app.router.add_delete(f"{p}/v1/responses/{{response_id}}", responses.delete)
        app.router.add_post(f"{p}/v1/responses/{{response_id}}/cancel", responses.cancel)
        app.router.add_get(f"{p}/v1/models", routes.models)
        app.router.add_get(f"{p}/v1/models/{{model}}", routes.model)
        app.router.add_post(f"{p}/tokenize", routes.tokenize)
        app.router.add_post(f"{p}/detokenize", routes.detokenize)
        app.router.add_get(f"{p}/health", _health)
        app.router.add_get(f"{p}/metrics", _metrics)
        app.router.add_get(f"{p}/version", _version)
        app.router.add_get(f"{p}/openapi.json", openapi)
        app.router.add_get(f"{p}/", chat_page)
        if profiler_dir(engine.config.args.profiler_dir):
            app.router.add_post(f"{p}/start_profile", _start_profile)
            app.router.add_post(f"{p}/stop_profile", _stop_profile)
    return app


async def _close(state: ServerState, store: ResponseStore) -> None:
    await state.streams.close()  # background responses are stored as cancelled
    store.close()


_OPEN_PATHS = ("/health", "/metrics", "/openapi.json", "/")  # no API key asked (the page asks)
# the chat page's own: scripts and styles inline, connections only to this server
_CHAT_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; "
    "style-src 'unsafe-inline'; connect-src 'self'; img-src 'self'",
    "Cache-Control": "no-cache",
}


async def _supervised(app: web.Application) -> AsyncIterator[None]:
    """The engine task and its supervisor run while the app does."""
    state = app[STATE]
    args = state.args
    task = start_supervisor(state.engine, args.engine_restart, args.engine_restarts_per_minute)
    yield
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def _health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.healthy:
        return web.Response(status=200)
    if state.draining:
        return error_response(overloaded("the server is shutting down."))
    error = ProtocolError("the engine has stopped.", status=503, type="service_unavailable")
    return error_response(error)


async def _start_profile(request: web.Request) -> web.Response:
    request.app[STATE].engine.start_profile()
    return web.Response(status=200)


async def _stop_profile(request: web.Request) -> web.Response:
    request.app[STATE].engine.stop_profile()
    return web.Response(status=200)


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


def _chat_page_handler() -> Handler:
    page = (Path(__file__).parent / "static" / "index.html").read_bytes()

    async def chat_page(request: web.Request) -> web.Response:
        return web.Response(body=page, content_type="text/html", headers=_CHAT_PAGE_HEADERS)

    return chat_page


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
            if "api_key" in request.query and _is_websocket(request):  # browsers set no header
                given = f"Bearer {request.query['api_key']}".encode()
            if not hmac.compare_digest(given, expected):
                raise ProtocolError(
                    "invalid or missing API key (expected Authorization: Bearer <key>).",
                    status=401,
                    code="invalid_api_key",
                )
        return await handler(request)

    return auth


def _is_websocket(request: web.Request) -> bool:
    return request.headers.get("Upgrade", "").lower() == "websocket"
