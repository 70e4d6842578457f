"""Connections: does a crowd of idle and slow connections slow the requests that do work?

Starts `python -m asyncllm.serve` (the default model unless given after --), then runs the same
normal load alone, beside the crowd, alone, ... (--rounds crowded runs, each between two alone
ones): --idle keep-alive connections (each sent one GET /health, then silent) and --slow clients
sending a request's headers a byte every --byte-interval-s seconds. The normal load is
--requests streamed completions of --max-tokens tokens at --concurrency in flight, from this
process; the crowd runs in a process of its own (one selector, no event loop shared with the
load's clients), so that what is measured is the server's latency. Each crowded run's p99
end-to-end latency is compared with the mean of its two neighbours' (the target: within 10%);
the result gives each round's ratio, their median and their spread.

Before the rounds, with no load, the server's CPU (its process and children, from /proc) is
measured for --cost-s seconds without and then beside the crowd, with the crowd process's own.

Timeouts (README, Reliability): a request whose headers are not all in within --header-timeout
(60 s) of their first byte gets a 408 and a close; a connection that sends nothing is closed
after --keep-alive-timeout (75 s). The crowd opens again whatever the server closes, so it keeps
its numbers whatever the timeouts, and counts the closes (`idle_closed_by_server`,
`slow_closed_by_server`, `slow_answered_408`). With the defaults each slow client is cut off
after 60 s and comes back; `-- --keep-alive-timeout 900 --header-timeout 900` keeps the same
connections open through a CPU run's load.

The result JSON (--out, default bench/results/connections_<device>.json) holds each run's
latency percentiles and server CPU, the crowd's reports, the ratios, which process ran what, and
the machine (CPU model, vector extensions, device).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import selectors
import socket
import statistics
import time
from collections import Counter
from multiprocessing.connection import Connection
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
from soak import process_and_children, run_with_server


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


async def normal_load(url: str, requests: int, concurrency: int, max_tokens: int) -> dict:
    """E2E latency of each streamed request, `concurrency` at a time."""
    latencies: list[float] = []
    failures = 0
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    body = {"max_tokens": max_tokens, "ignore_eos": True, "stream": True, "temperature": 0}

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal failures
        while not queue.empty():
            i = queue.get_nowait()
            start = time.perf_counter()
            async with session.post(
                f"{url}/v1/completions", json={"prompt": f"load {i}", **body}
            ) as r:
                raw = await r.read()
            if r.status == 200 and b"\ndata: [DONE]\n" in raw:  # its event ends with an id
                latencies.append(time.perf_counter() - start)
            else:
                failures += 1

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return {
        "completed": len(latencies),
        "failed": failures,
        "p50_s": percentile(latencies, 50),
        "p99_s": percentile(latencies, 99),
        "max_s": max(latencies),
    }


# the headers of a request that never ends: after these, "x" padding a byte at a time
SLOW_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: crowd\r\nContent-Type: application/json\r\n"
SLOW_HEAD += b"X-Padding: "


def slow_byte(offset: int) -> bytes:
    return SLOW_HEAD[offset : offset + 1] or b"x"


def cpu_seconds(pids: list[int]) -> float:
    """User and system CPU time of these processes, from /proc."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


class Crowd:
    """The idle and slow connections, kept at their numbers: one the server closes (its
    keep-alive or header timeout) is counted and opened again. Blocking-free sockets and one
    selector, so that the crowd's own CPU is small beside the server's."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.address = address
        self.selector = selectors.DefaultSelector()
        self.offsets: dict[socket.socket, int] = {}  # each slow socket's bytes sent
        self.closed = Counter()  # by the server: idle, slow, slow_answered_408
        self.bytes_sent = 0  # by all slow clients

    def open_idle(self) -> None:
        sock = socket.create_connection(self.address)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: crowd\r\n\r\n")
        head = b""
        while b"\r\n\r\n" not in head:  # /health has no body
            head += sock.recv(4096)
        sock.setblocking(False)
        self.selector.register(sock, selectors.EVENT_READ, "idle")

    def open_slow(self) -> None:
        sock = socket.create_connection(self.address)
        sock.setblocking(False)
        self.offsets[sock] = 0
        self.selector.register(sock, selectors.EVENT_READ, "slow")

    def tick(self) -> None:
        """Reopens what the server closed, then sends each slow client's next byte."""
        for key, _ in self.selector.select(0):
            self._closed_by_server(key.fileobj, key.data)
        for sock, offset in self.offsets.items():
            with contextlib.suppress(BlockingIOError, ConnectionError):  # closed: next tick
                sent = sock.send(slow_byte(offset))
                self.offsets[sock] = offset + sent
                self.bytes_sent += sent

    def _closed_by_server(self, sock: socket.socket, kind: str) -> None:
        try:
            answer = sock.recv(4096)
        except ConnectionError:
            answer = b""
        self.selector.unregister(sock)
        self.offsets.pop(sock, None)
        sock.close()
        self.closed[kind] += 1
        if answer.startswith(b"HTTP/1.1 408"):
            self.closed[f"{kind}_answered_408"] += 1
        if kind == "idle":
            self.open_idle()
        else:
            self.open_slow()

    def close(self) -> None:
        for key in list(self.selector.get_map().values()):
            key.fileobj.close()
        self.selector.close()


