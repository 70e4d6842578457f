"""bench/connections.py in its short form (the normal load completes beside idle keep-alive
connections and clients that send headers a byte at a time, the crowd in a process of its own),
and the timeouts on real sockets: headers not all in within --header-timeout of their first byte
get a 408 and a close, a body not all in within --body-timeout of its headers a 408; a connection
that sends nothing is closed after --keep-alive-timeout; a slow body, a reused keep-alive
connection and a WebSocket are not cut by the header timeout; headers that arrive in many pieces
are read once a throttle interval after the first few, and still served.
The figure (p99 within 10%) is the lead's to run on a quiet machine: timings here are disturbed
by the other work on it."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import aiohttp
import orjson
import pytest
from test_server_support import ServerProcess, tiny_server_args

sys.path.append(
    str(Path(__file__).resolve().parents[1] / "bench")
)  # after the project root: bench/kernels.py must not shadow kernels
import connections  # noqa: E402 (bench/connections.py, found through the path above)
from aiohttp import web  # noqa: E402

from asyncllm.server import header_timeout  # noqa: E402

pytestmark = pytest.mark.asyncio(loop_scope="module")

HEADER_S = 1.5
BODY_S = 4.0
KEEP_ALIVE_S = 4.0


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("connections") / "server.log"
    flags = ("--keep-alive-timeout", str(KEEP_ALIVE_S), "--header-timeout", str(HEADER_S))
    flags += ("--body-timeout", str(BODY_S))
    process = ServerProcess(log, *tiny_server_args(tiny_model_dir, *flags)).start()
    yield process
    process.stop()


async def open_connection(server) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = server.url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """(status, body) of one response with a Content-Length."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
    lines = head.decode().split("\r\n")
    length = next(int(v) for k, _, v in (x.partition(": ") for x in lines) if k == "Content-Length")
    return int(lines[0].split()[1]), await reader.readexactly(length)


