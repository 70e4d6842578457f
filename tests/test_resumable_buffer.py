"""StreamRegistry on its own: replay from any event, the memory bound, retention."""

from __future__ import annotations

import asyncio

import pytest

from asyncllm.server.protocol import ProtocolError
from asyncllm.server.resumable import StreamRegistry, parse_event_id
from asyncllm.server.streaming import Event


async def events(count: int, size: int = 10, gate: asyncio.Event | None = None):
    for i in range(count):
        if gate is not None and i == count // 2:
            await gate.wait()
        yield Event(b"%0*d" % (size, i))


async def drain(stream, after: int = -1) -> list[int]:
    return [item[0] async for item in stream.replay(after, 5.0) if item is not None]


async def test_replay_gives_exactly_the_events_after_n_then_the_live_ones() -> None:
    registry = StreamRegistry(retention_s=10, max_bytes=10_000)
    gate = asyncio.Event()
    stream = registry.start("s", events(10, gate=gate))
    await asyncio.sleep(0.01)
    assert stream.last_event_id == 4  # halfway, waiting for the gate
    reader = asyncio.create_task(drain(stream, after=2))
    await asyncio.sleep(0.01)
    gate.set()
    assert await reader == list(range(3, 10))
    assert await drain(stream) == list(range(10))


async def test_finished_streams_are_forgotten_oldest_first_past_the_bound() -> None:
    registry = StreamRegistry(retention_s=10, max_bytes=250)
    first = registry.start("a", events(10))
    await first.task
    second = registry.start("b", events(10))
    await second.task
    assert set(registry.streams) == {"a", "b"} and registry.nbytes == 200
    third = registry.start("c", events(10))
    await third.task
    assert set(registry.streams) == {"b", "c"} and registry.nbytes == 200
    with pytest.raises(ProtocolError, match="no resumable stream 'a'"):
        registry.get("a")


async def test_a_full_buffer_of_live_readers_refuses_new_streams() -> None:
    registry = StreamRegistry(retention_s=10, max_bytes=50)
    gate = asyncio.Event()
    stream = registry.start("live", events(20, gate=gate))
    replay = stream.replay(-1, 5.0)
    received = [await anext(replay)]  # attached before anything was produced
    await asyncio.sleep(0.01)
    with pytest.raises(ProtocolError, match="full") as refused:
        registry.start("new", events(1))
    assert refused.value.status == 503
    gate.set()
    received += [item async for item in replay]
    assert [n for n, _ in received] == list(range(20))  # one someone reads is never cut short


async def test_nobody_reading_for_the_retention_cancels_the_stream() -> None:
    registry = StreamRegistry(retention_s=0.05, max_bytes=10_000)
    stream = registry.start("s", events(10, gate=asyncio.Event()))  # never finishes alone
    replay = stream.replay(-1, 5.0)
    await anext(replay)
    await replay.aclose()  # the reader went away
    await asyncio.sleep(0.2)
    assert stream.task.cancelled() and "s" not in registry.streams and registry.nbytes == 0


async def test_a_stream_refused_before_its_first_event_raises_to_its_reader() -> None:
    async def refused():
        raise ProtocolError("no room", status=429)
        yield

    registry = StreamRegistry(retention_s=10, max_bytes=10_000)
    stream = registry.start("r", refused())
    with pytest.raises(ProtocolError, match="no room"):
        await drain(stream)
    assert "r" not in registry.streams


def test_event_ids_must_be_non_negative_integers() -> None:
    assert parse_event_id("17", "Last-Event-ID") == 17
    for bad in ("-1", "1.5", "x", "", "１", str(2**63)):
        with pytest.raises(ProtocolError, match="Last-Event-ID must be"):
            parse_event_id(bad, "Last-Event-ID")


async def test_an_event_past_the_stream_is_refused() -> None:
    registry = StreamRegistry(retention_s=10, max_bytes=10_000)
    stream = registry.start("s", events(3))
    await stream.task
    stream.check_after(2)
    with pytest.raises(ProtocolError, match="another stream"):
        stream.check_after(3)
