"""bench/connections.py in its short form: the normal load completes beside idle keep-alive
connections and clients that send headers a byte at a time, and a connection that has not sent a
whole request within --keep-alive-timeout is closed. The figure (p99 within 10%) is the lead's
to run on a quiet machine: timings here are disturbed by the other work on it."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import pytest
from test_server_support import ServerProcess, tiny_server_args

sys.path.append(
    str(Path(__file__).resolve().parents[1] / "bench")
)  # after the project root: bench/kernels.py must not shadow kernels
import connections  # noqa: E402 (bench/connections.py, found through the path above)

pytestmark = pytest.mark.asyncio(loop_scope="module")

TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("connections") / "server.log"
    flags = ("--keep-alive-timeout", str(TIMEOUT_S))
    process = ServerProcess(log, *tiny_server_args(tiny_model_dir, *flags)).start()
    yield process
    process.stop()


async def test_the_normal_load_completes_beside_idle_and_slow_clients(server) -> None:
    args = argparse.Namespace(
        idle=100, slow=20, byte_interval_s=0.05, requests=16, concurrency=4, max_tokens=8
    )
    result = await connections.compare(args, server.url)
    for run in ("alone", "beside_the_crowd", "alone_again"):
        assert result[run]["completed"] == 16 and result[run]["failed"] == 0
    assert result["crowd"]["idle"] == 100 and result["p99_ratio"] > 0


async def test_headers_sent_a_byte_at_a_time_are_cut_off_at_the_timeout(server) -> None:
    host, port = server.url.removeprefix("http://").split(":")
    stop = asyncio.Event()
    start = time.monotonic()
    connected = await asyncio.wait_for(
        connections.slow_client(host, int(port), 0.05, stop), TIMEOUT_S * 5
    )
    assert not connected  # the server closed it, before its 4 kB of headers were sent
    assert TIMEOUT_S - 0.5 < time.monotonic() - start < TIMEOUT_S * 3
    reader, writer = await connections.idle_connection(host, int(port))
    await asyncio.wait_for(reader.read(), TIMEOUT_S * 3)  # EOF: the idle one is closed too
    assert reader.at_eof()
    writer.close()
