"""Soak: the server under a steady mixed load for a set time, its resources recorded each interval.

Starts `python -m asyncllm.serve` (the default model unless --model) on a free port, finds its
saturation rate with a short burst (the mix below, all sent at once: completed requests per
second), then sends requests as a Poisson process at --load (0.7) of that rate for --minutes.

The mix, per request (seeded): 35% streamed completions (SSE), 15% plain completions, 15%
streamed chat completions, 35% WebSocket streams (a socket each); 30% long (64-200 tokens),
70% short (4-16); of the streams, 10% drop their connection after 1-3 chunks and, of the
WebSocket ones, 10% more send a `cancel` frame after their first chunk.

Every --interval-s (60) the arrivals pause, the requests in flight end, and once /metrics shows
nothing running or waiting a record is taken: the server's RSS (and its engine core process's,
if any), open file descriptors, threads, the KV cache usage at that idle point, and the longest
round trip of a /health probe sent every 100 ms during the interval (an upper bound on the
event loop's longest stall). After --settle-minutes (5) each figure should stay within 2% of its
first settled record; no request may be lost (sent = completed + errors + dropped + cancelled)
and none left running.

The result JSON (--out, default bench/results/soak_<device>.json) names the CPU model and its
vector extensions, torch's version and the device, and holds the command and every record.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import re
import shlex
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
VECTOR_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "amx_bf16",
    "amx_tile",
)
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "owls")
_SERVING = re.compile(r"serving .* on (http://[\d.]+:\d+)")


@dataclass
class Record:
    minute: float
    rss_mib: float
    fds: int
    threads: int
    kv_usage_idle: float
    longest_health_ms: float
    requests: dict[str, int] = field(default_factory=dict)


class Server:
    """The server process under test, and what /proc says about it and its children."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log
        command = [sys.executable, "-m", "asyncllm.serve", "--port", "0", *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(log, "wb") as out:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT
            )
        self.url = ""

    def wait_until_serving(self, timeout: float = 600.0) -> str:
        deadline = time.monotonic() + timeout
        while not self.url:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start:\n{self.log.read_text()}")
            match = _SERVING.search(self.log.read_text(errors="replace"))
            self.url = match.group(1) if match else ""
            time.sleep(0.2)
        return self.url

    def pids(self) -> list[int]:
        return process_and_children(self.process.pid)

    def resources(self) -> tuple[float, int, int]:
        """RSS of the server and its children (MiB), the server's fds and threads."""
        rss_kib = sum(_status(pid, "VmRSS") for pid in self.pids())
        pid = self.process.pid
        return rss_kib / 1024, len(os.listdir(f"/proc/{pid}/fd")), _status(pid, "Threads")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def process_and_children(pid: int) -> list[int]:
    children = [
        int(c)
        for t in Path(f"/proc/{pid}/task").iterdir()
        for c in (t / "children").read_text().split()
    ]
    return [pid, *children]


def _status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


