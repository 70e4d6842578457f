"""build_app(engine, args): the aiohttp application around one AsyncLLM."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import importlib.metadata
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from prometheus_client import CONTENT_TYPE_LATEST

from asyncllm.engine.async_llm import AsyncLLM
from asyncllm.model_files.model_path import DEFAULT_MODEL, DEFAULT_MODEL_NAME
from asyncllm.server.metrics import ServerMetrics
from asyncllm.server.openai_routes import REQUEST_ID, RESPONSE_ID, OpenAIRoutes
from asyncllm.server.openapi import openapi_spec
from asyncllm.server.protocol import ProtocolError, overloaded, timed_out
from asyncllm.server.streaming import error_for, error_response, json_response

access_logger = logging.getLogger("asyncllm.access")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class ServerArgs:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    root_path: str = ""
    max_request_body_bytes: int = 4 * 1024 * 1024
    max_concurrent_requests: int = 0  # 0: no limit
    max_waiting_requests: int = 0  # requests not yet scheduled before 503; 0: no limit
    max_queue_wait: float = 0.0  # seconds a request may wait to be scheduled; 0: no limit
    trust_request_chat_template: bool = False  # accept chat_template in chat_template_kwargs
    keepalive_interval: float = 5.0  # seconds of silence before a `: keep-alive` comment
    shutdown_timeout: float = 30.0  # seconds in-flight streams get to finish on SIGTERM

    @classmethod
    def from_namespace(cls, namespace: Any) -> ServerArgs:
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{n: getattr(namespace, n) for n in names if hasattr(namespace, n)})


class Admission:
    """One admitted generation request. `cutoff` resolves to the error that ends it early:
    its own timeout, --max-queue-wait, or a shutdown that ran out of time."""

    def __init__(self, state: ServerState, timeout: float | None) -> None:
        loop = asyncio.get_running_loop()
        self.state = state
        self.engine_ids: list[str] = []  # set once its prompts reach the engine
        self.cutoff: asyncio.Future[ProtocolError] = loop.create_future()
        self._timers: list[asyncio.TimerHandle] = []
        if timeout:
            message = f"the request did not finish within its timeout ({timeout:g} s)."
            self._timers.append(loop.call_later(timeout, self.end, timed_out(message)))
        if state.args.max_queue_wait:
            wait = state.args.max_queue_wait
            self._timers.append(loop.call_later(wait, self._end_if_queued, wait))

    @property
    def queued(self) -> bool:
        """Not yet in the engine, or some of its requests not yet scheduled."""
        return not self.engine_ids or any(self.state.is_queued(i) for i in self.engine_ids)

    def end(self, error: ProtocolError) -> None:
        if not self.cutoff.done():
            self.cutoff.set_result(error)

    def close(self) -> None:
        for timer in self._timers:
            timer.cancel()
        self.cutoff.cancel()

    def _end_if_queued(self, wait: float) -> None:
        if self.queued:
            self.end(overloaded(f"the request waited over {wait:g} s to be scheduled."))


class ServerState:
    """What the handlers share: the engine, the metrics, and the requests in flight."""

    def __init__(self, engine: AsyncLLM, args: ServerArgs) -> None:
        self.engine = engine
        self.args = args
        path = engine.config.model.path
        model = engine.config.args.model
        if model in (None, DEFAULT_MODEL):
            model = DEFAULT_MODEL_NAME
        self.model_name = args.served_model_name or model
        self.model_names = {self.model_name, str(path), path.name}
        self.metrics = ServerMetrics(engine, self.model_name)
        self.started = int(time.time())
        self.draining = False
        self.admissions: set[Admission] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.max_prompt_chars = _max_prompt_chars(engine)

    @property
    def in_flight(self) -> int:
        return len(self.admissions)

    @property
    def healthy(self) -> bool:
        return not self.engine.errored and not self.draining

    @contextmanager
    def admit(self, timeout: float | None = None) -> Iterator[Admission]:
        """Counts one generation request in flight; 503 while draining or with the queue full,
        429 over the concurrency limit (both with Retry-After)."""
        self._check_capacity()
        admission = Admission(self, timeout)
        self.admissions.add(admission)
        self._idle.clear()
        try:
            yield admission
        finally:
            admission.close()
            self.admissions.discard(admission)
            if not self.admissions:
                self._idle.set()

    def _check_capacity(self) -> None:
        if self.draining:
            raise overloaded("the server is shutting down.")
        limit = self.args.max_concurrent_requests
        if limit and self.in_flight >= limit:
            message = f"too many concurrent requests (the limit is {limit}); retry later."
            raise overloaded(message, status=429)
        limit = self.args.max_waiting_requests
        if limit and sum(a.queued for a in self.admissions) >= limit:
            raise overloaded(f"the queue is full ({limit} requests waiting); retry later.")

    def is_queued(self, engine_id: str) -> bool:
        return self.engine.is_queued(engine_id)

    def end_all(self, error: ProtocolError) -> None:
        """Ends every request in flight with this error (their streams get it as an event)."""
        for admission in list(self.admissions):
            admission.end(error)

    async def drain(self, timeout: float) -> bool:
        """Refuses new requests and waits for those in flight; False if the timeout hit."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True


def _max_prompt_chars(engine: AsyncLLM) -> int | None:
    """No token covers more characters than the longest vocabulary entry, so a text longer
    than max_model_len of those cannot fit: it is refused before it is tokenized."""
    tokenizer = engine.tokenizer
    if tokenizer is None:
        return None
    longest = max(map(len, tokenizer.get_vocab()), default=1)
    return engine.config.model.max_model_len * longest


STATE = web.AppKey("state", ServerState)


def build_app(engine: AsyncLLM, args: ServerArgs | Any = None) -> web.Application:
    if not isinstance(args, ServerArgs):
        args = ServerArgs() if args is None else ServerArgs.from_namespace(args)
    state = ServerState(engine, args)
    prefix = "/" + args.root_path.strip("/") if args.root_path.strip("/") else ""
    open_paths = {f"{prefix}/health", f"{prefix}/metrics", f"{prefix}/openapi.json"}
    app = web.Application(
        client_max_size=args.max_request_body_bytes,
        middlewares=[_error_middleware, _auth_middleware(args.api_key, open_paths)],
    )
    app[STATE] = state
    app.on_response_prepare.append(_add_request_id_header)
    routes = OpenAIRoutes(state)
    app.router.add_post(f"{prefix}/v1/completions", routes.completions)
    app.router.add_post(f"{prefix}/v1/chat/completions", routes.chat_completions)
    app.router.add_get(f"{prefix}/v1/stream", routes.websocket)
    app.router.add_get(f"{prefix}/v1/models", routes.models)
    app.router.add_post(f"{prefix}/tokenize", routes.tokenize)
    app.router.add_post(f"{prefix}/detokenize", routes.detokenize)
    app.router.add_get(f"{prefix}/health", _health)
    app.router.add_get(f"{prefix}/metrics", _metrics)
    app.router.add_get(f"{prefix}/version", _version)
    app.router.add_get(f"{prefix}/openapi.json", _openapi_handler(prefix))
    return app


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


class AccessLogger(AbstractAccessLogger):
    """One JSON line per request, tagged with its request id (and response id if any)."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        entry = {
            "request_id": request.get(REQUEST_ID),
            "response_id": request.get(RESPONSE_ID),
            "remote": request.remote,
            "method": request.method,
            "path": request.path,
            "status": response.status,
            "bytes": response.body_length,
            "duration_ms": round(time * 1000, 2),
        }
        self.logger.info(orjson.dumps(entry).decode())