def crowd_process(
    address: tuple[str, int], idle: int, slow: int, interval: float, conn: Connection
) -> None:
    """The crowd's process: opens it, says "ready", ticks every `interval` until told to stop,
    then sends what the server closed and the process's own CPU time."""
    crowd = Crowd(address)
    for _ in range(idle):
        crowd.open_idle()
    for _ in range(slow):
        crowd.open_slow()
    conn.send("ready")
    start, cpu_start = time.monotonic(), time.process_time()
    ticks = 0
    while not conn.poll(max(0.0, start + ticks * interval - time.monotonic())):
        crowd.tick()
        ticks += 1
    seconds = time.monotonic() - start
    report = {
        "idle": idle,
        "slow": slow,
        "idle_closed_by_server": crowd.closed["idle"],
        "slow_closed_by_server": crowd.closed["slow"],
        "slow_answered_408": crowd.closed["slow_answered_408"],
        "slow_bytes_per_s": crowd.bytes_sent / seconds,  # the target: slow / interval
        "crowd_process_cpu_ms_per_s": 1000 * (time.process_time() - cpu_start) / seconds,
    }
    crowd.close()
    conn.send(report)


class CrowdProcess:
    """crowd_process in a process of its own, so that the load's clients share no event loop
    (nor interpreter) with the crowd."""

    def __init__(self, args: argparse.Namespace, url: str) -> None:
        parts = urlsplit(url)
        self.conn, child = multiprocessing.Pipe()
        self.process = multiprocessing.get_context("spawn").Process(
            target=crowd_process,
            args=((parts.hostname, parts.port), args.idle, args.slow, args.byte_interval_s, child),
        )

    async def start(self) -> None:
        self.process.start()
        ready = await asyncio.to_thread(self.conn.recv)
        assert ready == "ready", ready

    async def stop(self) -> dict:
        self.conn.send("stop")
        report = await asyncio.to_thread(self.conn.recv)
        await asyncio.to_thread(self.process.join)
        return report


async def phase(args: argparse.Namespace, url: str, server_pid: int, crowded: bool) -> dict:
    """One normal load, beside the crowd or not, with the server's CPU use meanwhile."""
    crowd = CrowdProcess(args, url) if crowded else None
    if crowd:
        await crowd.start()
        await asyncio.sleep(args.settle_s)  # the slow clients have begun
    pids = process_and_children(server_pid)
    cpu, start = cpu_seconds(pids), time.monotonic()
    run = await normal_load(url, args.requests, args.concurrency, args.max_tokens)
    run["server_cpu_ms_per_s"] = 1000 * (cpu_seconds(pids) - cpu) / (time.monotonic() - start)
    if crowd:
        run["crowd"] = await crowd.stop()
    return run


async def crowd_cost(args: argparse.Namespace, url: str, server_pid: int) -> dict:
    """The server's CPU with no load, without and then beside the crowd, and the crowd's own."""
    pids = process_and_children(server_pid)

    async def server_ms_per_s() -> float:
        cpu = cpu_seconds(pids)
        await asyncio.sleep(args.cost_s)
        return 1000 * (cpu_seconds(pids) - cpu) / args.cost_s

    quiet = await server_ms_per_s()
    crowd = CrowdProcess(args, url)
    await crowd.start()
    beside = await server_ms_per_s()
    report = await crowd.stop()
    return {
        "seconds": args.cost_s,
        "server_cpu_ms_per_s_quiet": quiet,
        "server_cpu_ms_per_s_beside_the_crowd": beside,
        "crowd_process_cpu_ms_per_s": report["crowd_process_cpu_ms_per_s"],
        "slow_bytes_per_s": report["slow_bytes_per_s"],
    }


async def compare(args: argparse.Namespace, url: str, server_pid: int) -> dict:
    """Alone, beside the crowd, alone, ... (args.rounds crowded runs, each between two alone):
    each crowded p99 over the mean of its two neighbours'."""
    await normal_load(url, args.concurrency, args.concurrency, args.max_tokens)  # warm-up
    cost = await crowd_cost(args, url, server_pid)
    runs = [await phase(args, url, server_pid, crowded=False)]
    ratios = []
    for _ in range(args.rounds):
        runs.append(await phase(args, url, server_pid, crowded=True))
        runs.append(await phase(args, url, server_pid, crowded=False))
        baseline = (runs[-3]["p99_s"] + runs[-1]["p99_s"]) / 2
        ratios.append(runs[-2]["p99_s"] / baseline)
    median = statistics.median(ratios)
    return {
        "processes": "server: python -m asyncllm.serve; normal load: this process (asyncio, "
        "aiohttp); crowd: a process of its own (multiprocessing spawn, one selector)",
        "crowd_cost_without_load": cost,
        "runs": runs,
        "p99_ratios": ratios,
        "p99_ratio": median,
        "p99_ratio_spread": [min(ratios), max(ratios)],
        "within_10_pct": median <= 1.10,
        "crowd_closes_by_server": sum(
            (
                Counter({k: v for k, v in r["crowd"].items() if "closed" in k or "408" in k})
                for r in runs
                if "crowd" in r
            ),
            Counter(),
        ),
    }


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--idle", type=int, default=1000)
    parser.add_argument("--slow", type=int, default=200)
    parser.add_argument("--byte-interval-s", type=float, default=0.1)
    parser.add_argument(
        "--settle-s", type=float, default=1.0, help="the crowd's head start before each load"
    )
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--rounds", type=int, default=3, help="crowded runs, each between two alone"
    )
    parser.add_argument(
        "--cost-s", type=float, default=10.0, help="seconds of the no-load CPU probe"
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--log", type=Path, default=Path("/tmp/asyncllm_connections_server.log"))
    parser.add_argument("server_args", nargs="*", help="after --: the server's flags")
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = make_parser().parse_args(argv)
    result = run_with_server(
        "connections", argv, args, lambda server: compare(args, server.url, server.process.pid)
    )
    keys = ("crowd_cost_without_load", "p99_ratios", "p99_ratio", "within_10_pct")
    print(json.dumps({k: result[k] for k in keys}, indent=2))
    return result


if __name__ == "__main__":
    main()