class Load:
    """Sends the mix; counts how each request ended."""

    def __init__(self, url: str, model: str, seed: int) -> None:
        self.url = url
        self.model = model
        self.rng = random.Random(seed)
        self.ends: Counter[str] = Counter()
        self.sent = 0
        self.in_flight: set[asyncio.Task] = set()

    def send(self, session: aiohttp.ClientSession) -> None:
        self.sent += 1
        kind = self.rng.choices(["sse", "plain", "chat", "ws"], [35, 15, 15, 35])[0]
        long = self.rng.random() < 0.3
        max_tokens = self.rng.randint(64, 200) if long else self.rng.randint(4, 16)
        prompt = " ".join(self.rng.choices(WORDS, k=self.rng.randint(3, 60)))
        drop_after = self.rng.randint(1, 3) if self.rng.random() < 0.1 else None
        cancel = kind == "ws" and drop_after is None and self.rng.random() < 0.1
        request = self._request(session, kind, prompt, max_tokens, drop_after, cancel)
        task = asyncio.ensure_future(request)
        self.in_flight.add(task)
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task) -> None:
        self.in_flight.discard(task)
        error = None if task.cancelled() else task.exception()
        self.ends["client_error" if error else task.result()] += 1

    async def _request(
        self, session, kind: str, prompt: str, max_tokens: int, drop_after, cancel
    ) -> str:
        body = {"model": self.model, "max_tokens": max_tokens, "ignore_eos": True}
        if kind == "ws":
            return await self._websocket(session, {**body, "prompt": prompt}, drop_after, cancel)
        if kind == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        route = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        async with session.post(self.url + route, json={**body, "stream": kind != "plain"}) as r:
            if r.status != 200:
                await r.read()
                return f"http_{r.status}"
            if kind == "plain":
                return "completed" if (await r.json()).get("choices") else "error"
            return await _read_sse(r, drop_after)

    async def _websocket(self, session, body: dict, drop_after, cancel) -> str:
        async with session.ws_connect(self.url + "/v1/stream") as ws:
            await ws.send_json({"id": "r", "endpoint": "completions", "body": body})
            chunks = 0
            while True:
                frame = await ws.receive_json()
                if frame["type"] == "chunk":
                    chunks += 1
                    if drop_after is not None and chunks >= drop_after:
                        return "dropped"  # leaving the block closes the socket
                    if cancel and chunks == 1:
                        await ws.send_json({"id": "r", "type": "cancel"})
                elif frame["type"] == "error":
                    return "error"
                elif frame["type"] == "done":
                    return "cancelled" if frame.get("cancelled") else "completed"


async def _read_sse(response: aiohttp.ClientResponse, drop_after: int | None) -> str:
    chunks = 0
    async for line in response.content:
        if line.startswith(b"data: [DONE]"):
            return "completed"
        if line.startswith(b'data: {"error"'):
            return "error"
        if line.startswith(b"data: "):
            chunks += 1
            if drop_after is not None and chunks >= drop_after:
                return "dropped"  # leaving the block closes the connection
    return "error"  # the stream ended without [DONE]


async def metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    values = {}
    for line in text.splitlines():
        if line.startswith("asyncllm:") and "_bucket" not in line:
            name, value = line.split("{", 1)[0], line.rsplit(" ", 1)[1]
            values.setdefault(name, float(value))
    return values


async def idle_kv_usage(session, url: str, timeout: float = 120.0) -> float:
    """The KV usage once nothing runs or waits (the last reading if that never happens)."""
    deadline = time.monotonic() + timeout
    while True:
        m = await metrics(session, url)
        idle = m["asyncllm:num_requests_running"] == 0 and m["asyncllm:num_requests_waiting"] == 0
        if idle or time.monotonic() > deadline:
            return m["asyncllm:kv_cache_usage_perc"]
        await asyncio.sleep(0.1)


class HealthProbe:
    """GET /health every 100 ms; the longest round trip since the last reading."""

    def __init__(self, session, url: str) -> None:
        self.longest = 0.0
        self._task = asyncio.ensure_future(self._run(session, url))

    async def _run(self, session, url: str) -> None:
        while True:
            start = time.perf_counter()
            async with session.get(url + "/health") as r:
                await r.read()
            self.longest = max(self.longest, time.perf_counter() - start)
            await asyncio.sleep(0.1)

    def take(self) -> float:
        longest, self.longest = self.longest, 0.0
        return longest

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def saturation_rate(session, load: Load, burst: int) -> float:
    start = time.monotonic()
    for _ in range(burst):
        load.send(session)
    await asyncio.gather(*list(load.in_flight), return_exceptions=True)
    return burst / (time.monotonic() - start)


