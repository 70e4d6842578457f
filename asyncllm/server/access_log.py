"""One access-log line per request, as JSON on the `asyncllm.access` logger: also for a stream
the client dropped or cancelled (status 499, as nginx logs it), which aiohttp itself does not
log when it cancels the handler; health and metrics polls at DEBUG."""

from __future__ import annotations

import asyncio
import logging
import time

import orjson
from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from asyncllm.server.request_keys import DROPPED, REQUEST_ID, RESPONSE_ID

ACCESS_LOGGER = "asyncllm.access"
CLIENT_CLOSED = 499  # nginx's status for a request whose client went away before the answer
_POLLED_PATHS = ("/health", "/metrics")  # logged at DEBUG: monitors poll them every few seconds


class AccessLogger(AbstractAccessLogger):
    """One JSON line per request, tagged with its request id (and response id if any)."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        entry = {
            "request_id": request.get(REQUEST_ID),
            "response_id": request.get(RESPONSE_ID),
            "remote": request.remote,
            "method": request.method,
            "path": request.path,
            "status": CLIENT_CLOSED if request.get(DROPPED) else response.status,
            "bytes": response.body_length,
            "duration_ms": round(time * 1000, 2),
        }
        level = logging.DEBUG if request.path.endswith(_POLLED_PATHS) else logging.INFO
        self.logger.log(level, orjson.dumps(entry).decode())


@web.middleware
async def log_cancelled(request: web.Request, handler) -> web.StreamResponse:
    """aiohttp writes no access line for a handler it cancels (the client closed the
    connection): this writes its 499."""
    start = time.perf_counter()
    try:
        return await handler(request)
    except asyncio.CancelledError:
        request[DROPPED] = True
        logger = AccessLogger(logging.getLogger(ACCESS_LOGGER), "")
        logger.log(request, web.StreamResponse(), time.perf_counter() - start)
        raise
