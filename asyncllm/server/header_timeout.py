"""The header read timeout (nginx's client_header_timeout): a request whose headers are not all
in within --header-timeout seconds of their first byte is answered 408 and its connection closed.
Until then, headers that keep arriving in pieces are read less often: after
PIECES_BEFORE_THROTTLE partial reads the connection's reading pauses for THROTTLED_READ_S after
each one, so a client sending a byte at a time wakes the event loop about once a second instead
of once a byte (the kernel keeps its bytes meanwhile). Headers arrive whole, or in a few pieces,
from every client that is not trickling them.

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

# a read and a parser call per byte cost the server's loop about 18 us (bench/NOTES.md)
PIECES_BEFORE_THROTTLE = 8
THROTTLED_READ_S = 1.0
# after a 408, what the client still sends is read and dropped this long before the close
LINGER_S = 2.0


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
        self._header_pieces = 0  # reads of the coming request's headers so far
        self._throttle: asyncio.TimerHandle | None = None
        self._linger: asyncio.TimerHandle | None = None  # set once the headers timed out

    def data_received(self, data: bytes) -> None:
        if self._linger is not None:
            return
        in_body = self._body is not None and not self._body.is_eof()
        queued = len(self._messages)
        super().data_received(data)
        if len(self._messages) > queued:  # a request's headers are complete
            self._cancel_header_deadline()
            self._body = self._messages[-1][1]
            self._header_pieces = 0
        elif data and not in_body:
            self._header_pieces += 1
            if self._header_timeout > 0 and self._header_deadline is None:
                loop = asyncio.get_running_loop()
                deadline = loop.call_later(self._header_timeout, self._headers_too_slow)
                self._header_deadline = deadline
            if self._header_pieces > PIECES_BEFORE_THROTTLE and self._current_request is None:
                self._pause_for_pieces()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel_header_deadline()
        for timer in (self._throttle, self._linger):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def _pause_for_pieces(self) -> None:
        if self.transport is None or self._throttle is not None:
            return
        self.transport.pause_reading()
        loop = asyncio.get_running_loop()
        self._throttle = loop.call_later(THROTTLED_READ_S, self._resume_after_pieces)

    def _resume_after_pieces(self) -> None:
        self._throttle = None
        # aiohttp's own holds (a full payload or message buffer) keep reading paused
        held = self._reading_paused or getattr(self, "_buffer_paused", False)  # aiohttp 3.13+
        if self.transport is not None and not self.transport.is_closing() and not held:
            self.transport.resume_reading()

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
        # closed with the client's bytes unread (reading may be throttled, and the client may
        # still be sending), the socket would be reset and the client could lose the 408: our
        # side ends after it and what comes in is dropped until the close (a lingering close)
        if self._throttle is not None:
            self._throttle.cancel()
            self._throttle = None
        self.transport.write(timeout_response())
        self.transport.write_eof()
        self.transport.resume_reading()
        self._linger = asyncio.get_running_loop().call_later(LINGER_S, self.force_close)


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