async def soak(args: argparse.Namespace, server: Server) -> dict:
    """The load's connections are closed before each record (a session per interval), so the
    server's fds count what it holds itself, not the load's idle keep-alive connections."""
    url = server.url
    async with aiohttp.ClientSession() as session:  # /v1/models, the probe, /metrics
        async with session.get(url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        async with load_session() as load_conn:
            load = Load(url, model, args.seed)
            rate = args.rate or args.load * await saturation_rate(load_conn, load, args.burst)
        load = Load(url, model, args.seed + 1)
        probe = HealthProbe(session, url)
        records: list[Record] = []
        gaps = random.Random(args.seed + 2)
        start = time.monotonic()
        end = start + args.minutes * 60
        while time.monotonic() < end:
            interval_end = min(time.monotonic() + args.interval_s, end)
            async with load_session() as load_conn:
                while time.monotonic() < interval_end:
                    load.send(load_conn)
                    await asyncio.sleep(
                        min(gaps.expovariate(rate), interval_end - time.monotonic())
                    )
                await asyncio.gather(*list(load.in_flight), return_exceptions=True)
            kv = await idle_kv_usage(session, url)
            await asyncio.sleep(0.5)  # the server sees the closed connections
            rss, fds, threads = server.resources()
            minute = (time.monotonic() - start) / 60
            records.append(
                Record(minute, rss, fds, threads, kv, 1000 * probe.take(), dict(load.ends))
            )
            print(json.dumps(asdict(records[-1])), flush=True)
        await probe.stop()
        final = await metrics(session, url)
    return {
        "rate_rps": rate,
        "records": [asdict(r) for r in records],
        "summary": summarize(records, load, final, args.settle_minutes),
    }


def load_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))


def summarize(records: list[Record], load: Load, final: dict, settle_minutes: float) -> dict:
    ended = sum(load.ends.values())
    settled = [r for r in records if r.minute >= settle_minutes] or records[-1:]
    drift = {
        name: 100
        * max(abs(getattr(r, name) - getattr(settled[0], name)) for r in settled)
        / max(getattr(settled[0], name), 1e-9)
        for name in ("rss_mib", "fds", "threads")
    }
    return {
        "sent": load.sent,
        "ends": dict(load.ends),
        "lost": load.sent - ended,
        "left_running": final["asyncllm:num_requests_running"]
        + final["asyncllm:num_requests_waiting"],
        "max_kv_usage_idle": max(r.kv_usage_idle for r in records),
        "drift_after_settle_pct": drift,
        "within_2_pct": all(v <= 2.0 for v in drift.values()),
        "longest_health_ms": max(r.longest_health_ms for r in records),
    }


def machine() -> dict:
    import torch

    cpu = Path("/proc/cpuinfo").read_text()
    model = re.search(r"model name\s*:\s*(.*)", cpu)
    flags = set(re.search(r"flags\s*:\s*(.*)", cpu).group(1).split())
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {
        "cpu": model.group(1) if model else platform.processor(),
        "vector_extensions": [f for f in VECTOR_FLAGS if f in flags],
        "cpu_threads": os.cpu_count(),
        "device": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average_1m_at_start": os.getloadavg()[0],
    }


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--interval-s", type=float, default=60.0, help="seconds between records")
    parser.add_argument("--settle-minutes", type=float, default=5.0)
    parser.add_argument("--load", type=float, default=0.7, help="fraction of the saturation rate")
    parser.add_argument("--rate", type=float, default=None, help="requests/s (skips the probe)")
    parser.add_argument("--burst", type=int, default=64, help="requests of the saturation probe")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--log", type=Path, default=Path("/tmp/asyncllm_soak_server.log"))
    parser.add_argument("server_args", nargs="*", help="after --: the server's flags")
    return parser


def run_with_server(
    name: str,
    argv: list[str] | None,
    args: argparse.Namespace,
    work: Callable[[Server], Awaitable[dict]],
) -> dict:
    """Starts the server (args.server_args, its log at args.log), runs work(server), stops the
    server, and writes the result with the machine and the command to args.out (default
    bench/results/NAME_<cpu|gpu>.json)."""
    info = machine()
    server = Server(args.server_args, args.log)
    try:
        server.wait_until_serving()
        result = asyncio.run(work(server))
    finally:
        server.stop()
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python", f"bench/{name}.py", *(argv or sys.argv[1:])]),
        **info,
        "server_exit_code": server.process.returncode,
        **result,
    }
    device = "cpu" if info["device"] == "cpu" else "gpu"
    out = args.out or ROOT / "bench" / "results" / f"{name}_{device}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> dict:
    args = make_parser().parse_args(argv)
    result = run_with_server("soak", argv, args, lambda server: soak(args, server))
    print(json.dumps(result["summary"], indent=2))
    return result


if __name__ == "__main__":
    main()