def completion_request(body: bytes) -> bytes:
    return (
        "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()


async def test_the_normal_load_completes_beside_the_crowd_of_its_own_process(server) -> None:
    args = argparse.Namespace(
        idle=100, slow=20, byte_interval_s=0.05, requests=16, concurrency=4, max_tokens=8
    )
    # a head start past the header timeout: each slow client has had its 408 by the load
    args.rounds, args.cost_s, args.settle_s = 1, 1.0, 2 * HEADER_S
    result = await connections.compare(args, server.url, server.process.pid)
    assert len(result["runs"]) == 3 and [("crowd" in r) for r in result["runs"]] == [0, 1, 0]
    for run in result["runs"]:
        assert run["completed"] == 16 and run["failed"] == 0
    crowd = result["runs"][1]["crowd"]
    assert crowd["idle"] == 100 and crowd["slow"] == 20 and crowd["slow_bytes_per_s"] > 100
    assert len(result["p99_ratios"]) == 1 and result["p99_ratio"] > 0
    # the slow clients, cut off at the header timeout with a 408, came back
    assert result["crowd_closes_by_server"]["slow_answered_408"] >= 20
    assert result["crowd_cost_without_load"]["crowd_process_cpu_ms_per_s"] > 0


async def test_headers_sent_a_byte_at_a_time_get_408_at_the_header_timeout(server) -> None:
    reader, writer = await open_connection(server)
    start = time.monotonic()

    async def trickle() -> None:
        for offset in range(int(HEADER_S * 5 / 0.05)):
            writer.write(connections.slow_byte(offset))
            await asyncio.sleep(0.05)

    sender = asyncio.ensure_future(trickle())
    status, body = await read_response(reader)
    elapsed = time.monotonic() - start
    assert await asyncio.wait_for(reader.read(), 5) == b""  # and closed
    sender.cancel()
    writer.close()
    assert status == 408 and orjson.loads(body)["error"]["code"] == "request_timeout"
    assert HEADER_S - 0.2 < elapsed < HEADER_S * 3


async def test_a_silent_connection_lasts_past_the_header_timeout_to_the_keep_alive(
    server,
) -> None:
    reader, writer = await open_connection(server)
    start = time.monotonic()
    writer.write(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
    assert (await read_response(reader))[0] == 200
    with pytest.raises(TimeoutError):  # silent: no header timeout
        await asyncio.wait_for(reader.read(1), HEADER_S * 1.5)
    assert await asyncio.wait_for(reader.read(), KEEP_ALIVE_S * 3) == b""
    assert KEEP_ALIVE_S - 0.2 < time.monotonic() - start < KEEP_ALIVE_S * 3
    writer.close()


async def test_a_slow_body_and_the_next_request_on_its_connection_are_served(server) -> None:
    reader, writer = await open_connection(server)
    body = orjson.dumps({"prompt": "a slow body " * 5, "max_tokens": 4})
    writer.write(completion_request(body))
    for i in range(0, len(body), 4):  # longer than the header timeout, within the body's
        writer.write(body[i : i + 4])
        await asyncio.sleep(HEADER_S * 1.6 / (len(body) / 4))
    status, answer = await read_response(reader)
    assert status == 200 and orjson.loads(answer)["choices"][0]["text"] is not None
    with pytest.raises(TimeoutError):  # the body's bytes started no header deadline
        await asyncio.wait_for(reader.read(1), HEADER_S * 1.5)
    writer.write(completion_request(body) + body)  # the same connection, a second request
    status, answer = await read_response(reader)
    assert status == 200 and orjson.loads(answer)["object"] == "text_completion"
    writer.close()


async def test_a_body_not_all_in_within_the_body_timeout_gets_408(server) -> None:
    reader, writer = await open_connection(server)
    body = orjson.dumps({"prompt": "never all sent", "max_tokens": 4})
    start = time.monotonic()
    writer.write(completion_request(body) + body[:10])
    status, answer = await read_response(reader)
    assert status == 408 and orjson.loads(answer)["error"]["code"] == "request_timeout"
    assert BODY_S - 0.2 < time.monotonic() - start < BODY_S * 3
    writer.close()


async def test_a_websocket_outlives_the_header_timeout(server) -> None:
    body = {"prompt": "ws", "max_tokens": 2, "stream": True}
    async with (
        aiohttp.ClientSession() as session,
        session.ws_connect(f"{server.url}/v1/stream") as ws,
    ):
        for i in range(2):
            await asyncio.sleep(HEADER_S * 1.2)
            await ws.send_json({"id": f"w{i}", "endpoint": "completions", "body": body})
            frames = [await asyncio.wait_for(ws.receive_json(), 30)]
            while frames[-1]["type"] != "done":
                frames.append(await asyncio.wait_for(ws.receive_json(), 30))
            assert frames[-1]["id"] == f"w{i}"
            assert not any(f["type"] == "error" for f in frames)


async def test_headers_trickled_in_many_pieces_are_still_served(server) -> None:
    reader, writer = await open_connection(server)
    request = b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"
    start = time.monotonic()
    for byte in request:  # past the pieces that are read at once, then throttled
        writer.write(bytes([byte]))
        await asyncio.sleep(0.005)
    status, _ = await read_response(reader)
    assert status == 200 and time.monotonic() - start < HEADER_S
    writer.close()


class FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.reading, self.pauses, self.written = True, 0, b""

    def pause_reading(self) -> None:
        self.reading, self.pauses = False, self.pauses + 1

    def resume_reading(self) -> None:
        self.reading = True

    def is_closing(self) -> bool:
        return False

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        pass

    def get_extra_info(self, name: str, default=None):
        return default


async def test_header_pieces_past_the_first_few_pause_reading_for_the_throttle_interval(
    monkeypatch,
) -> None:
    monkeypatch.setattr(header_timeout, "THROTTLED_READ_S", 0.05)
    runner = header_timeout.HeaderTimeoutRunner(web.Application(), header_timeout=60)
    await runner.setup()
    handler, transport = runner.server(), FakeTransport()
    handler.connection_made(transport)
    request = b"GET /nowhere HTTP/1.1\r\nHost: t\r\n\r\n"
    pieces = header_timeout.PIECES_BEFORE_THROTTLE
    for byte in request[:pieces]:
        handler.data_received(bytes([byte]))
    assert transport.reading and transport.pauses == 0
    handler.data_received(request[pieces : pieces + 1])
    assert not transport.reading and transport.pauses == 1
    await asyncio.sleep(0.15)
    assert transport.reading  # resumed after the interval
    handler.data_received(request[pieces + 1 :])  # the rest at once: a whole request
    await asyncio.sleep(0.05)
    assert transport.written.startswith(b"HTTP/1.1 404")
    assert transport.reading and transport.pauses == 1
    handler.connection_lost(None)
    await runner.cleanup()
