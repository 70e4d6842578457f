"""`python -m asyncllm.serve --model PATH`: the OpenAI-compatible server, one process, one uvloop
event loop, the engine task beside the HTTP server. SIGTERM drains: stop accepting, let in-flight
streams finish (up to --shutdown-timeout, then end them with an error event), exit 0."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import socket
import sys
import time

import uvloop
from aiohttp import web

from asyncllm.config import EngineArgs
from asyncllm.engine.async_llm import AsyncLLM
from asyncllm.engine.heap import freeze_startup_objects
from asyncllm.server.access_log import ACCESS_LOGGER, AccessLogger
from asyncllm.server.app import STATE, ServerArgs, build_app
from asyncllm.server.protocol import overloaded

logger = logging.getLogger("asyncllm.serve")
_BACKLOG = 1024
_FAREWELL_S = 2.0  # after the shutdown timeout: time for the streams to send their error event


def make_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    server = parser.add_argument_group("server")
    defaults = ServerArgs()
    server.add_argument("--host", default=defaults.host)
    server.add_argument("--port", type=int, default=defaults.port, help="0: any free port")
    server.add_argument(
        "--api-key",
        default=os.environ.get("ASYNCLLM_API_KEY"),
        help="require Authorization: Bearer KEY (default $ASYNCLLM_API_KEY); /health and "
        "/metrics stay open",
    )
    server.add_argument("--served-model-name", default=None, help="the name /v1/models lists")
    server.add_argument("--root-path", default="", help="serve every route under this prefix")
    server.add_argument(
        "--max-request-body-bytes", type=int, default=defaults.max_request_body_bytes
    )
    server.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=defaults.max_concurrent_requests,
        help="generation requests in flight before 429 (0: no limit)",
    )
    server.add_argument(
        "--max-waiting-requests",
        type=int,
        default=defaults.max_waiting_requests,
        help="requests admitted but not yet scheduled before 503 (0: no limit)",
    )
    server.add_argument(
        "--max-queue-wait",
        type=float,
        default=defaults.max_queue_wait,
        help="seconds a request may wait to be scheduled before it ends with 503 (0: no limit)",
    )
    server.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a chat_template in a request's chat_template_kwargs (rendered sandboxed)",
    )
    server.add_argument(
        "--keepalive-interval",
        type=float,
        default=defaults.keepalive_interval,
        help="seconds without output before a `: keep-alive` SSE comment",
    )
    server.add_argument(
        "--shutdown-timeout",
        type=float,
        default=defaults.shutdown_timeout,
        help="seconds in-flight streams get to finish after SIGTERM",
    )
    _add_engine_args(parser.add_argument_group("engine"))
    return parser


def _add_engine_args(group: argparse._ArgumentGroup) -> None:
    """One flag per EngineArgs field, typed from its default (vLLM's flag names)."""
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        if str(f.type).startswith("bool"):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        elif isinstance(f.default, int | float):
            group.add_argument(flag, type=type(f.default), default=f.default)
        else:
            kind = int if str(f.type).startswith("int") else str
            group.add_argument(flag, type=kind, default=f.default)


def engine_args_from(namespace: argparse.Namespace) -> EngineArgs:
    return EngineArgs(
        **{f.name: getattr(namespace, f.name) for f in dataclasses.fields(EngineArgs)}
    )


def configure_logging() -> None:
    level = os.environ.get("ASYNCLLM_LOGGING_LEVEL", "INFO").upper()
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, taken before the model loads so that a busy port fails at once;
    connections that come during the load wait in its backlog."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


async def serve(namespace: argparse.Namespace, sock: socket.socket) -> None:
    server_args = ServerArgs.from_namespace(namespace)
    loop = asyncio.get_running_loop()
    engine_args = engine_args_from(namespace)
    started = time.perf_counter()
    logger.info("loading the model: %s", engine_args.model or "the default model")
    engine = await loop.run_in_executor(None, AsyncLLM.from_engine_args, engine_args)
    logger.info("model loaded in %.1f s", time.perf_counter() - started)
    app = build_app(engine, server_args)
    freeze_startup_objects()
    runner = web.AppRunner(
        app,
        handler_cancellation=True,  # a client that goes away cancels its handler: abort
        access_log_class=AccessLogger,
        access_log=logging.getLogger(ACCESS_LOGGER),
        shutdown_timeout=1.0,
    )
    await runner.setup()
    site = web.SockSite(runner, sock)
    await site.start()
    host, port = sock.getsockname()[:2]
    print(f"asyncllm: serving {app[STATE].model_name} on http://{host}:{port}", flush=True)

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()

    state = app[STATE]
    logger.info("shutting down: draining %d request(s) in flight", state.in_flight)
    state.draining = True
    await site.stop()  # stop accepting connections; open ones finish their streams
    if not await state.drain(server_args.shutdown_timeout):
        logger.warning("shutdown timeout: ending %d request(s)", state.in_flight)
        state.end_all(overloaded("the server is shutting down."))
        await state.drain(_FAREWELL_S)
    await runner.cleanup()
    await engine.shutdown()
    logger.info("stopped")


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    namespace = make_parser(prog).parse_args(argv)
    configure_logging()
    try:
        sock = bind_socket(namespace.host, namespace.port)
    except OSError as e:
        where = f"{namespace.host}:{namespace.port}"
        sys.exit(f"asyncllm: cannot listen on {where}: {e.strerror or e} (--port picks another)")
    logger.info("listening on %s:%d", *sock.getsockname()[:2])
    uvloop.run(serve(namespace, sock))


if __name__ == "__main__":
    main()
