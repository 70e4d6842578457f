"""examples/nginx.conf in front of a real server (under --root-path): SSE and WebSocket streams
arrive incrementally through it."""

from __future__ import annotations

import itertools
import shutil
import socket
import subprocess
import time
from pathlib import Path

import aiohttp
import pytest
from test_server_support import ServerProcess, parse_sse, tiny_server_args

NGINX = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "nginx.conf"
PREFIX = "/llm"

pytestmark = pytest.mark.skipif(NGINX is None, reason="nginx is not installed (nginx-light)")


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    process = ServerProcess(log, *tiny_server_args(tiny_model_dir, "--root-path", PREFIX))
    yield process.start()
    process.stop()


@pytest.fixture(scope="module")
def proxy(server, tmp_path_factory):
    """nginx with the example configuration, pointed at the server, on a free port."""
    root = tmp_path_factory.mktemp("nginx")
    port = free_port()
    upstream = server.url.removeprefix("http://")
    temp_paths = "".join(
        f"\n    {name}_temp_path {root / name};" for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )  # fmt: skip
    conf = (
        EXAMPLE.read_text()
        .replace("server 127.0.0.1:8000;", f"server {upstream};")
        .replace("listen 127.0.0.1:8080;", f"listen 127.0.0.1:{port};")
        .replace("http {", "http {" + temp_paths, 1)
    )
    (root / "nginx.conf").write_text(conf)
    command = [NGINX, "-p", str(root), "-c", str(root / "nginx.conf")]
    command += ["-g", f"daemon off; pid {root / 'nginx.pid'};"]
    with open(root / "error.log", "wb") as log:
        nginx = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
    wait_for_port(port, nginx, root / "error.log")
    yield f"http://127.0.0.1:{port}{PREFIX}"
    nginx.terminate()
    nginx.wait(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, process: subprocess.Popen, log: Path, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"nginx exited: {log.read_text()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nginx did not listen in time: {log.read_text()}")


async def test_sse_arrives_incrementally_through_nginx(proxy) -> None:
    """Judged by the order and spread of the arrivals, not by wall-clock ratios, which a busy
    machine breaks (a first token later than the keep-alive interval sends a comment first)."""
    body = {"prompt": "count", "max_tokens": 400, "ignore_eos": True, "stream": True}
    raw, reads = b"", []  # reads: the data events each read from the socket brought
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{proxy}/v1/completions", json=body) as response,
    ):
        assert response.headers["Content-Type"].startswith("text/event-stream")
        async for data in response.content.iter_any():
            raw += data
            reads.append(data.count(b"data: "))
    events = parse_sse(raw)
    assert events[-1] == "[DONE]" and len(events) > 100
    assert events[-2]["choices"][0]["finish_reason"] == "length"  # in order, the last one last
    with_data = [n for n in reads if n]
    # a buffering proxy hands over kilobytes (dozens of events) at once, in a few reads
    assert len(with_data) >= 20, with_data
    assert max(with_data) <= len(events) // 4, with_data
    half = next(i for i, n in enumerate(itertools.accumulate(reads)) if n >= len(events) / 2)
    assert reads.index(with_data[0]) < half < len(reads) - 1  # spread: not all at the start or end


async def test_websocket_streams_through_nginx(proxy) -> None:
    request = {"id": "w", "body": {"prompt": "hi", "max_tokens": 50, "ignore_eos": True}}
    async with aiohttp.ClientSession() as session, session.ws_connect(f"{proxy}/v1/stream") as ws:
        await ws.send_json(request)
        frames = []
        while not frames or frames[-1]["type"] != "done":
            frames.append(await ws.receive_json(timeout=20))
    chunks = [f for f in frames if f["type"] == "chunk"]
    assert len(chunks) > 10 and all(f["id"] == "w" for f in frames)
    assert chunks[-1]["data"]["choices"][0]["finish_reason"] == "length"


async def test_non_streaming_requests_pass_through(proxy) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{proxy}/v1/completions", json={"prompt": "x", "max_tokens": 2}) as r,
    ):
        assert r.status == 200
        assert (await r.json())["usage"]["completion_tokens"] == 2
