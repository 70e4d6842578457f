"""Server-sent events and the WebSocket endpoint, over streams of chunk objects.

A chunk stream is an async iterator of dicts (OpenAI chunk objects) and None (nothing new for a
keep-alive interval). Streams are pulled, never pushed: a slow reader leaves the engine's
per-request collector merging deltas instead of a queue growing here. On the wire each chunk is
an Event, serialized once and numbered in its stream (SSE's `id:`), so that a resumable stream
can be replayed from any event.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import orjson
from aiohttp import WSMsgType, web

from asyncllm.engine.async_llm import EngineDeadError
from asyncllm.errors import ValidationError
from asyncllm.server.protocol import ProtocolError, from_validation_error
from asyncllm.server.request_keys import DROPPED

logger = logging.getLogger(__name__)

T = TypeVar("T")
Chunk = dict[str, Any] | None  # None: a keep-alive tick
ChunkStream = AsyncIterator[Chunk]

SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}
_END = object()


@dataclass(frozen=True)
class Event:
    """One event of a stream as it goes on the wire."""

    data: bytes  # JSON, or b"[DONE]"
    name: str | None = None  # SSE's `event:` field (the Responses API's event types)
    error: bool = False  # the error that ended the stream


DONE = Event(b"[DONE]")
EventStream = AsyncIterator[Event | None]  # None: a keep-alive tick
NumberedEvents = AsyncIterator[tuple[int, Event] | None]


async def chunk_events(chunks: ChunkStream) -> EventStream:
    """A completion's chunks as OpenAI streams them: one event each, an error event if it fails
    once started, then [DONE]. A failure before anything came is raised instead, so the request
    still gets a plain JSON error with its status."""
    started = False
    async with aclosing(chunks):
        try:
            async for chunk in chunks:
                yield None if chunk is None else Event(orjson.dumps(chunk))
                started = True
        except Exception as e:
            if not started:
                raise
            yield Event(orjson.dumps(error_for(e).body()), error=True)
    yield DONE


async def numbered(events: EventStream, first: int = 0) -> NumberedEvents:
    async with aclosing(events):
        async for event in events:
            if event is None:
                yield None
            else:
                yield first, event
                first += 1


class _Completions:
    """Futures in the order they finish, and a wait for the next that gives up after a timeout.
    One callback per future for its life, where asyncio.wait adds and removes one per future on
    every call: merging took 5.6 us of each streamed chunk that way, 3.3-3.7 us this way
    (`bench/merge_streams.py`)."""

    def __init__(self) -> None:
        self.finished: deque[asyncio.Future] = deque()
        self._waiter: asyncio.Future[bool] | None = None

    def watch(self, awaitable: Awaitable[T]) -> asyncio.Future[T]:
        future = asyncio.ensure_future(awaitable)
        future.add_done_callback(self._on_finished)
        return future

    def _on_finished(self, future: asyncio.Future) -> None:
        self.finished.append(future)
        self.wake()

    def wake(self, _: object = None, woken: bool = True) -> None:
        """End the wait in progress: a read or the cutoff finished, or (woken=False) it timed out."""
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(woken)

    async def wait(self, timeout: float) -> bool:
        """False when timeout seconds passed with nothing finished and no wake()."""
        if self.finished:
            return True
        loop = asyncio.get_running_loop()
        self._waiter = loop.create_future()
        timer = loop.call_later(timeout, self.wake, None, False)
        try:
            return await self._waiter
        finally:
            timer.cancel()
            self._waiter = None


async def merge_streams(
    streams: list[AsyncIterator[T]],
    keepalive_s: float,
    cutoff: asyncio.Future[ProtocolError] | None = None,
) -> AsyncIterator[tuple[int, T] | None]:
    """(index, item) from several streams as they come; None after keepalive_s of silence.

    Each stream has at most one pending read, so nothing queues up here. Leaving early cancels
    the pending reads and closes every stream (for engine streams: aborts the request). Once
    `cutoff` resolves, its error is raised here (a timeout, a shutdown) and the same happens.
    """
    completions = _Completions()
    reads = {completions.watch(anext(s)): i for i, s in enumerate(streams)}
    if cutoff is not None:
        cutoff.add_done_callback(completions.wake)
    try:
        while reads:
            if not await completions.wait(keepalive_s):
                yield None
            if cutoff is not None and cutoff.done():
                if not cutoff.cancelled():
                    raise cutoff.result()
                cutoff = None
            if not completions.finished:
                continue
            read = completions.finished.popleft()
            index = reads.pop(read)
            try:
                item = read.result()
            except StopAsyncIteration:
                continue
            reads[completions.watch(anext(streams[index]))] = index
            yield index, item
    finally:
        if cutoff is not None:
            cutoff.remove_done_callback(completions.wake)
        for read in reads:
            read.cancel()
        await asyncio.gather(*reads, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


def error_for(error: BaseException) -> ProtocolError:
    """Any failure -> the OpenAI error it is reported as."""
    if isinstance(error, ProtocolError):
        return error
    if isinstance(error, ValidationError):
        return from_validation_error(error)
    if isinstance(error, EngineDeadError):
        return ProtocolError(str(error), status=503, type="service_unavailable")
    logger.exception("request failed", exc_info=error)
    return ProtocolError(f"internal error: {error!r}", status=500, type="internal_server_error")


def sse_event(item: tuple[int, Event] | None) -> bytes:
    if item is None:
        return b": keep-alive\n\n"
    n, event = item
    # data first: SSE takes the fields in any order, and a reader that looks for `data: ` at
    # the start of an event finds it
    name = b"" if event.name is None else b"event: " + event.name.encode() + b"\n"
    return b"data: %s\n%sid: %d\n\n" % (event.data, name, n)


async def write_sse(request: web.Request, events: NumberedEvents) -> web.StreamResponse:
    """Streams events as `data: ...` / `id: n` blocks.

    The first item is awaited before the headers go out, so a request that fails validation
    still gets a plain JSON error with its status.
    """
    async with aclosing(events):
        item = await anext(events, _END)
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        try:
            while item is not _END:
                await response.write(sse_event(item))
                item = await anext(events, _END)
        except ConnectionResetError:
            request[DROPPED] = True
            return response  # the client went away: aclosing aborts (or detaches) the stream
    await response.write_eof()
    return response


# -- WebSocket ------------------------------------------------------------------------------


class StreamSource(Protocol):
    """What a WebSocket session streams from (the generation routes)."""

    def open_stream(self, endpoint: str, body: dict[str, Any]) -> tuple[str, NumberedEvents]:
        """(stream id, its events) of one request; raises ProtocolError if it is refused."""

    def resume_stream(self, stream_id: str, after: int) -> NumberedEvents:
        """The events after `after` of a resumable stream, then the live ones."""

    def cancel_stream(self, stream_id: str) -> None:
        """Ends a resumable stream (nothing for one that is not)."""


class WebSocketSession:
    """One socket, many concurrent requests, each tagged with the client's id.

    Client frames: {"type": "request", "id", "endpoint": "chat"|"completions", "body"},
    {"type": "resume", "id", "stream", "starting_after"} and {"type": "cancel", "id"}. Server
    frames: {"type": "chunk", "id", "event_id", "data"}, {"type": "error", "id", "error"} and one
    final {"type": "done", "id"} per request. Closing the socket aborts its requests, except
    resumable ones (stream_options.resumable), which a later request can resume.
    """

    def __init__(self, ws: web.WebSocketResponse, source: StreamSource) -> None:
        self.ws = ws
        self.source = source
        self.tasks: dict[str, asyncio.Task] = {}
        self.stream_ids: dict[str, str] = {}  # the client's request id -> the stream's

    async def run(self) -> None:
        try:
            async for message in self.ws:
                if message.type == WSMsgType.TEXT:
                    await self._on_frame(message.data)
                elif message.type == WSMsgType.BINARY:
                    await self._send_error(None, ProtocolError("frames must be JSON text."))
        finally:
            # the socket closed: every request it started is aborted (resumable ones detached)
            for task in self.tasks.values():
                task.cancel()
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    async def _on_frame(self, data: str) -> None:
        try:
            frame = orjson.loads(data)
        except orjson.JSONDecodeError:
            await self._send_error(None, ProtocolError("the frame is not valid JSON."))
            return
        request_id = frame.get("id") if isinstance(frame, dict) else None
        if not isinstance(request_id, str | int) or isinstance(request_id, bool):
            await self._send_error(None, ProtocolError("a frame needs an id (string).", param="id"))
            return
        request_id = str(request_id)
        kind = frame.get("type", "request")
        if kind == "cancel":
            await self._cancel(request_id)
        elif kind in ("request", "resume"):
            await self._start(request_id, kind, frame)
        else:
            error = ProtocolError(f"unknown frame type {kind!r}.", param="type")
            await self._send_error(request_id, error)

    async def _start(self, request_id: str, kind: str, frame: dict[str, Any]) -> None:
        if request_id in self.tasks:
            error = ProtocolError(f"request id {request_id!r} is already in flight.", param="id")
            await self._send_error(request_id, error)
            await self._send({"type": "done", "id": request_id})
            return
        try:
            stream_id, events = self._open(kind, frame)
        except ProtocolError as e:
            await self._send_error(request_id, e)
            await self._send({"type": "done", "id": request_id})
            return
        self.stream_ids[request_id] = stream_id
        task = asyncio.create_task(self._relay(request_id, events))
        self.tasks[request_id] = task
        task.add_done_callback(lambda _: self._forget(request_id, task))

    def _open(self, kind: str, frame: dict[str, Any]) -> tuple[str, NumberedEvents]:
        if kind == "resume":
            stream_id, after = frame.get("stream"), frame.get("starting_after", -1)
            if not isinstance(stream_id, str):
                raise ProtocolError("a resume frame needs the stream's id.", param="stream")
            if not isinstance(after, int) or isinstance(after, bool) or after < -1:
                raise ProtocolError(
                    "starting_after must be an event number (or -1).", param="starting_after"
                )
            return stream_id, self.source.resume_stream(stream_id, after)
        body = frame.get("body")
        if not isinstance(body, dict):
            raise ProtocolError("body must be an object.", param="body")
        endpoint = frame.get("endpoint") or ("chat" if "messages" in body else "completions")
        return self.source.open_stream(endpoint, {**body, "stream": True})

    def _forget(self, request_id: str, task: asyncio.Task) -> None:
        if self.tasks.get(request_id) is task:
            del self.tasks[request_id]
            del self.stream_ids[request_id]

    async def _relay(self, request_id: str, events: NumberedEvents) -> None:
        async with aclosing(events):
            try:
                async for item in events:
                    if item is not None:
                        await self._send_event(request_id, *item)
            except ConnectionResetError:
                return
            except Exception as e:
                await self._send_error(request_id, error_for(e))
        await self._send({"type": "done", "id": request_id})

    async def _send_event(self, request_id: str, n: int, event: Event) -> None:
        if event == DONE:
            return  # the done frame follows
        if event.error:
            await self._send({"type": "error", "id": request_id, **orjson.loads(event.data)})
            return
        head = b'{"type":"chunk","id":%s,"event_id":%d,"data":' % (orjson.dumps(request_id), n)
        if not self.ws.closed:
            await self.ws.send_str((head + event.data + b"}").decode())

    async def _cancel(self, request_id: str) -> None:
        task = self.tasks.pop(request_id, None)
        if task is None:  # never started, or finished: its done frame went out
            error = ProtocolError(f"no request {request_id!r} is in flight.", param="id")
            await self._send_error(request_id, error)
            return
        self.source.cancel_stream(self.stream_ids.pop(request_id))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await self._send({"type": "done", "id": request_id, "cancelled": True})

    async def _send_error(self, request_id: str | None, error: ProtocolError) -> None:
        await self._send({"type": "error", "id": request_id, **error.body()})

    async def _send(self, frame: dict[str, Any]) -> None:
        if not self.ws.closed:
            await self.ws.send_str(orjson.dumps(frame).decode())


async def serve_websocket(
    request: web.Request, source: StreamSource, max_msg_size: int
) -> web.WebSocketResponse:
    ws = web.WebSocketResponse(heartbeat=20.0, max_msg_size=max_msg_size)
    await ws.prepare(request)
    await WebSocketSession(ws, source).run()
    return ws


def error_response(error: ProtocolError) -> web.Response:
    return web.Response(
        body=orjson.dumps(error.body()),
        status=error.status,
        content_type="application/json",
        headers=error.headers,
    )


def json_response(data: Any) -> web.Response:
    return web.Response(body=orjson.dumps(data), content_type="application/json")
