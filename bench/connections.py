"""Connections: does a crowd of idle and slow connections slow the requests that do work?

Starts `python -m asyncllm.serve` (the default model unless given after --), then runs the same
normal load three times: alone, beside --idle keep-alive connections (each sent one GET /health,
then silent) and --slow clients sending a request's headers a byte every --byte-interval-s
seconds, and alone again. The normal load is --requests streamed completions of --max-tokens
tokens at --concurrency in flight. Its p99 end-to-end latency beside the crowd is compared with
the mean of the two runs without (the target: within 10%).

Timeouts that bound such clients (README, Reliability): a connection that has not sent a whole
request within --keep-alive-timeout seconds of connecting (or of its last response) is closed,
so headers sent a byte at a time take at most that long; a body being read has no timeout of its
own beyond the request's size limit. The crowd must outlive the normal load for the comparison to
mean anything: on a CPU the load takes minutes, so give the server a longer timeout
(`-- --keep-alive-timeout 900`); the result says whether every crowd connection was still open
at the end (`crowd_lasted`).

The result JSON (--out, default bench/results/connections_<device>.json) holds the three runs'
latency percentiles, the ratio, how many crowd connections were still open at the end, and the
machine (CPU model, vector extensions, device).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
from soak import run_with_server


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


async def idle_connection(
    host: str, port: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    await writer.drain()
    await reader.readuntil(b"\r\n\r\n")  # /health has no body
    return reader, writer


async def slow_client(host: str, port: int, interval: float, stop: asyncio.Event) -> bool:
    """Sends a request's headers a byte at a time until `stop`; True if still connected then."""
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        "X-Padding: " + "x" * 4000 + "\r\n"
    ).encode()
    _, writer = await asyncio.open_connection(host, port)
    try:
        for byte in request:
            if stop.is_set():
                return True
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(interval)
        return True
    except ConnectionError:
        return False
    finally:
        writer.close()


def still_open(writer: asyncio.StreamWriter, reader: asyncio.StreamReader) -> bool:
    return not writer.is_closing() and not reader.at_eof()


async def beside_the_crowd(args: argparse.Namespace, url: str) -> tuple[dict, dict]:
    host, port = urlsplit(url).hostname, urlsplit(url).port
    idle = await asyncio.gather(*(idle_connection(host, port) for _ in range(args.idle)))
    stop = asyncio.Event()
    slow = [
        asyncio.ensure_future(slow_client(host, port, args.byte_interval_s, stop))
        for _ in range(args.slow)
    ]
    await asyncio.sleep(1.0)  # the slow clients have begun
    run = await normal_load(url, args.requests, args.concurrency, args.max_tokens)
    stop.set()
    slow_open = sum(await asyncio.gather(*slow))
    crowd = {
        "idle": args.idle,
        "idle_still_open": sum(still_open(w, r) for r, w in idle),
        "slow": args.slow,
        "slow_still_open": slow_open,
    }
    for _, writer in idle:
        writer.close()
    return run, crowd


async def compare(args: argparse.Namespace, url: str) -> dict:
    await normal_load(url, args.concurrency, args.concurrency, args.max_tokens)  # warm-up
    alone = await normal_load(url, args.requests, args.concurrency, args.max_tokens)
    crowded, crowd = await beside_the_crowd(args, url)
    again = await normal_load(url, args.requests, args.concurrency, args.max_tokens)
    baseline = (alone["p99_s"] + again["p99_s"]) / 2
    return {
        "alone": alone,
        "beside_the_crowd": crowded,
        "alone_again": again,
        "crowd": crowd,
        "p99_ratio": crowded["p99_s"] / baseline,
        "within_10_pct": crowded["p99_s"] <= 1.10 * baseline,
        "crowd_lasted": crowd["idle_still_open"] == crowd["idle"]
        and crowd["slow_still_open"] == crowd["slow"],
    }


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--idle", type=int, default=1000)
    parser.add_argument("--slow", type=int, default=200)
    parser.add_argument("--byte-interval-s", type=float, default=0.1)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--log", type=Path, default=Path("/tmp/asyncllm_connections_server.log"))
    parser.add_argument("server_args", nargs="*", help="after --: the server's flags")
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = make_parser().parse_args(argv)
    result = run_with_server("connections", argv, args, lambda server: compare(args, server.url))
    print(json.dumps({k: result[k] for k in ("p99_ratio", "within_10_pct", "crowd")}, indent=2))
    return result


if __name__ == "__main__":
    main()
