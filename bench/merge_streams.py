"""What merge_streams (the server's multiplexer of a response's engine streams, with keep-alive
ticks and the request's cutoff) adds to each streamed chunk: one engine-like stream of N items,
read through merge_streams and read directly, under uvloop, best of 5 runs.

    python bench/merge_streams.py --out bench/results/merge_streams_cpu.json

The stream is an engine request's: AsyncLLM's per-request collector, whose next item a loop
callback puts after each read.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import platform
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import uvloop

# run as a script, bench/ heads sys.path, where kernels.py would shadow the kernels package
if sys.path[0] == str(Path(__file__).resolve().parent):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from asyncllm.engine.output_processor import RequestOutputCollector  # noqa: E402
from asyncllm.sampling_params import RequestOutputKind  # noqa: E402
from asyncllm.server.streaming import merge_streams  # noqa: E402


async def engine_like(collector: RequestOutputCollector, n: int) -> AsyncIterator[int]:
    """AsyncLLM.generate's loop over its collector, the engine putting the next output in a
    loop callback after each read."""
    loop = asyncio.get_running_loop()
    for i in range(n):
        item = await collector.get()
        loop.call_soon(collector.put, i + 1)
        yield item


async def us_per_item(n: int, merged: bool) -> float:
    loop = asyncio.get_running_loop()
    collector = RequestOutputCollector(RequestOutputKind.FINAL_ONLY)
    cutoff = loop.create_future()
    collector.put(0)
    stream = engine_like(collector, n)
    items = merge_streams([stream], 10.0, cutoff) if merged else stream
    start = time.perf_counter()
    count = 0
    async for _ in items:
        count += 1
    elapsed = time.perf_counter() - start
    cutoff.cancel()
    return elapsed / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    best = {
        mode: min(uvloop.run(us_per_item(args.items, mode == "merged")) for _ in range(5))
        for mode in ("direct", "merged")
    }
    result = {
        "benchmark": "merge_streams",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python " + " ".join(sys.argv),
        "device": f"cpu ({platform.machine()})",
        "versions": {"python": platform.python_version(), "uvloop": uvloop.__version__},
        "items": args.items,
        "us_per_item_direct": best["direct"],
        "us_per_item_merged": best["merged"],
        "us_added_by_merge_streams": best["merged"] - best["direct"],
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
