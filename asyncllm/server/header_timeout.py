"""The header read timeout (nginx's client_header_timeout): a request whose headers are not all
in within --header-timeout seconds of their first byte is answered 408 and its connection closed.

aiohttp bounds a connection only by its keep-alive timeout, counted from the connection or the
last response, so a client sending its headers a byte at a time holds its socket, and costs a
read and a parser call per byte, for that long. aiohttp's own parser still reads every byte:
this only watches, from the protocol's side, when a request's first byte came and whether its
headers are complete (a message was parsed), through the handler's message queue.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web

from asyncllm.server.protocol import timed_out


def timeout_response() -> bytes:
    body = orjson.dumps(timed_out("the request's headers took too long to arrive.").body())
    head = (
        "HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class HeaderTimeoutHandler(web.RequestHandler):
    """aiohttp's connection protocol, with a deadline on each request's headers."""

    def __init__(self, manager: web.Server, *, header_timeout: float, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._header_timeout = header_timeout
        self._header_deadline: asyncio.TimerHandle | None = None
        self._body: Any = None  # the last request's payload (a StreamReader), None before one

    def data_received(self, data: bytes) -> None:
        in_body = self._body is not None and not self._body.is_eof()
        queued = len(self._messages)
        super().data_received(data)
        if len(self._messages) > queued:  # a request's headers are complete
            self._cancel_header_deadline()
            self._body = self._messages[-1][1]
        elif data and not in_body and self._header_timeout > 0 and self._header_deadline is None:
            loop = asyncio.get_running_loop()
            self._header_deadline = loop.call_later(self._header_timeout, self._headers_too_slow)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel_header_deadline()
        super().connection_lost(exc)

    def _cancel_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        # a request in progress is left alone: a WebSocket's frames, or bytes pipelined behind a
        # long stream, also start the deadline
        if self._current_request is not None or self._messages or self.transport is None:
            return
        self.transport.write(timeout_response())
        self.force_close()


class HeaderTimeoutServer(web.Server):
    """aiohttp's low-level server, making HeaderTimeoutHandler connections."""

    def __init__(self, built: web.Server, header_timeout: float) -> None:
        super().__init__(
            built.request_handler,
            request_factory=built.request_factory,
            handler_cancellation=built.handler_cancellation,
            loop=built._loop,
            **built._kwargs,
        )
        self.header_timeout = header_timeout

    def __call__(self) -> HeaderTimeoutHandler:
        return HeaderTimeoutHandler(
            self, loop=self._loop, header_timeout=self.header_timeout, **self._kwargs
        )


class HeaderTimeoutRunner(web.AppRunner):
    """web.AppRunner whose connections have the header read timeout."""

    def __init__(self, app: web.Application, *, header_timeout: float, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._header_timeout = header_timeout

    async def _make_server(self) -> web.Server:
        return HeaderTimeoutServer(await super()._make_server(), self._header_timeout)
