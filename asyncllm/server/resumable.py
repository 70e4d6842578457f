"""Resumable streams: generation that outlives its connection, and replay from any event.

A resumable stream runs in a task of its own and keeps every event it produced. A client that
lost its connection reconnects with the number of the last event it saw and gets exactly the
events after it, then the live stream. Nobody reading for --stream-retention seconds cancels the
generation (freeing its blocks); a finished stream is kept that long, then forgotten.

Memory bound: the registry holds at most --stream-buffer-bytes of events. Past it, finished
streams are forgotten oldest first, then streams nobody reads are cancelled, and while it is
still full new resumable streams are refused (503).
"""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing

from aiohttp import hdrs, web

from asyncllm.server.protocol import ProtocolError, overloaded
from asyncllm.server.streaming import Event, EventStream, NumberedEvents

MAX_EVENT_ID = 2**63 - 1


class ResumableStream:
    def __init__(self, stream_id: str, registry: StreamRegistry) -> None:
        self.id = stream_id
        self.registry = registry
        self.events: list[Event] = []
        self.nbytes = 0
        self.failure: BaseException | None = None  # raised before its first event
        self.finished = False
        self.readers = 0
        self.created = time.monotonic()
        self._changed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._abandon: asyncio.TimerHandle | None = None
        self.task: asyncio.Task | None = None

    @property
    def last_event_id(self) -> int:
        return len(self.events) - 1

    async def produce(self, events: EventStream) -> None:
        try:
            async with aclosing(events):
                async for event in events:
                    if event is not None:
                        self._append(event)
        except Exception as e:
            self.failure = e

    def on_done(self, _: asyncio.Task) -> None:
        """Finished, failed or cancelled (even before it started)."""
        self.finished = True
        self._wake()
        self.registry.on_finished(self)

    def _append(self, event: Event) -> None:
        self.events.append(event)
        self.nbytes += len(event.data)
        self.registry.on_grown(self, len(event.data))
        self._wake()

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.get_running_loop().create_future()
        changed.set_result(None)

    async def replay(self, after: int, keepalive_s: float) -> NumberedEvents:
        """The events numbered after `after`, then the live ones; None on keep-alive ticks."""
        self._attach()
        try:
            n = after + 1
            while True:
                while n < len(self.events):
                    yield n, self.events[n]
                    n += 1
                if self.finished:
                    if self.failure is not None and not self.events:
                        raise self.failure
                    return
                # no await since the last check: nothing can have changed unseen
                done, _ = await asyncio.wait({self._changed}, timeout=keepalive_s)
                if not done:
                    yield None
        finally:
            self._detach()

    def check_after(self, after: int) -> None:
        """A client can only have seen events this stream has produced."""
        if after > self.last_event_id:
            raise ProtocolError(
                f"event {after} is past the last event of stream {self.id} "
                f"({self.last_event_id}): it belongs to another stream.",
                param="Last-Event-ID",
            )

    def _attach(self) -> None:
        self.readers += 1
        if self._abandon is not None:
            self._abandon.cancel()
            self._abandon = None

    def _detach(self) -> None:
        self.readers -= 1
        if self.readers == 0 and not self.finished:
            loop = asyncio.get_running_loop()
            self._abandon = loop.call_later(self.registry.retention_s, self.registry.drop, self)

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()


class StreamRegistry:
    """The resumable streams of one server, by id."""

    def __init__(self, retention_s: float, max_bytes: int) -> None:
        self.retention_s = retention_s
        self.max_bytes = max_bytes
        self.streams: dict[str, ResumableStream] = {}
        self.nbytes = 0
        self._expiries: dict[str, asyncio.TimerHandle] = {}

    def start(self, stream_id: str, events: EventStream) -> ResumableStream:
        if self.nbytes >= self.max_bytes:
            self._make_room(None)
        if self.nbytes >= self.max_bytes:
            raise overloaded("the buffer of resumable streams is full; retry later.")
        stream = ResumableStream(stream_id, self)
        self.streams[stream_id] = stream
        stream.task = asyncio.create_task(stream.produce(events))
        stream.task.add_done_callback(stream.on_done)
        return stream

    def get(self, stream_id: str) -> ResumableStream:
        stream = self.streams.get(stream_id)
        if stream is None:
            raise ProtocolError(
                f"no resumable stream {stream_id!r}: it never existed, was not resumable, or "
                f"ended over {self.retention_s:g} s ago.",
                status=404,
                code="stream_not_found",
            )
        return stream

    def cancel(self, stream_id: str) -> None:
        stream = self.streams.get(stream_id)
        if stream is not None:
            stream.cancel()

    def on_grown(self, stream: ResumableStream, nbytes: int) -> None:
        if self.streams.get(stream.id) is not stream:
            return  # dropped, its cancellation not yet delivered
        self.nbytes += nbytes
        if self.nbytes > self.max_bytes:
            self._make_room(stream)

    def on_finished(self, stream: ResumableStream) -> None:
        if self.streams.get(stream.id) is not stream:
            return
        if stream.failure is not None and not stream.events:
            self.forget(stream)  # refused before it started: nothing to resume
            return
        loop = asyncio.get_running_loop()
        self._expiries[stream.id] = loop.call_later(self.retention_s, self.forget, stream)

    def drop(self, stream: ResumableStream) -> None:
        """Nobody read it for the retention window: its generation ends, its id expires."""
        stream.cancel()
        self.forget(stream)

    def forget(self, stream: ResumableStream) -> None:
        if self.streams.get(stream.id) is stream:
            del self.streams[stream.id]
            self.nbytes -= stream.nbytes
            expiry = self._expiries.pop(stream.id, None)
            if expiry is not None:
                expiry.cancel()

    def _make_room(self, growing: ResumableStream | None) -> None:
        by_age = sorted(self.streams.values(), key=lambda s: s.created)
        for stream in [s for s in by_age if s.finished and s is not growing]:
            if self.nbytes <= self.max_bytes:
                return
            self.forget(stream)
        for stream in [s for s in by_age if not s.readers and not s.finished]:
            if self.nbytes <= self.max_bytes:
                return
            self.drop(stream)

    async def close(self) -> None:
        tasks = [s.task for s in self.streams.values() if s.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in list(self.streams.values()):
            self.forget(stream)


def resume_point(request: web.Request) -> int:
    """The last event the client saw: Last-Event-ID (as browsers resend it), or ?starting_after;
    -1 for the whole stream."""
    if hdrs.LAST_EVENT_ID in request.headers:
        return parse_event_id(request.headers[hdrs.LAST_EVENT_ID], "Last-Event-ID")
    if "starting_after" in request.query:
        return parse_event_id(request.query["starting_after"], "starting_after")
    return -1


def parse_event_id(value: str, name: str) -> int:
    """A Last-Event-ID or starting_after: a non-negative integer."""
    if not value.isascii() or not value.isdigit() or int(value) > MAX_EVENT_ID:
        raise ProtocolError(
            f"{name} must be the number of an event (a non-negative integer), not {value!r}.",
            param=name,
        )
    return int(value)
