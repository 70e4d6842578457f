"""merge_streams, the per-response multiplexer of engine streams, on hand-driven streams."""

import asyncio

import pytest

from asyncllm.server.protocol import ProtocolError
from asyncllm.server.streaming import merge_streams


class Stream:
    """An async iterator fed by put() (StopAsyncIteration ends it); records whether a read of
    it was cancelled and whether it was closed."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = self.closed = False

    def put(self, item: object) -> None:
        self.queue.put_nowait(item)

    def __aiter__(self):
        return self

    async def __anext__(self) -> object:
        try:
            item = await self.queue.get()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        if item is StopAsyncIteration:
            raise StopAsyncIteration
        return item

    async def aclose(self) -> None:
        self.closed = True


async def test_items_of_every_stream_come_with_their_index_until_all_end() -> None:
    a, b = Stream(), Stream()
    for item in ("a1", "a2", StopAsyncIteration):
        a.put(item)
    for item in ("b1", StopAsyncIteration):
        b.put(item)
    got = [item async for item in merge_streams([a, b], 10.0)]
    assert sorted(got) == [(0, "a1"), (0, "a2"), (1, "b1")]
    assert [i for i in got if i[0] == 0] == [(0, "a1"), (0, "a2")]
    assert a.closed and b.closed


async def test_silence_yields_none_each_keepalive_interval() -> None:
    stream = Stream()
    merged = merge_streams([stream], 0.02)
    assert await anext(merged) is None
    assert await anext(merged) is None
    stream.put("x")
    assert await anext(merged) == (0, "x")
    await merged.aclose()
    assert stream.closed


async def test_a_resolved_cutoff_raises_its_error_and_closes_the_streams() -> None:
    stream = Stream()
    cutoff = asyncio.get_running_loop().create_future()
    merged = merge_streams([stream], 10.0, cutoff)
    stream.put("x")
    assert await anext(merged) == (0, "x")
    asyncio.get_running_loop().call_later(0.01, cutoff.set_result, ProtocolError("too slow"))
    with pytest.raises(ProtocolError, match="too slow"):
        await anext(merged)
    assert stream.closed


async def test_a_cancelled_cutoff_is_ignored() -> None:
    stream = Stream()
    cutoff = asyncio.get_running_loop().create_future()
    merged = merge_streams([stream], 10.0, cutoff)
    asyncio.get_running_loop().call_later(0.01, cutoff.cancel)
    asyncio.get_running_loop().call_later(0.03, stream.put, "x")
    assert await anext(merged) == (0, "x")
    stream.put(StopAsyncIteration)
    assert [item async for item in merged] == []


async def test_a_failing_stream_raises_and_the_pending_reads_are_cancelled() -> None:
    class Failing(Stream):
        async def __anext__(self) -> object:
            raise ProtocolError("engine failed", status=500)

    quiet = Stream()
    with pytest.raises(ProtocolError, match="engine failed"):
        async for _ in merge_streams([quiet, Failing()], 10.0):
            pass
    assert quiet.cancelled and quiet.closed
